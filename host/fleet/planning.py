"""Planning a submission: the model (a zoo model traced here, or an operator's uploaded archive), each board's
profile and RAM budget, a schedule per board (solved once per distinct case), and the job with one run per board,
stored whole or not at all.

Budgets: ``--ram-budget auto`` gives a board (its memory limit, or its available RAM without one) minus the fixed
bytes (weights, their gradients, optimizer state, the batch) minus the torch runtime's resident memory it measured
minus :data:`AUTO_MARGIN_BYTES`.

Solving: SubmitRun stores the job and its runs and returns at once. A board whose schedule is not solved yet gets a
``solving`` run and the schedule is queued in the store (host/fleet/solving.py solves it, then the run is queued).
Schedules are keyed by (graph fingerprint, profile digest, budget bytes, runtime factor, paging, remat, optimizer):
identical boards cost one solve, and a case solved once (by any submission, or by calibration) is never solved
again, even after a restart.

Models: a zoo name is traced here; a ``module:callable`` never is (its import would run the operator's code in the
coordinator): `poet run` traces it on the operator's side and uploads the archive (host/fleet/uploads.py), which is
checked as boards check it before anything is solved on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from host.fleet import serde
from host.fleet.limits import AUTO_MARGIN_BYTES, SOLVE_TIME_LIMIT_S
from host.fleet.metrics import RunMetrics
from host.fleet.refusal import Refused
from host.fleet.state import FleetState
from host.fleet.status import RunStatus
from host.fleet.uploads import UploadError

fleet_pb2 = serde.fleet_pb2
log = logging.getLogger("poet.fleet")

DEFAULT_RUNTIME_FACTOR = 1.2
DEFAULT_LR = 0.01
DEFAULT_CHECKPOINT_EVERY_STEPS = 0  # 0: the agent's default
UPLOAD_STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "corrupt": grpc.StatusCode.DATA_LOSS,
                 "busy": grpc.StatusCode.ABORTED, "missing": grpc.StatusCode.FAILED_PRECONDITION,
                 "full": grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class BoardPlan:
    """What the coordinator decided for one board of a submitted run."""

    agent: str
    status: RunStatus  # SOLVING, QUEUED, DOES_NOT_FIT or FAILED
    ram_budget_bytes: int | None
    min_ram_budget_bytes: int | None
    schedule_key: str | None
    schedule_fingerprint: str | None
    predicted: dict[str, Any] | None
    counts: dict[str, int]
    detail: str | None
    profile: dict[str, Any] | None = None  # {"name", "version"}: the profile the schedule was solved on
    problem: dict[str, Any] | None = None  # SOLVING: what to solve (host/fleet/solving.py)


def plan_from_result(agent: str, which: dict[str, Any] | None, budget: int | None, floor: int | None,
                     schedule_key: str, result: dict[str, Any]) -> BoardPlan:
    """A board's plan from a solve's result (host.fleet.solving.solve_problem)."""
    return BoardPlan(agent, RunStatus(result["status"]), budget, floor, schedule_key,
                     result.get("schedule_fingerprint"), result.get("predicted"),
                     dict(result.get("metrics") or {}), result.get("detail"), which)


class Planner:
    """Models, profiles, budgets and schedules; the package memo (the schedules are kept in the store's solves).

    ``packager`` is :func:`host.fleet.model_package.package_model` (injectable for tests);
    ``local_profile`` measures this machine once, for boards whose platform is neither measured nor shipped.
    """

    def __init__(self, state: FleetState, *, packager: Callable[..., Any] | None = None,
                 solve_time_limit_s: float = SOLVE_TIME_LIMIT_S, local_profile: Callable[[], Any] | None = None):
        self.state = state
        self.store = state.store
        self.models_dir = state.models_dir
        self._packager = packager
        self._local_profile_factory = local_profile
        self.solve_time_limit_s = solve_time_limit_s
        self._packages: dict[tuple, Any] = {}
        self._package_lock = threading.Lock()
        self._solve_lock = threading.Lock()
        self._local_profile = None
        self.solve_count = 0  # solves actually run (cache misses), for tests and logs

    def package(self, model: str, batch_size: int | None, seed: int, granularity: str = "layer"):
        """A zoo model traced here (memoized). A module:callable would be the operator's code: refused, never imported
        (any other name is looked up in the zoo only, and an unknown one is refused listing the zoo's names)."""
        from host.graph.resolve import POET2022_PREFIX

        if ":" in model and not model.startswith(POET2022_PREFIX):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model {model[:200]!r} is not a zoo model (see `poet models`); the coordinator never "
                          "imports an operator's code: `poet run --model module:callable` traces it on your side and "
                          "uploads the archive (update poet-edge on the machine you submit from)")
        key = (model, batch_size, seed, granularity)
        with self._package_lock:
            package = self._packages.get(key)
            if package is None:
                packager = self._packager
                if packager is None:
                    from host.fleet.model_package import package_model as packager
                package = packager(model, self.models_dir, batch_size=batch_size, seed=seed, granularity=granularity)
                self._packages[key] = package
            return package

    def model_package(self, request):
        """The package a submission names: the operator's uploaded archive, checked as a board checks it, or a zoo
        model traced here."""
        if not request.HasField("uploaded_model"):
            return self.package(request.model, request.batch_size or None, request.seed, request.granularity or "layer")
        try:
            return self.state.uploads.package(request.model or request.uploaded_model.digest[:12], request.uploaded_model)
        except UploadError as error:
            raise Refused(UPLOAD_STATUS[error.kind], str(error)) from None

    def job_graph(self, spec: dict[str, Any]):
        """The TrainingGraph a job's schedules were solved on (stored with the job; a job stored before that: its zoo
        model traced again)."""
        from host.graph.training_graph import TrainingGraph

        if spec.get("graph"):
            return TrainingGraph.from_dict(spec["graph"])
        return self.package(spec["model"], spec.get("batch_size") or None, int(spec.get("seed") or 0),
                            spec.get("granularity") or "layer").graph

    def board_profile(self, agent, pinned_version: int = 0):
        """(profile, which) for a board: a pinned stored version, else its latest stored version, else the shipped
        platform it names, else this machine's. ``which`` is {"name", "version"}: version N, "shipped:NAME" or
        "local", what the run records."""
        from host.costs import PlatformProfile, list_platforms, load_profile

        if pinned_version:
            stored = self.store.get_profile_version(agent.name, pinned_version)
            if stored is None:
                have = [v.version for v in self.store.list_profile_versions(agent.name)]
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"board {agent.name!r} has no profile version {pinned_version} (it has "
                               f"{', '.join(map(str, have)) or 'none'}; see `poet profiles list --agent {agent.name}`)")
        else:
            stored = self.store.latest_profile(agent.name)
        if stored is not None:
            profile = PlatformProfile.from_dict(stored.profile,
                                                file_label=f"profile v{stored.version} of {agent.name}")
            return profile, {"name": profile.name, "version": stored.version}
        if agent.platform in list_platforms():
            profile = load_profile(agent.platform)
            return profile, {"name": profile.name, "version": f"shipped:{agent.platform}"}
        with self._solve_lock:
            if self._local_profile is None:
                if self._local_profile_factory is not None:
                    self._local_profile = self._local_profile_factory()
                else:
                    from host.run.sources import load_platform

                    flash = self.state.state_dir / "local-profile-flash"
                    flash.mkdir(parents=True, exist_ok=True)
                    self._local_profile = load_platform("local", flash_dir=flash, log=log.info)
            return self._local_profile, {"name": self._local_profile.name, "version": "local"}

    def board_case(self, agent, graph, request, optimizer: str, runtime_factor: float) -> BoardPlan:
        """Budget and price one board, without solving: a plan that is final (DOES_NOT_FIT below the floor; QUEUED,
        DOES_NOT_FIT or FAILED when the store has this schedule solved already), or SOLVING with the problem to queue
        (``plan.problem``), which host/fleet/solving.py solves."""
        from host.costs import price_graph
        from host.solver.solve import minimum_ram_bytes, no_remat_peak_bytes

        profile, which = self.board_profile(agent, request.profile_version)
        graph = graph.with_optimizer(optimizer)  # its state is fixed bytes: in the auto budget and the schedule
        priced = price_graph(graph, profile)
        floor = minimum_ram_bytes(priced)
        budget_kind = request.ram_budget.WhichOneof("budget")
        if budget_kind == "budget_bytes":
            budget = int(request.ram_budget.budget_bytes)
        elif budget_kind == "fraction_of_peak":
            budget = int(request.ram_budget.fraction_of_peak * no_remat_peak_bytes(priced))
        else:
            budget = auto_budget_bytes(agent.facts, graph, optimizer)
        if budget < floor:
            how = auto_budget_text(agent.facts, graph, optimizer) if budget_kind == "auto" else f"{budget} bytes"
            return BoardPlan(agent.name, RunStatus.DOES_NOT_FIT, max(budget, 0), floor, None, None, None, {},
                             f"RAM budget {how} is below the minimum any schedule of {graph.name} can meet: {floor} "
                             f"bytes; give the board more memory or pick a smaller model or batch", which)
        paging, remat = not request.no_paging, not request.no_remat
        key = (graph.fingerprint(), profile_digest(profile), budget, float(runtime_factor), paging, remat, optimizer)
        schedule_key = hashlib.sha256(serde.dumps([list(map(str, key))]).encode()).hexdigest()[:24]
        solved = self.store.get_solve(schedule_key)
        if solved is not None and solved.state == "done":
            return plan_from_result(agent.name, which, budget, floor, schedule_key, solved.result)
        problem = {
            "label": f"{graph.name} for {agent.name} at {budget} bytes on {profile.name}",
            "graph": graph.to_dict(), "optimizer": optimizer, "profile": profile.to_dict(), "budget_bytes": budget,
            "runtime_factor": float(runtime_factor), "time_limit_s": self.solve_time_limit_s, "paging": paging,
            "remat": remat,
        }
        return BoardPlan(agent.name, RunStatus.SOLVING, budget, floor, schedule_key, None, None, {}, None, which,
                         problem)

    def solve(self, problem: dict[str, Any]) -> dict[str, Any]:
        """Solve a queued problem in this process (host/fleet/solving.py's workers and :meth:`plan_board`)."""
        from host.fleet.solving import solve_problem

        result = solve_problem(problem)
        with self._solve_lock:
            self.solve_count += 1
        return result

    def plan_board(self, agent, graph, request, optimizer: str, runtime_factor: float) -> tuple[BoardPlan, str | None]:
        """Budget, price and solve one board now, on the caller's thread (calibration and host/flower, which need
        the answer before going on); (plan, schedule JSON or None). The result is stored as a queued solve's is, so
        a submission of the same case takes it without solving again."""
        plan = self.board_case(agent, graph, request, optimizer, runtime_factor)
        if plan.status != RunStatus.SOLVING:
            return plan, self.state.schedule_json({}, plan.schedule_key) if plan.status == RunStatus.QUEUED else None
        result = self.solve(plan.problem)
        self.store.record_solve(plan.schedule_key, plan.problem, result)
        plan = plan_from_result(agent.name, plan.profile, plan.ram_budget_bytes, plan.min_ram_budget_bytes,
                                plan.schedule_key, result)
        return plan, result.get("schedule_json")

    def targets(self, request) -> list:
        known = {a.name: a for a in self.store.list_agents()}
        if request.all_agents:
            now = time.time()
            chosen = [a for a in known.values() if a.online(now, self.state.heartbeat_timeout_s)]
            if not chosen:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                               "no agent is online; start `poet-agent run` on a board (see `poet fleet list`)")
            return chosen
        names = list(dict.fromkeys(request.agents))
        if not names:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "name the boards (--agents A,B) or pass --all")
        unknown = [n for n in names if n not in known]
        if unknown:
            listing = ", ".join(sorted(known)) or "none has registered"
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"unknown agent(s): {', '.join(unknown)}; known agents: {listing} (see `poet fleet list`)")
        return [known[n] for n in names]

    def submit(self, request) -> list:
        from host.graph.granularity import parse_granularity
        from host.run.errors import UserError

        kind = serde.JOB_KIND_FROM_PB.get(request.kind or fleet_pb2.JOB_KIND_TRAIN)
        optimizer = serde.OPTIMIZER_FROM_PB.get(request.optimizer or fleet_pb2.OPTIMIZER_SGD)
        collect = serde.COLLECT_FROM_PB.get(request.collect or fleet_pb2.COLLECT_NONE)
        if kind is None or optimizer is None or collect is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "unknown job kind, optimizer or collect value")
        runtime_factor = request.runtime_budget or DEFAULT_RUNTIME_FACTOR
        if request.granularity:
            try:
                parse_granularity(request.granularity)
            except ValueError as error:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        if request.compile and kind != "train":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"--compile runs the node functions through inductor, whose fused kernels round differently "
                          f"from eager's; a {kind} job runs uncompiled: drop --compile"
                          + (" (verify compares bitwise with eager)" if kind == "verify" else ""))
        if request.no_paging and request.no_remat:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           "--no-paging and --no-remat together leave only plain training: give at most one "
                           "(or a RAM budget of 100%)")
        if runtime_factor < 1.0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"runtime budget {runtime_factor} is below 1.0; give a factor >= 1.0 (e.g. 1.2)")
        if kind != "profile":
            if not request.model:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "no model given; pass --model (see `poet models`)")
            if not request.dataset:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "no dataset given; pass --dataset NAME")
            if request.steps < 1:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "steps must be >= 1; pass --steps N")
            budget_kind = request.ram_budget.WhichOneof("budget")
            if budget_kind is None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "no RAM budget; pass --ram-budget BYTES|PCT|auto")
            if budget_kind == "fraction_of_peak" and not 0 < request.ram_budget.fraction_of_peak <= 1:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a share of the no-remat peak must be in (0, 1]")
            if budget_kind == "budget_bytes" and not request.ram_budget.budget_bytes > 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a RAM budget in bytes must be positive")
        boards = self.targets(request)
        spec: dict[str, Any] = {
            "model": request.model, "dataset": request.dataset, "steps": request.steps, "optimizer": optimizer,
            "lr": request.lr or DEFAULT_LR, "collect": collect, "seed": request.seed,
            "runtime_budget": runtime_factor, "checkpoint_every_steps": DEFAULT_CHECKPOINT_EVERY_STEPS,
            "ram_budget": json.loads(serde.json_format.MessageToJson(request.ram_budget)) if kind != "profile" else None,
            "profile_version": request.profile_version or None,
            "paging": not request.no_paging, "remat": not request.no_remat,
            "granularity": request.granularity or "layer", "compile": request.compile,
        }
        plans: list[BoardPlan] = []
        solve_problems: dict[str, dict[str, Any]] = {}
        if kind == "profile":
            plans = [BoardPlan(a.name, RunStatus.QUEUED, None, None, None, None, None, {}, None) for a in boards]
        else:
            try:
                package = self.model_package(request)
                check_datasets(request.dataset, boards, package.grouping)
                for agent in boards:
                    plan = self.board_case(agent, package.graph, request, optimizer, runtime_factor)
                    plans.append(plan)
                    if plan.problem is not None:
                        solve_problems[plan.schedule_key] = plan.problem
            except UserError as error:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(error).strip("'\"")) from None
            spec.update(model_digest=package.digest, model_size_bytes=package.size_bytes,
                        grouping_json=serde.grouping_to_json(package.grouping), batch_size=package.batch_size,
                        graph_fingerprint=package.graph.fingerprint(), graph=package.graph.to_dict(),
                        uploaded=request.HasField("uploaded_model"),
                        granularity=package.grouping.granularity or spec["granularity"])  # an upload's, as traced
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        run_specs = []
        for plan in plans:
            metrics = RunMetrics.changes(schedule_key=plan.schedule_key, min_ram_budget_bytes=plan.min_ram_budget_bytes,
                                         steps_done=0, **plan.counts)
            if plan.profile is not None:
                metrics.update(RunMetrics.changes(profile_name=plan.profile["name"],
                                                  profile_version=plan.profile["version"]))
            run_specs.append({"run_id": f"run-{uuid.uuid4().hex[:12]}", "agent": plan.agent, "status": plan.status,
                              "ram_budget_bytes": plan.ram_budget_bytes, "predicted": plan.predicted,
                              "schedule_fingerprint": plan.schedule_fingerprint, "detail": plan.detail,
                              "metrics": metrics})
        # all the boards' runs, or none; their solves queued (one per distinct schedule)
        runs = self.store.create_submission(job_id, kind, spec, run_specs, solve_problems=solve_problems)
        self.state.remember_spec(job_id, spec)
        if solve_problems:
            self.state.wake_solvers()
        self.state.notify_work()
        return [serde.run_info(run, spec) for run in runs]


