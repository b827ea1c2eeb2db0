"""A Flower strategy wrapper: every sampled node trains under a schedule solved for its own memory.

:class:`PoetStrategy` wraps any Flower strategy (FedAvg first): the wrapped strategy samples the nodes and
aggregates as it always does; before each train message leaves, the wrapper asks each new node for its facts
(one ``get_properties`` query: the facts a fleet agent registers, and the budget the node asks for) and plans
it exactly as the fleet coordinator plans a board (``Coordinator.plan_board``, i.e.
:meth:`host.fleet.planning.Planner.plan_board`): the budget in bytes, as a share of the no-remat peak or
``auto`` from the node's memory; the node's profile; the solver and the schedule cache, so identical nodes
cost one solve. The job and the archive go in that node's train config. A node whose budget is below the
model's floor is reported (:attr:`PoetStrategy.refused`, a warning) and left out of the round, never crashed.
``plain=True`` sends the same job without a schedule.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flwr.common import FitIns, GetPropertiesIns, Parameters, ndarrays_to_parameters
from flwr.server.strategy import Strategy

from device_agent.flower.node import (
    CONFIG_ARCHIVE,
    CONFIG_JOB,
    CONFIG_PLAIN,
    PROPERTY_FACTS,
    PROPERTY_RAM_BUDGET,
    archive_arrays,
)
from host.fleet import serde
from host.fleet.model_package import package_model
from host.fleet.planning import DEFAULT_RUNTIME_FACTOR
from host.fleet.service import Coordinator
from host.fleet.status import RunStatus
from host.fleet.store import RunStore, sqlite_url
from host.fleet.validation import BoardInputError, check_facts

fleet_pb2 = serde.fleet_pb2
log = logging.getLogger("poet.flower")

__all__ = ["PoetStrategy", "StrategyConfigError", "parse_budget"]

DEFAULT_QUERY_TIMEOUT_S = 600.0


class StrategyConfigError(ValueError):
    """A strategy argument or a node's answer the wrapper cannot plan with; the message names the fix."""


def parse_budget(value: Any):
    """A budget as `poet run --ram-budget` takes it (bytes, a unit, a share, ``auto``) as a poet.v1.RamBudget."""
    import argparse

    from host.cli.fleet import parse_ram_budget

    try:
        return parse_ram_budget(str(value))
    except argparse.ArgumentTypeError as error:
        raise StrategyConfigError(f"RAM budget {value!r}: {error}") from None


