"""The coordinator's gRPC services: `Fleet` for boards (node certificates) and `FleetAdmin` for operators.

Every handler reads the caller's (role, name) from its mutual-TLS certificate
(:func:`host.fleet.certs.peer_identity`), never from a message field, and refuses the wrong role
and removed nodes with PERMISSION_DENIED. All state lives in the run store and the state dir, so a
coordinator restarted on the same store (even after kill -9) hands out the same jobs:

- the job spec (model digest, grouping, hyperparameters) and the solved schedules (poet.v1.Schedule
  JSON, one per distinct schedule) are stored with the job; each run names its schedule's key;
- model archives are ``STATE_DIR/models/<sha256>.pt2``; collected weights
  ``STATE_DIR/results/<run_id>.safetensors``.

Models: a zoo name is traced here; a ``module:callable`` never is (its import would run the operator's code in the
coordinator): `poet run` traces it on the operator's side and uploads the archive (host/fleet/uploads.py), which is
checked as boards check it before anything is solved on it.

Budgets: ``--ram-budget auto`` gives a board (its memory limit, or its available RAM without one)
minus the fixed bytes (weights, their gradients, optimizer state, the batch) minus the torch
runtime's resident memory it measured minus :data:`AUTO_MARGIN_BYTES`. Schedules are cached by
(graph fingerprint, profile digest, budget bytes, runtime factor): identical boards cost one solve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from device_agent import protos
from host.fleet import serde
from host.fleet.admission import CallLimitError, CallSlots, IdleWatch
from host.fleet.certs import IdentityError, peer_identity
from host.fleet.limits import (
    AUTO_MARGIN_BYTES,
    DOWNLOAD_IDLE_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    LIST_PAGE_BYTES,
    LIST_PAGE_SIZE,
    MAX_LIST_PAGE_SIZE,
    MAX_MESSAGE_BYTES,
    MAX_PULL_WAIT_S,
    MODEL_CHUNK_BYTES,
    SOLVE_TIME_LIMIT_S,
)
from host.fleet.refusal import Refused
from host.fleet.status import OPEN, RunStatus
from host.fleet.store import (
    AgentRemovedError,
    RunStore,
    StoreError,
    UnknownAgentError,
    UnknownRunError,
)
from host.fleet.uploads import UploadedArchives, UploadError
from host.fleet.validation import (
    BoardInputError,
    bounded_error,
    check_facts,
    check_result,
    check_telemetry_batch,
    first_non_finite,
)

fleet_pb2 = serde.fleet_pb2
fleet_pb2_grpc = protos.load("poet.v1.fleet_pb2_grpc")

log = logging.getLogger("poet.fleet")

DEFAULT_RUNTIME_FACTOR = 1.2
DEFAULT_LR = 0.01
DEFAULT_CHECKPOINT_EVERY_STEPS = 0  # 0: the agent's default
NODE, OPERATOR = "node", "operator"
UPLOAD_STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "corrupt": grpc.StatusCode.DATA_LOSS,
                 "busy": grpc.StatusCode.ABORTED, "missing": grpc.StatusCode.FAILED_PRECONDITION,
                 "full": grpc.StatusCode.RESOURCE_EXHAUSTED}
MODELS_DIR, RESULTS_DIR = "models", "results"


@dataclass(frozen=True)
class BoardPlan:
    """What the coordinator decided for one board of a submitted run."""

    agent: str
    status: RunStatus  # QUEUED, DOES_NOT_FIT or FAILED
    ram_budget_bytes: int | None
    min_ram_budget_bytes: int | None
    schedule_key: str | None
    schedule_fingerprint: str | None
    predicted: dict[str, Any] | None
    counts: dict[str, int]
    detail: str | None
    profile: dict[str, Any] | None = None  # {"name", "version"}: the profile the schedule was solved on


class Coordinator:
    """The state behind both services: the store, the state dir, the package memo and the schedule cache.

    ``packager`` is :func:`host.fleet.model_package.package_model` (injectable for tests);
    ``local_profile`` measures this machine once, for boards whose platform is neither measured nor shipped.
    ``refine_profiles``: done TRAIN and VERIFY runs refine calibrated boards' profiles (host.fleet.calibration.Refiner).
    """

    def __init__(self, store: RunStore, state_dir: str | Path, *, packager: Callable[..., Any] | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 solve_time_limit_s: float = SOLVE_TIME_LIMIT_S, local_profile: Callable[[], Any] | None = None,
                 refine_profiles: bool = True, download_idle_s: float = DOWNLOAD_IDLE_S):
        self.store = store
        self.state_dir = Path(state_dir)
        self.models_dir = self.state_dir / MODELS_DIR
        self.results_dir = self.state_dir / RESULTS_DIR
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.uploads = UploadedArchives(self.models_dir)
        self._packager = packager
        self._local_profile_factory = local_profile
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.solve_time_limit_s = solve_time_limit_s
        self._work = threading.Condition()
        self._generation = 0  # bumped whenever work may have appeared
        self._packages: dict[tuple, Any] = {}
        self._package_lock = threading.Lock()
        self._schedules: dict[tuple, tuple[Any, Any]] = {}  # cache key -> (SolveResult, schedule JSON)
        self._solve_lock = threading.Lock()
        self._local_profile = None
        self._result_lock = threading.Lock()
        self._run_owner: dict[str, str] = {}  # run id -> the board it is assigned to (telemetry checks)
        self.slots = CallSlots()  # each board's open calls (host/fleet/admission.py)
        self.download_idle_s = download_idle_s
        self.solve_count = 0  # solves actually run (cache misses), for tests and logs
        self._specs: dict[str, dict[str, Any]] = {}  # job_id -> spec (immutable once stored)
        self.calibrations: dict[str, Any] = {}  # calibration id -> host.fleet.calibration.Calibration (in memory)
        self.refiner = None
        if refine_profiles:
            from host.fleet.calibration import Refiner

            self.refiner = Refiner(self)

    # ------------------------------------------------------------------------------------ identity
    def caller(self, context, role: str) -> str:
        """The caller's name, if its certificate has ``role`` (and, for a node, it was not removed)."""
        try:
            caller_role, name = peer_identity(context.auth_context())
        except IdentityError as error:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"{error}; connect with a bundle from `poet certs issue`") from None
        if caller_role != role:
            if role == NODE:
                fix = "the Fleet service is for boards: run `poet-agent run` with a node bundle (`poet certs issue --node NAME`)"
            else:
                fix = ("the FleetAdmin service is for operators: use a bundle from `poet certs issue --operator NAME` "
                       "(POET_CERTS or --certs)")
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{caller_role} {name!r} may not call this: {fix}")
        if role == NODE and self.store.is_removed(name):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"node {name!r} was removed with `poet fleet remove` and is refused; issue a certificate "
                           f"under a new name (`poet certs issue --node NEW_NAME`) to bring the board back")
        return name

    # ------------------------------------------------------------------------------------ work signal
    def notify_work(self) -> None:
        with self._work:
            self._generation += 1
            self._work.notify_all()

    # ------------------------------------------------------------------------------------ jobs
    def spec(self, job_id: str) -> dict[str, Any]:
        spec = self._specs.get(job_id)
        if spec is None:
            spec = self.store.get_job(job_id).spec
            self._specs[job_id] = spec
        return spec

    def next_job(self, agent: str):
        """This agent's oldest queued or running run as a Job (marked running), or None."""
        for run in self.store.list_runs(agent=agent, status=OPEN):
            spec = self.spec(run.job_id)
            if run.status == RunStatus.QUEUED:
                run = self.store.update_run(run.run_id, status=RunStatus.RUNNING)
            key = run.metrics.get("schedule_key")
            schedule_json = spec.get("schedules", {}).get(key) if key else None
            return serde.job_message(spec, job_id=run.job_id, run_id=run.run_id, kind=run.kind,
                                     schedule_json=schedule_json)
        return None

    def pull(self, agent: str, wait_s: float, context) -> Any:
        deadline = time.monotonic() + max(0.0, min(wait_s, MAX_PULL_WAIT_S))
        context.add_callback(self.notify_work)  # a cancelled long poll wakes up and returns
        replaced = self.slots.new_poll(agent)
        self.notify_work()  # this board's older poll, if any, sees it was replaced and returns
        while True:
            if replaced():
                return None
            with self._work:
                generation = self._generation
            job = self.next_job(agent)
            if job is not None:
                return job
            with self._work:
                while self._generation == generation and context.is_active() and not replaced():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._work.wait(remaining)
            if not context.is_active() or time.monotonic() >= deadline:
                return self.next_job(agent) if context.is_active() else None

    def assigned_run(self, agent: str, run_id: str):
        """The run, if it is assigned to ``agent``."""
        try:
            run = self.store.get_run(run_id)
        except UnknownRunError:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no run {run_id!r} on this coordinator") from None
        if run.agent != agent:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"run {run_id!r} is not assigned to node {agent!r}; report only runs handed to you by PullJob")
        return run

    def model_path(self, agent: str, digest: str) -> Path:
        """The archive of ``digest``, if some run assigned to ``agent`` uses it."""
        for run in self.store.list_runs(agent=agent):
            if self.spec(run.job_id).get("model_digest") == digest:
                path = self.models_dir / f"{digest}.pt2"
                if path.is_file():
                    return path
                break
        raise Refused(grpc.StatusCode.NOT_FOUND,
                       f"no model {digest!r} for this node (only the models of runs assigned to it can be fetched)")

    # ------------------------------------------------------------------------------------ submit
    def package(self, model: str, batch_size: int | None, seed: int):
        """A zoo model traced here (memoized). Anything else would be the operator's code: refused, never imported."""
        from host.graph.resolve import POET2022_PREFIX
        from host.graph.zoo import ZOO

        if model not in ZOO and not model.startswith(POET2022_PREFIX):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model {model[:200]!r} is not a zoo model (see `poet models`); the coordinator never "
                          "imports an operator's code: `poet run --model module:callable` traces it on your side and "
                          "uploads the archive (update poet-edge on the machine you submit from)")
        key = (model, batch_size, seed)
        with self._package_lock:
            package = self._packages.get(key)
            if package is None:
                packager = self._packager
                if packager is None:
                    from host.fleet.model_package import package_model as packager
                package = packager(model, self.models_dir, batch_size=batch_size, seed=seed)
                self._packages[key] = package
            return package

    def model_package(self, request):
        """The package a submission names: the operator's uploaded archive, checked as a board checks it, or a zoo
        model traced here."""
        if not request.HasField("uploaded_model"):
            return self.package(request.model, request.batch_size or None, request.seed)
        try:
            return self.uploads.package(request.model or request.uploaded_model.digest[:12], request.uploaded_model)
        except UploadError as error:
            raise Refused(UPLOAD_STATUS[error.kind], str(error)) from None

    def job_graph(self, spec: dict[str, Any]):
        """The TrainingGraph a job's schedules were solved on (stored with the job; a job stored before that: its zoo
        model traced again)."""
        from host.graph.training_graph import TrainingGraph

        if spec.get("graph"):
            return TrainingGraph.from_dict(spec["graph"])
        return self.package(spec["model"], spec.get("batch_size") or None, int(spec.get("seed") or 0)).graph

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

                    flash = self.state_dir / "local-profile-flash"
                    flash.mkdir(parents=True, exist_ok=True)
                    self._local_profile = load_platform("local", flash_dir=flash, log=log.info)
            return self._local_profile, {"name": self._local_profile.name, "version": "local"}

    def plan_board(self, agent, graph, request, optimizer: str, runtime_factor: float) -> tuple[BoardPlan, str | None]:
        """Budget, price and solve for one board; (plan, schedule JSON or None)."""
        from host.costs import price_graph
        from host.run.solve import SolveSettings
        from host.solver.solve import minimum_ram_bytes, no_remat_peak_bytes, solve_schedule

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

        def refused(detail: str) -> BoardPlan:
            return BoardPlan(agent.name, RunStatus.DOES_NOT_FIT, max(budget, 0), floor, None, None, None, {}, detail, which)

        if budget < floor:
            how = auto_budget_text(agent.facts, graph, optimizer) if budget_kind == "auto" else f"{budget} bytes"
            return refused(f"RAM budget {how} is below the minimum any schedule of {graph.name} can meet: {floor} "
                           f"bytes; give the board more memory or pick a smaller model or batch"), None
        digest = profile_digest(profile)
        paging, remat = not request.no_paging, not request.no_remat
        key = (graph.fingerprint(), digest, budget, float(runtime_factor), paging, remat, optimizer)
        with self._solve_lock:
            cached = self._schedules.get(key)
            if cached is None:
                settings = SolveSettings(runtime_budget=runtime_factor, time_limit_s=self.solve_time_limit_s,
                                         paging=paging, remat=remat)
                log.info("solving %s for %s at %d bytes on %s", graph.name, agent.name, budget, profile.name)
                result = solve_schedule(priced, settings.options(budget))
                self.solve_count += 1
                text = serde.schedule_json(result.schedule) if result.schedule is not None else None
                cached = (result, text)
                self._schedules[key] = cached
        result, text = cached
        if text is None:
            if result.status == "infeasible":
                return refused(f"no schedule fits: {result.message}"), None
            return BoardPlan(agent.name, RunStatus.FAILED, budget, floor, None, None, None, {},
                             f"the solver found no schedule ({result.status}): {result.message}", which), None
        prediction = result.schedule.prediction
        schedule_key = hashlib.sha256(serde.dumps([list(map(str, key))]).encode()).hexdigest()[:24]
        fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        from host.calibrate.fit import predict_step

        # A whole step: the schedule's computes and transfers, plus the optimizer and the executor's own
        # time where the profile was calibrated (the solver's runtime covers only what a schedule changes).
        step_s, step_j = predict_step(profile, graph, result.schedule)
        predicted = {"step_s": step_s, "peak_ram_bytes": float(prediction.peak_ram_bytes),
                     "energy_j": step_j, "energy_source": f"predicted:{profile.name}"}
        counts = {"recomputes": prediction.recomputes, "page_ins": prediction.page_ins,
                  "page_outs": prediction.page_outs}
        return BoardPlan(agent.name, RunStatus.QUEUED, budget, floor, schedule_key, fingerprint, predicted, counts, None,
                         which), text

    def targets(self, request) -> list:
        known = {a.name: a for a in self.store.list_agents()}
        if request.all_agents:
            now = time.time()
            chosen = [a for a in known.values() if a.online(now, self.heartbeat_timeout_s)]
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
        from host.run.errors import user_errors

        kind = serde.JOB_KIND_FROM_PB.get(request.kind or fleet_pb2.JOB_KIND_TRAIN)
        optimizer = serde.OPTIMIZER_FROM_PB.get(request.optimizer or fleet_pb2.OPTIMIZER_SGD)
        collect = serde.COLLECT_FROM_PB.get(request.collect or fleet_pb2.COLLECT_NONE)
        if kind is None or optimizer is None or collect is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "unknown job kind, optimizer or collect value")
        runtime_factor = request.runtime_budget or DEFAULT_RUNTIME_FACTOR
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
            "schedules": {},
            "profile_version": request.profile_version or None,
            "paging": not request.no_paging, "remat": not request.no_remat,
        }
        plans: list[BoardPlan] = []
        if kind == "profile":
            plans = [BoardPlan(a.name, RunStatus.QUEUED, None, None, None, None, None, {}, None) for a in boards]
        else:
            try:
                package = self.model_package(request)
                for agent in boards:
                    plan, text = self.plan_board(agent, package.graph, request, optimizer, runtime_factor)
                    plans.append(plan)
                    if text is not None:
                        spec["schedules"][plan.schedule_key] = text
            except user_errors() as error:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(error).strip("'\"")) from None
            spec.update(model_digest=package.digest, model_size_bytes=package.size_bytes,
                        grouping_json=serde.grouping_to_json(package.grouping), batch_size=package.batch_size,
                        graph_fingerprint=package.graph.fingerprint(), graph=package.graph.to_dict(),
                        uploaded=request.HasField("uploaded_model"))
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        run_specs = []
        for plan in plans:
            metrics = {"schedule_key": plan.schedule_key, "min_ram_budget_bytes": plan.min_ram_budget_bytes,
                       "steps_done": 0, **plan.counts}
            if plan.profile is not None:
                metrics.update(profile_name=plan.profile["name"], profile_version=plan.profile["version"])
            run_specs.append({"run_id": f"run-{uuid.uuid4().hex[:12]}", "agent": plan.agent, "status": plan.status,
                              "ram_budget_bytes": plan.ram_budget_bytes, "predicted": plan.predicted,
                              "schedule_fingerprint": plan.schedule_fingerprint, "detail": plan.detail,
                              "metrics": metrics})
        runs = self.store.create_submission(job_id, kind, spec, run_specs)  # all the boards' runs, or none
        self._specs[job_id] = spec
        self.notify_work()
        return [serde.run_info(run, spec) for run in runs]

    # ------------------------------------------------------------------------------------ results
    def report(self, agent: str, result) -> None:
        run = self.assigned_run(agent, result.run_id)
        if result.job_id and result.job_id != run.job_id:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"run {run.run_id!r} belongs to job {run.job_id!r}, not {result.job_id!r}")
        if result.status not in (fleet_pb2.RUN_STATUS_DONE, fleet_pb2.RUN_STATUS_FAILED):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a result's status is DONE or FAILED")
        with self._result_lock:
            run = self.store.get_run(run.run_id)
            if run.status.finished:
                return  # a resend after a reconnect: the first report stands
            if run.status != RunStatus.RUNNING:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"run {run.run_id!r} is {run.status}, not running: report only jobs PullJob handed you")
            spec = self.spec(run.job_id)
            try:
                check_result(result, steps=int(spec.get("steps") or 0), collect=spec.get("collect", "none"))
            except BoardInputError as error:
                # the agent drops a refused result: the run fails here, or it would be handed out and re-run forever
                message = f"the result of run {run.run_id!r}: {error}"
                self.store.update_run(run.run_id, status=RunStatus.FAILED,
                                      detail=bounded_error(f"the coordinator refused the board's result ({message})"))
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, message) from None
            update = serde.result_update(result)
            update["detail"] = bounded_error(update["detail"]) if update["detail"] else None
            if result.HasField("max_rel_param_diff") and math.isinf(result.max_rel_param_diff):
                update["metrics"]["max_rel_param_diff"] = None  # strict JSON; the detail says it
                update["detail"] = "max_rel_param_diff is infinite: a tensor plain training left at zero differs" + (
                    f"; {update['detail']}" if update["detail"] else "")
            diverged = first_non_finite(result.loss_per_step)
            if diverged is not None:  # stored as null (the JSON stays strict) and the run failed, saying where
                losses = [v if math.isfinite(v) else None for v in result.loss_per_step]
                update["metrics"].update(loss_per_step=losses, final_loss=losses[-1])
                update["status"] = RunStatus.FAILED
                update["detail"] = (f"the loss is {result.loss_per_step[diverged]} from step {diverged + 1} (it "
                                    f"diverged); lower the learning rate" + (f"; the board said: {update['detail']}"
                                                                            if update["detail"] else ""))
            if result.HasField("weights") and result.weights.safetensors:
                update["metrics"]["weights_path"] = self._save_weights(run.run_id, result.weights)
            if run.kind == "profile" and update["status"] == RunStatus.DONE:
                from host.costs import PlatformProfile

                try:
                    profile = json.loads(result.profile_json)
                    PlatformProfile.from_dict(profile, file_label=f"the profile of run {run.run_id}")
                except ValueError as error:  # ProfileError is a ValueError too
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"profile_json is not a platform profile ({error}); the agent must send what "
                                   f"`poet profile --local` writes") from None
                provenance = {"source": "profile-job", "agent": agent, "job_id": run.job_id, "run_id": run.run_id,
                              "created_unix_s": time.time()}
                version = self.store.add_profile_version(agent, profile, provenance=provenance)
                update["metrics"].update(profile_name=profile.get("name"), profile_version=version.version)
            self.store.update_run(run.run_id, **update)
        if self.refiner is not None and run.kind in ("train", "verify") and update["status"] == RunStatus.DONE:
            self.refiner.run_done(run.run_id)

    def _save_weights(self, run_id: str, weights) -> str:
        from device_agent.fileio import atomic_write_bytes

        data = weights.safetensors
        digest = hashlib.sha256(data).hexdigest()
        if weights.digest and digest != weights.digest:
            raise Refused(grpc.StatusCode.DATA_LOSS,
                           f"collected weights of run {run_id!r} have sha256 {digest}, not {weights.digest}: "
                           "resend the result")
        path = self.results_dir / f"{run_id}.safetensors"
        atomic_write_bytes(path, data)
        return f"{RESULTS_DIR}/{path.name}"

    def telemetry(self, agent: str, batch):
        try:
            check_telemetry_batch(batch)
        except BoardInputError as error:  # naming the run lets the agent park it and keep streaming the others
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"node {agent!r}, run {batch.run_id[:64]!r}: {error}") from None
        run_id = batch.run_id
        if self._run_owner.get(run_id) != agent:  # a run's board never changes: checked once per run
            self._run_owner[run_id] = self.assigned_run(agent, run_id).agent
        events = [(int(e.seq), serde.event_payload(e)) for e in batch.events]
        acked = self.store.store_events(run_id, events) if events else self.store.acked_seq(run_id)
        steps = [e.step.step for e in batch.events if e.WhichOneof("event") == "step"]
        if steps:
            with self._result_lock:  # re-read: a result stored since the batch arrived has the final count
                run = self.store.get_run(run_id)
                if max(steps) > int(run.metrics.get("steps_done") or 0) and not run.status.finished:
                    last = max((e for e in batch.events if e.WhichOneof("event") == "step"), key=lambda e: e.step.step)
                    loss = last.step.loss if math.isfinite(last.step.loss) else None  # JSON stores no NaN
                    self.store.update_run(run.run_id, metrics={"steps_done": max(steps), "last_loss": loss})
        return fleet_pb2.TelemetryAck(stream_id=batch.stream_id, run_id=run_id, stored_through_seq=acked)


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