def check_datasets(dataset: str, boards: list, grouping) -> None:
    """Refused (INVALID_ARGUMENT, nothing created) unless every board reported ``dataset`` with the model's sample
    shape and no more classes than the model has. Boards that do not report their datasets (older agents) and the
    synthetic dataset, which every board makes in the model's shape, are not checked."""
    from device_agent.agent.datasets import SYNTHETIC_DATASET

    if dataset == SYNTHETIC_DATASET:
        return
    sample_shape = [int(d) for d in grouping.batch_shape[1:]]
    problems = []
    for agent in boards:
        if not agent.facts.get("datasets_reported"):
            continue
        held = {d["name"]: d for d in agent.facts.get("datasets") or []}
        found = held.get(dataset)
        if found is None:
            names = ", ".join(sorted(held)) or "none"
            problems.append(f"{agent.name} has no dataset {dataset!r} (it has: {names})")
        elif list(found["item_shape"]) != sample_shape:
            problems.append(f"{agent.name}'s {dataset!r} has samples of shape {tuple(found['item_shape'])}, but "
                            f"the model takes {tuple(sample_shape)}")
        elif grouping.num_classes and found["classes"] > grouping.num_classes:
            problems.append(f"{agent.name}'s {dataset!r} has labels up to {found['classes'] - 1}, but the model "
                            f"has {grouping.num_classes} classes")
    if problems:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      "; ".join(problems) + ": pick a dataset made for this model, or put one in the boards' data "
                      "dir (`poet-agent datasets list` shows what a board holds) and restart their agents so they "
                      "report it")