class PoetStrategy(Strategy):
    """``strategy`` with a POET schedule per node. ``model`` is a zoo name or ``module:callable`` (traced here)."""

    def __init__(self, strategy: Strategy, *, model: str, work_dir: str | Path, ram_budget: Any = "auto",
                 steps: int = 10, lr: float = 0.01, optimizer: str = "sgd", batch_size: int | None = None,
                 seed: int = 0, runtime_budget: float = DEFAULT_RUNTIME_FACTOR, plain: bool = False,
                 no_paging: bool = False, no_remat: bool = False, solve_time_limit_s: float | None = None,
                 query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S) -> None:
        if optimizer not in serde.OPTIMIZER_TO_PB:
            raise StrategyConfigError(f"optimizer {optimizer!r}: use one of {', '.join(serde.OPTIMIZER_TO_PB)}")
        if steps < 1:
            raise StrategyConfigError(f"steps = {steps}: each round trains at least one step per node")
        self.inner = strategy
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.default_budget = parse_budget(ram_budget)
        self.plain = plain
        self.optimizer = optimizer
        self.runtime_budget = float(runtime_budget)
        self.query_timeout_s = query_timeout_s
        self.package = package_model(model, self.work_dir / "models", batch_size=batch_size, seed=seed)
        self.archive = self.package.path.read_bytes()
        self.weight_names, self._initial = archive_arrays(self.package.path)
        self.spec = {"model_digest": self.package.digest, "model_size_bytes": self.package.size_bytes,
                     "steps": steps, "optimizer": optimizer, "lr": lr, "collect": "none", "seed": seed,
                     "batch_size": self.package.batch_size,
                     "grouping_json": serde.grouping_to_json(self.package.grouping)}
        self.no_paging, self.no_remat = no_paging, no_remat
        self._planner = None
        self._solve_time_limit_s = solve_time_limit_s
        self.facts: dict[int, dict[str, Any]] = {}  # node id -> its facts (asked once)
        self.node_budgets: dict[int, Any] = {}  # node id -> the poet.v1.RamBudget it is planned with
        self.plans: dict[int, dict[str, Any]] = {}  # node id -> its latest plan (budget, floor, status, prediction)
        self.refused: list[dict[str, Any]] = []  # {"round", "node", "status", "detail"} per node left out of a round
        self.rounds: dict[int, list[dict[str, Any]]] = {}  # round -> per-node figures of the nodes that trained
        self.failures: list[dict[str, Any]] = []  # {"round", "node" (None if unknown), "detail"} per failed train
        self.parameters: Parameters | None = None  # the latest aggregated parameters

    def __repr__(self) -> str:
        return f"PoetStrategy({self.inner!r}, model={self.package.model!r}, plain={self.plain})"

    @property
    def examples_per_round(self) -> int:
        """Samples each node trains on per round (its ``num_examples``): steps x batch size."""
        return int(self.spec["steps"]) * int(self.package.batch_size)

    # ------------------------------------------------------------------------------------------ planning
    @property
    def planner(self) -> Coordinator:
        """The fleet coordinator's planning state (profiles, schedule cache) on a store of its own, made once."""
        if self._planner is None:
            state = self.work_dir / "planner"
            state.mkdir(parents=True, exist_ok=True)
            kwargs = {} if self._solve_time_limit_s is None else {"solve_time_limit_s": self._solve_time_limit_s}
            self._planner = Coordinator(RunStore(sqlite_url(state)), state, refine_profiles=False,
                                        solver_workers=0, **kwargs)
        return self._planner

    def node_facts(self, proxy, server_round: int) -> dict[str, Any]:
        """The node's facts and budget, asked once with a get_properties query (StrategyConfigError if unusable)."""
        if proxy.node_id not in self.facts:
            try:
                reply = proxy.get_properties(GetPropertiesIns(config={}), timeout=self.query_timeout_s,
                                             group_id=str(server_round))
            except Exception as error:  # the node's ClientApp failed or the query timed out: this node only
                raise StrategyConfigError(f"node {proxy.node_id} did not answer the facts query: {error}") from None
            properties = reply.properties
            if PROPERTY_FACTS not in properties:
                raise StrategyConfigError(f"node {proxy.node_id} answered without {PROPERTY_FACTS!r}: run "
                                          "device_agent.flower's PoetClient (or PoetNode.properties) on it")
            try:
                request = fleet_pb2.RegisterRequest.FromString(bytes(properties[PROPERTY_FACTS]))
                facts = check_facts(serde.facts_from_register(request))
            except BoardInputError as error:
                raise StrategyConfigError(f"node {proxy.node_id}: {error}") from None
            except Exception as error:  # a payload that is not a RegisterRequest
                raise StrategyConfigError(f"node {proxy.node_id}: {PROPERTY_FACTS!r} does not parse ({error})") from None
            asked = str(properties.get(PROPERTY_RAM_BUDGET) or "")
            self.node_budgets[proxy.node_id] = parse_budget(asked) if asked else self.default_budget
            self.facts[proxy.node_id] = facts
        return self.facts[proxy.node_id]

    def plan(self, proxy, server_round: int):
        """(plan dict, poet.v1.Job or None) for one node; the job is None when it is left out of the round."""
        facts = self.node_facts(proxy, server_round)
        agent = SimpleNamespace(name=f"flower-node-{proxy.node_id}", facts=facts, platform=facts.get("platform") or "local")
        request = fleet_pb2.SubmitRunRequest(no_paging=self.no_paging, no_remat=self.no_remat)
        request.ram_budget.CopyFrom(self.node_budgets[proxy.node_id])
        board, schedule_json = self.planner.plan_board(agent, self.package.graph, request, self.optimizer,
                                                       self.runtime_budget)
        plan = {"node": proxy.node_id, "status": str(board.status), "ram_budget_bytes": board.ram_budget_bytes,
                "min_ram_budget_bytes": board.min_ram_budget_bytes, "predicted": board.predicted,
                "predicted_counts": board.counts, "profile": board.profile, "detail": board.detail}
        self.plans[proxy.node_id] = plan
        if board.status != RunStatus.QUEUED:
            return plan, None
        return plan, serde.job_message(self.spec, job_id=f"flower-r{server_round}", run_id=uuid.uuid4().hex[:12],
                                       kind="train", schedule_json=schedule_json)

    # ------------------------------------------------------------------------------------------ Strategy
    def initialize_parameters(self, client_manager):
        """The model's own weights (from its archive), in the order the nodes read them."""
        return ndarrays_to_parameters(self._initial)

    def configure_fit(self, server_round, parameters, client_manager):
        chosen = []
        for proxy, fit_ins in self.inner.configure_fit(server_round, parameters, client_manager):
            config = dict(fit_ins.config)  # the wrapped strategy may share one FitIns among all nodes
            if self.plain:
                job = serde.job_message(self.spec, job_id=f"flower-r{server_round}", run_id=uuid.uuid4().hex[:12],
                                        kind="train", schedule_json=None)
                config[CONFIG_PLAIN] = True
            else:
                try:
                    plan, job = self.plan(proxy, server_round)
                except StrategyConfigError as error:
                    plan, job = {"status": "failed", "detail": str(error)}, None
                if job is None:
                    entry = {"round": server_round, "node": proxy.node_id, "status": plan["status"],
                             "ram_budget_bytes": plan.get("ram_budget_bytes"),
                             "min_ram_budget_bytes": plan.get("min_ram_budget_bytes"), "detail": plan["detail"]}
                    self.refused.append(entry)
                    log.warning("round %d: node %d left out (%s): %s", server_round, proxy.node_id, plan["status"],
                                plan["detail"])
                    continue
            config[CONFIG_JOB] = job.SerializeToString()
            config[CONFIG_ARCHIVE] = self.archive
            chosen.append((proxy, FitIns(fit_ins.parameters, config)))
        return chosen

    def aggregate_fit(self, server_round, results, failures):
        rows = []
        for proxy, fit_res in results:
            plan = self.plans.get(proxy.node_id, {}) if not self.plain else {}
            row = {"node": proxy.node_id, "ram_budget_bytes": plan.get("ram_budget_bytes"),
                   "min_ram_budget_bytes": plan.get("min_ram_budget_bytes"), "num_examples": fit_res.num_examples}
            row.update(dict(fit_res.metrics))
            if plan.get("predicted"):
                row["predicted"] = dict(plan["predicted"], **plan.get("predicted_counts", {}))
            rows.append(row)
        self.rounds[server_round] = sorted(rows, key=lambda r: r["node"])
        for failure in failures:  # an exception, or a (proxy, FitRes) whose status is not OK
            node = failure[0].node_id if isinstance(failure, tuple) else None
            detail = failure[1].status.message if isinstance(failure, tuple) else str(failure)
            self.failures.append({"round": server_round, "node": node, "detail": detail[:2000]})
            log.warning("round %d: a node failed: %s", server_round, detail[:2000])
        aggregated, metrics = self.inner.aggregate_fit(server_round, results, failures)
        if aggregated is not None:
            self.parameters = aggregated
        return aggregated, metrics

    def configure_evaluate(self, server_round, parameters, client_manager):
        return self.inner.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round, results, failures):
        return self.inner.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round, parameters):
        return self.inner.evaluate(server_round, parameters)

    def report(self) -> dict[str, Any]:
        """What happened, as JSON-able values: per round the nodes' figures; the nodes left out and why."""
        return {"model": self.package.model, "model_digest": self.package.digest, "mode": "plain" if self.plain else "poet",
                "weight_names": self.weight_names,
                "rounds": [{"round": r, "nodes": rows} for r, rows in sorted(self.rounds.items())],
                "refused": self.refused, "failures": self.failures, "solves": self._planner.solve_count if self._planner is not None else 0}