# ------------------------------------------------------------------------------------------ servicers
def _page(records: list, request, to_message: Callable[[Any], Any]) -> tuple[list, str]:
    """One page of ``records`` (in the store's stable order) as messages, and the token of the next page ("" after
    the last): at most the request's page_size (default LIST_PAGE_SIZE, at most MAX_LIST_PAGE_SIZE) entries and at
    most LIST_PAGE_BYTES of them (one entry at least), so a reply stays far below the message limit."""
    token = request.page_token or "0"
    if not (token.isascii() and token.isdigit() and len(token) <= 12) or int(token) > len(records):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                       f"page_token {request.page_token[:64]!r} is not one this coordinator gave (or the list "
                       "shrank since); start again without one")
    start = int(token)
    size = min(request.page_size or LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE)
    page, total_bytes = [], 0
    for record in records[start:start + size]:
        message = to_message(record)
        total_bytes += message.ByteSize()
        if page and total_bytes > LIST_PAGE_BYTES:
            break
        page.append(message)
    end = start + len(page)
    return page, (str(end) if end < len(records) else "")


def _handler(role: str):
    """Wrap a servicer method: identify the caller (``name`` argument), turn refusals and store errors into statuses."""

    def wrap(method):
        def handle(self, request, context):
            try:
                name = self.coordinator.caller(context, role)
                if role != NODE:
                    return method(self, request, context, name)
                with self.coordinator.slots.hold(name):
                    return method(self, request, context, name)
            except CallLimitError as error:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            except Refused as refused:
                context.abort(refused.code, refused.message)
            except AgentRemovedError as error:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
            except UnknownRunError as error:
                context.abort(grpc.StatusCode.NOT_FOUND, str(error))
            except StoreError as error:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))

        handle.__name__ = method.__name__
        handle.__doc__ = method.__doc__
        return handle

    return wrap