def auto_budget_bytes(facts: dict[str, Any], graph, optimizer: str = "sgd") -> int:
    """`--ram-budget auto`: (memory limit, or available RAM) - fixed bytes - runtime RSS - AUTO_MARGIN_BYTES; on a
    microcontroller (the serial bridge), whose weights live outside its activation arena: the arena."""
    if int(facts.get("activation_arena_bytes") or 0):
        return int(facts["activation_arena_bytes"])
    limit = int(facts.get("memory_limit_bytes") or 0) or int(facts.get("ram_available_bytes") or 0)
    return limit - fixed_bytes(graph, optimizer) - int(facts.get("runtime_rss_bytes") or 0) - AUTO_MARGIN_BYTES


def auto_budget_text(facts: dict[str, Any], graph, optimizer: str = "sgd") -> str:
    if int(facts.get("activation_arena_bytes") or 0):
        return f"auto = the microcontroller's activation arena, {auto_budget_bytes(facts, graph, optimizer)} bytes"
    limit = int(facts.get("memory_limit_bytes") or 0)
    source = "memory limit" if limit else "available RAM"
    limit = limit or int(facts.get("ram_available_bytes") or 0)
    return (f"auto = {source} {limit} - fixed {fixed_bytes(graph, optimizer)} - runtime RSS "
            f"{int(facts.get('runtime_rss_bytes') or 0)} - margin {AUTO_MARGIN_BYTES} = "
            f"{auto_budget_bytes(facts, graph, optimizer)} bytes")


def fixed_bytes(graph, optimizer: str = "sgd") -> int:
    """The graph's fixed bytes with ``optimizer``'s state (the one rule: TrainingGraph.with_optimizer)."""
    return graph.with_optimizer(optimizer).fixed_bytes


def profile_digest(profile) -> str:
    return hashlib.sha256(serde.dumps(profile.to_dict()).encode()).hexdigest()[:16]