class FleetServicer(fleet_pb2_grpc.FleetServicer):
    """What boards call (node certificates only)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    @_handler(NODE)
    def Register(self, request, context, name):
        c = self.coordinator
        try:
            facts = check_facts(serde.facts_from_register(request))
        except BoardInputError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the facts of node {name!r}: {error}") from None
        c.store.register_agent(name, request.platform or "local", facts)
        log.info("agent %s registered (%s)", name, request.platform)
        c.notify_work()
        return fleet_pb2.RegisterReply(agent_name=name, protocol_version=fleet_pb2.PROTOCOL_VERSION_1,
                                       heartbeat_interval_s=c.heartbeat_interval_s, max_message_bytes=MAX_MESSAGE_BYTES,
                                       model_chunk_bytes=MODEL_CHUNK_BYTES)

    @_handler(NODE)
    def Heartbeat(self, request, context, name):
        c = self.coordinator
        reply = fleet_pb2.HeartbeatReply(heartbeat_interval_s=c.heartbeat_interval_s)
        try:
            c.store.touch_agent(name)
        except UnknownAgentError:
            reply.register_again = True
            return reply
        if request.running_job_id:
            mine = c.store.list_runs(job_id=request.running_job_id, agent=name)
            if not mine or all(run.status.unsuccessful for run in mine):
                reply.cancel_job_ids.append(request.running_job_id)
        return reply

    @_handler(NODE)
    def PullJob(self, request, context, name):
        job = self.coordinator.pull(name, request.wait_s, context)
        if job is None:
            return fleet_pb2.PullJobReply(retry_after_s=0.0)
        log.info("job %s (run %s) handed to %s", job.job_id, job.run_id, name)
        return fleet_pb2.PullJobReply(job=job)

    def FetchModel(self, request, context):
        c = self.coordinator
        try:
            name = c.caller(context, NODE)
            path = c.model_path(name, request.digest)
        except Refused as refused:
            context.abort(refused.code, refused.message)
        total = path.stat().st_size
        if request.offset_bytes > total:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"offset {request.offset_bytes} is past the end of model {request.digest} ({total} bytes); "
                          "fetch from 0")
        try:
            with c.slots.hold(name, "download"), open(path, "rb") as archive:
                watch = IdleWatch(c.download_idle_s, context.cancel)  # chunks nobody reads free the thread
                try:
                    archive.seek(request.offset_bytes)
                    offset = request.offset_bytes
                    while context.is_active():
                        data = archive.read(MODEL_CHUNK_BYTES)
                        if not data:
                            return
                        yield fleet_pb2.ModelChunk(offset_bytes=offset, data=data, total_size_bytes=total,
                                                   chunk_sha256=hashlib.sha256(data).hexdigest())
                        watch.progress()
                        offset += len(data)
                finally:
                    watch.stop()
        except CallLimitError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    def StreamTelemetry(self, request_iterator, context):
        c = self.coordinator
        try:
            name = c.caller(context, NODE)
        except Refused as refused:
            context.abort(refused.code, refused.message)
        try:
            # an agent keeps its stream open while it has nothing to send: no idle deadline here; the per-board cap
            # (MAX_STREAMS_PER_NODE) bounds the threads a board's streams hold
            with c.slots.hold(name, "stream"):
                for batch in request_iterator:
                    try:
                        ack = c.telemetry(name, batch)
                    except Refused as refused:
                        context.abort(refused.code, refused.message)
                    except StoreError as error:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
                    yield ack
        except CallLimitError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    @_handler(NODE)
    def ReportResult(self, request, context, name):
        self.coordinator.report(name, request)
        log.info("run %s reported by %s", request.run_id, name)
        return fleet_pb2.ReportResultReply()


class FleetAdminServicer(fleet_pb2_grpc.FleetAdminServicer):
    """What operators call (operator certificates only)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    @_handler(OPERATOR)
    def ListAgents(self, request, context, name):
        c, now = self.coordinator, time.time()
        agents, token = _page(c.store.list_agents(), request,
                              lambda a: serde.agent_info(a, online=a.online(now, c.heartbeat_timeout_s)))
        return fleet_pb2.ListAgentsReply(agents=agents, next_page_token=token)

    @_handler(OPERATOR)
    def RemoveAgent(self, request, context, name):
        c = self.coordinator
        try:
            c.store.remove_agent(request.name)
        except UnknownAgentError:
            return fleet_pb2.RemoveAgentReply(removed=False)
        for run in c.store.list_runs(agent=request.name, status=OPEN):
            c.store.update_run(run.run_id, status=RunStatus.FAILED,
                               detail=f"agent {request.name!r} was removed by operator {name!r}")
        log.info("agent %s removed by %s", request.name, name)
        return fleet_pb2.RemoveAgentReply(removed=True)

    @_handler(OPERATOR)
    def SubmitRun(self, request, context, name):
        runs = self.coordinator.submit(request)
        log.info("%s submitted %s on %d board(s)", name, request.model or "a profile", len(runs))
        return fleet_pb2.SubmitRunReply(runs=runs)

    @_handler(OPERATOR)
    def ListRuns(self, request, context, name):
        c = self.coordinator
        runs, token = _page(c.store.list_runs(), request, lambda r: serde.run_info(r, c.spec(r.job_id)))
        return fleet_pb2.ListRunsReply(runs=runs, next_page_token=token)

    @_handler(OPERATOR)
    def GetRun(self, request, context, name):
        c = self.coordinator
        run = c.store.get_run(request.run_id)
        missing = c.store.telemetry_steps_missing(run.run_id, int(run.metrics.get("steps_done") or 0))
        return serde.run_info(run, c.spec(run.job_id), telemetry_steps_missing=missing)


    @_handler(OPERATOR)
    def ListProfiles(self, request, context, name):
        versions = self.coordinator.store.list_profile_versions(request.agent or None)
        return fleet_pb2.ListProfilesReply(profiles=[serde.profile_info(v) for v in versions])

    @_handler(OPERATOR)
    def GetProfile(self, request, context, name):
        store = self.coordinator.store
        if request.version:
            version = store.get_profile_version(request.agent, request.version)
        else:
            version = store.latest_profile(request.agent)
        if version is None:
            have = [v.version for v in store.list_profile_versions(request.agent)]
            which = f"version {request.version}" if request.version else "stored profile"
            raise Refused(grpc.StatusCode.NOT_FOUND,
                           f"board {request.agent!r} has no {which} (stored versions: "
                           f"{', '.join(map(str, have)) or 'none'}); `poet run --kind profile` or `poet calibrate` "
                           f"stores one")
        return serde.profile_info(version)

    @_handler(OPERATOR)
    def Calibrate(self, request, context, name):
        from host.fleet.calibration import start_calibration

        info = start_calibration(self.coordinator, request, operator=name)
        log.info("%s started calibration %s of %s", name, info.calibration_id, request.agent)
        return info

    @_handler(OPERATOR)
    def GetCalibration(self, request, context, name):
        from host.fleet.calibration import calibration_info

        return calibration_info(self.coordinator, request.calibration_id)

    @_handler(OPERATOR)
    def StatModel(self, request, context, name):
        uploads = self.coordinator.uploads
        try:
            stored, received = uploads.stat(request.digest)
        except UploadError as error:
            raise Refused(UPLOAD_STATUS[error.kind], str(error)) from None
        return fleet_pb2.StatModelReply(stored=stored, received_bytes=received, max_size_bytes=uploads.max_size_bytes)

    @_handler(OPERATOR)
    def UploadModel(self, request_iterator, context, name):
        uploads = self.coordinator.uploads
        first = next(request_iterator, None)
        if first is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "an upload without chunks: send the archive's chunks")
        try:
            stored, received = uploads.receive(first.digest, _chain(first, request_iterator))
        except UploadError as error:
            raise Refused(UPLOAD_STATUS[error.kind], str(error)) from None
        if stored:
            log.info("%s uploaded model %s", name, first.digest)
        return fleet_pb2.StatModelReply(stored=stored, received_bytes=received, max_size_bytes=uploads.max_size_bytes)


def _chain(first, rest):
    yield first
    yield from rest


def add_services(server: grpc.Server, coordinator: Coordinator) -> None:
    fleet_pb2_grpc.add_FleetServicer_to_server(FleetServicer(coordinator), server)
    fleet_pb2_grpc.add_FleetAdminServicer_to_server(FleetAdminServicer(coordinator), server)


SERVICE_NAMES = ("poet.v1.Fleet", "poet.v1.FleetAdmin")
