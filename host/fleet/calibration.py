"""`poet calibrate`: the coordinator calibrates one board's profile, in a thread of its own.

1. A PROFILE job on the board (its micro-benchmarks) stores profile version k.
2. Short TRAIN runs (batch 8 by default) of each calibration model under three schedules, all solved on
   version k: keep-all (budget 100% of the no-remat peak), remat-heavy (recomputation only) and paging-heavy
   (paging only), the last two at the first of 50%, 65%, 80% of the peak the model can be trained in (or, when
   the model's hard floor is above all three, halfway between that floor and the peak: :func:`heavy_budget_bytes`),
   runtime factor 4. Each schedule runs :data:`~host.fleet.limits.CALIBRATION_REPEATS` times, in rounds (every
   schedule once, then again), so a slow spell of a board that shares its machine slows one run of each schedule
   rather than every run of one; the fit takes every run, and a schedule's held-out steps are pooled over its
   repeats (:func:`pool_runs`). They train on the board's synthetic dataset (:data:`device_agent.agent.datasets.SYNTHETIC_DATASET`: seeded random
   samples of the model's shape), so a board needs no data of each calibration model's shape.
3. Each run's stored telemetry is split: the even steps are fitted, the odd steps from 3 are held out
   (step 1 warms allocators and caches up; see :func:`fit_and_heldout_steps`). :func:`host.calibrate.fit.fit_profile` fits version k on the fit halves; the
   step-time MAPE (and the energy MAPE where a meter measured the steps) of version k and of the fitted profile
   are computed on the held-out halves.
4. The fitted profile is stored as version k+1 with its provenance (agent, calibration id, operator, the PROFILE
   job and run, the calibration runs, time, the errors before and after).

The calibration is the coordinator's: it goes on when the operator's command exits. Its progress lives in the
coordinator's memory (``GetCalibration``); a coordinator restarted mid-calibration forgets it (its runs stay in
the store, and no version is stored).

Ordinary TRAIN and VERIFY runs refine a calibrated board's fit (:class:`Refiner`): once such a run is done and its
telemetry stored, the fit of the board's latest calibrated version is redone on the calibration runs plus the
board's last :data:`REFINE_MAX_TRAIN_RUNS` such runs (even steps fitted, odd steps held out, as above). The refit is
stored as a new version (provenance ``source: refinement``) only when it predicts the held-out steps of all those
runs at least as well as the current version; the run's metrics say which (``refinement``).
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from host.fleet import serde
from host.fleet.limits import CALIBRATION_BATCH_SIZE, CALIBRATION_MODELS, CALIBRATION_REPEATS, CALIBRATION_STEPS
from host.fleet.metrics import RunMetrics
from host.fleet.planning import Planner
from host.fleet.refusal import Refused
from host.fleet.status import RunStatus

fleet_pb2 = serde.fleet_pb2
log = logging.getLogger("poet.fleet.calibrate")

DEFAULT_MODELS, DEFAULT_STEPS, DEFAULT_BATCH_SIZE = CALIBRATION_MODELS, CALIBRATION_STEPS, CALIBRATION_BATCH_SIZE
MIN_STEPS = 4  # a fit half and a held-out half of at least one step each after the warm-up step
HEAVY_FRACTIONS_OF_PEAK = (0.5, 0.65, 0.8)  # tried in turn: the first budget the model's schedules can meet
HEAVY_RUNTIME_FACTOR = 4.0
HEAVY_SHARE_ABOVE_FLOOR = 0.5  # when the floor is above every fraction: this share of the way from floor to peak
CALIBRATION_LR = 0.01
POLL_S = 0.25
RUN_TIMEOUT_S = 3600.0
EVENTS_TIMEOUT_S = 60.0  # after a run's result, for its last telemetry events to be stored
REFINE_MAX_TRAIN_RUNS = 8  # the newest ordinary runs a refinement fits beside the calibration runs
REFINE_SOURCES = ("calibration", "refinement")  # versions a refinement builds on
# (label, shares of the no-remat peak to try, runtime factor, no_paging, no_remat)
SCHEDULES = (("keep-all", (1.0,), 1.2, False, False),
             ("remat-heavy", HEAVY_FRACTIONS_OF_PEAK, HEAVY_RUNTIME_FACTOR, True, False),
             ("paging-heavy", HEAVY_FRACTIONS_OF_PEAK, HEAVY_RUNTIME_FACTOR, False, True))

_START_LOCK = threading.Lock()
_KINDS = {"INSTRUCTION_KIND_COMPUTE": "compute", "INSTRUCTION_KIND_PAGE_OUT": "page_out",
          "INSTRUCTION_KIND_PAGE_IN": "page_in", "INSTRUCTION_KIND_FREE": "free"}


class CalibrationFailed(RuntimeError):
    """The calibration cannot go on; the message says why."""


# ------------------------------------------------------------------------------------------ telemetry
def instruction_from_payload(event: Mapping[str, Any]) -> dict[str, Any]:
    """A stored ``instruction`` payload (proto field names, 64-bit ints as strings, enum names, defaults
    omitted) as the dict :class:`host.calibrate.fit.CalibrationRun` takes."""
    kind = event.get("kind", "INSTRUCTION_KIND_UNSPECIFIED")
    out = {
        "step": int(event.get("step", 0)), "position": int(event.get("position", 0)),
        "kind": _KINDS.get(kind, kind), "node": int(event.get("node", 0)), "node_name": event.get("node_name", ""),
        "node_kind": event.get("node_kind", ""), "recompute": bool(event.get("recompute", False)),
        "duration_s": float(event.get("duration_s", 0.0)), "bytes_moved": int(event.get("bytes_moved", 0)),
        "cpu_s": float(event.get("cpu_s", 0.0)),
        # a free's RAM or flash (the fit prices page-file deletes apart from RAM frees)
        "location": str(event.get("location", "LOCATION_RAM")).lower().removeprefix("location_"),
    }
    if event.get("compute_thread_s") is not None:  # a transfer's time on the compute thread, where the board timed it
        out["compute_thread_s"] = float(event["compute_thread_s"])
    return out


def step_from_payload(event: Mapping[str, Any]) -> dict[str, Any]:
    """A stored ``step`` payload as the dict CalibrationRun takes (``energy_j`` absent when not measured)."""
    out: dict[str, Any] = {
        "step": int(event.get("step", 0)), "duration_s": float(event.get("duration_s", 0.0)),
        "optimizer_s": float(event.get("optimizer_s", 0.0)), "compute_s": float(event.get("compute_s", 0.0)),
        "paging_s": float(event.get("paging_s", 0.0)), "cpu_s": float(event.get("cpu_s", 0.0)),
        "energy_source": event.get("energy_source", ""), "timing_source": event.get("timing_source", ""),
    }
    if event.get("energy_j") is not None:
        out["energy_j"] = float(event["energy_j"])
    return out


def telemetry_steps(payloads: Iterable[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(instructions, steps) of a run from its stored payloads, in seq order.

    The board sends a step's instruction events, then its step event; the step event carries the job's step
    number (from 1, also after a resume) while the executor numbers instructions from 0 in each process. So
    every instruction is given the number of the step event that follows it. A step re-run after a resume
    sends its events again: the later copy of a step wins.
    """
    by_step: dict[int, tuple[list[dict], dict]] = {}
    pending: list[dict] = []
    for payload in payloads:
        if "instruction" in payload:
            pending.append(instruction_from_payload(payload["instruction"]))
        elif "step" in payload:
            step = step_from_payload(payload["step"])
            for instruction in pending:
                instruction["step"] = step["step"]
            by_step[step["step"]] = (pending, step)
            pending = []
    instructions, steps = [], []
    for number in sorted(by_step):
        instructions += by_step[number][0]
        steps.append(by_step[number][1])
    return instructions, steps


def runs_from_store(store, run_ids: Iterable[str], graph_for_run: Callable[[Any], Any],
                    schedule_for_run: Callable[[Any], Any]) -> list:
    """One CalibrationRun per run id, from the telemetry the coordinator stored; ``graph_for_run`` and
    ``schedule_for_run`` take the store's RunRecord."""
    from host.calibrate.fit import CalibrationRun

    runs = []
    for run_id in run_ids:
        record = store.get_run(run_id)
        instructions, steps = telemetry_steps(payload for _, payload in store.get_events(run_id))
        runs.append(CalibrationRun(graph=graph_for_run(record), schedule=schedule_for_run(record),
                                   instructions=instructions, steps=steps))
    return runs


def stored_runs(planner: Planner, run_ids: Iterable[str]) -> list:
    """:func:`runs_from_store` with each run's graph and schedule rebuilt from its job as the coordinator stored it."""
    from device_agent.serde import schedule_from_json

    def graph_for_run(record):
        return planner.job_graph(planner.state.spec(record.job_id))

    def schedule_for_run(record):
        spec = planner.state.spec(record.job_id)
        text = planner.state.schedule_json(spec, record.run_metrics.schedule_key)
        return schedule_from_json(text, source=f"run {record.run_id}")

    return runs_from_store(planner.store, run_ids, graph_for_run, schedule_for_run)


def split_run(run, steps: Iterable[int]):
    """The run restricted to the given step numbers."""
    from host.calibrate.fit import CalibrationRun

    chosen = set(steps)
    return CalibrationRun(graph=run.graph, schedule=run.schedule,
                          instructions=[i for i in run.instructions if i["step"] in chosen],
                          steps=[s for s in run.steps if s["step"] in chosen])


def pool_runs(runs: Sequence):
    """Runs of one schedule on one graph as one run: run k's step s becomes step s + k x stride, the stride even
    and above every step, so each run's even steps stay even and its odd steps odd."""
    from host.calibrate.fit import CalibrationRun

    if not runs:
        raise ValueError("no runs to pool")
    last = max((int(e["step"]) for run in runs for e in (*run.instructions, *run.steps)), default=0)
    stride = 2 * (last // 2 + 1)
    instructions: list[dict] = []
    steps: list[dict] = []
    for k, run in enumerate(runs):
        instructions += [{**event, "step": int(event["step"]) + k * stride} for event in run.instructions]
        steps += [{**step, "step": int(step["step"]) + k * stride} for step in run.steps]
    return CalibrationRun(graph=runs[0].graph, schedule=runs[0].schedule, instructions=instructions, steps=steps)


def fit_and_heldout_steps(steps: int) -> tuple[list[int], list[int]]:
    """(steps fitted, steps held out) of a run of ``steps`` steps: the even steps from 2 and the odd steps from 3.

    Step 1 warms allocators and caches up. Interleaving the halves (rather than first half / second half)
    gives both the same machine: a board busy with something else for a few seconds slows steps of both.
    """
    return list(range(2, steps + 1, 2)), list(range(3, steps + 1, 2))


# ------------------------------------------------------------------------------------------ the calibration
@dataclass
class Calibration:
    calibration_id: str
    agent: str
    operator: str
    models: list[str]
    steps: int
    batch_size: int
    status: str = "running"  # running | done | failed
    stage: str = "starting"
    stages: list[str] = field(default_factory=lambda: ["starting"])  # each stage entered, in order
    run_ids: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def info(self):
        with self.lock:
            return fleet_pb2.CalibrationInfo(
                calibration_id=self.calibration_id, agent=self.agent, status=self.status, stage=self.stage,
                run_ids=list(self.run_ids), report_json=serde.dumps(self.report) if self.report is not None else "",
                error=self.error, stages=list(self.stages))

    def set_stage(self, text: str) -> None:
        """Enter a stage ("what: progress"); only a new ``what`` is logged and kept in ``stages``."""
        head = text.partition(": ")[0]
        with self.lock:
            self.stage = text
            entered = head != self.stages[-1]
            if entered:
                self.stages.append(head)
        if entered:
            log.info("calibration %s of %s: %s", self.calibration_id, self.agent, text)


def _registry(planner: Planner) -> dict[str, Calibration]:
    return planner.state.calibrations


def start_calibration(planner: Planner, request, *, operator: str):
    """Check the request, start the calibration thread, and return its CalibrationInfo."""

    agents = {a.name: a for a in planner.store.list_agents()}
    if request.agent not in agents:
        listing = ", ".join(sorted(agents)) or "none has registered"
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                       f"unknown agent {request.agent!r}; known agents: {listing} (see `poet fleet list`)")
    steps = request.steps or DEFAULT_STEPS
    if steps < MIN_STEPS:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                       f"calibration runs need at least {MIN_STEPS} steps (a warm-up step, a fitted half and a "
                       f"held-out half); got {steps}")
    models = [m for m in dict.fromkeys(request.models) if m] or list(DEFAULT_MODELS)
    from host.graph.zoo import ZOO

    foreign = [m for m in models if m not in ZOO]
    if foreign:  # a module:callable would be imported here: the coordinator never runs an operator's code
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"calibration model {foreign[0][:200]!r} is not a zoo model; calibrate with zoo models (see "
                      "`poet models`)")
    calibrations = _registry(planner)
    with _START_LOCK:
        busy = [c for c in calibrations.values() if c.agent == request.agent and c.status == "running"]
        if busy:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"board {request.agent!r} is being calibrated already ({busy[0].calibration_id}); wait "
                           f"for it")
        calibration = Calibration(f"cal-{uuid.uuid4().hex[:12]}", request.agent, operator, models, steps,
                                  request.batch_size or DEFAULT_BATCH_SIZE)
        calibrations[calibration.calibration_id] = calibration
    threading.Thread(target=_run, args=(planner, calibration), name=f"calibrate-{request.agent}",
                     daemon=True).start()
    return calibration.info()


def calibration_info(planner: Planner, calibration_id: str):

    calibration = _registry(planner).get(calibration_id)
    if calibration is None:
        raise Refused(grpc.StatusCode.NOT_FOUND,
                       f"no calibration {calibration_id!r} on this coordinator (calibrations in progress are "
                       f"forgotten when it restarts; see `poet profiles list` for the stored versions)")
    return calibration.info()


def _run(planner: Planner, calibration: Calibration) -> None:
    try:
        report = calibrate(planner, calibration)
    except Exception as error:  # the thread's end: every failure is the calibration's outcome

        message = error.message if isinstance(error, Refused) else str(error) or type(error).__name__
        log.warning("calibration %s of %s failed: %s", calibration.calibration_id, calibration.agent, message,
                    exc_info=not isinstance(error, (Refused, CalibrationFailed)))
        with calibration.lock:
            calibration.status, calibration.error = "failed", message
        return
    with calibration.lock:
        calibration.report, calibration.status, calibration.stage = report, "done", "done"


def _request(calibration: Calibration, **fields):
    return fleet_pb2.SubmitRunRequest(agents=[calibration.agent], seed=0, collect=fleet_pb2.COLLECT_NONE,
                                      optimizer=fleet_pb2.OPTIMIZER_SGD, **fields)


def _wait(planner: Planner, calibration: Calibration | None, run_ids: Sequence[str], what: str) -> list:
    """The runs once each ended (and, when done, once its telemetry is all stored); progress goes to the
    calibration's stage when there is one."""
    store = planner.store
    deadline = time.monotonic() + RUN_TIMEOUT_S
    settled_at: dict[str, float] = {}
    while True:
        records = [store.get_run(r) for r in run_ids]
        now = time.monotonic()
        waiting = []
        for record in records:
            if not record.status.finished:
                waiting.append(record)
            elif record.status == RunStatus.DONE and record.events_stored < record.run_metrics.events_emitted:
                settled_at.setdefault(record.run_id, now)
                if now - settled_at[record.run_id] < EVENTS_TIMEOUT_S:
                    waiting.append(record)
        if not waiting:
            return records
        if now > deadline:
            raise CalibrationFailed(f"{what}: runs {', '.join(r.run_id for r in waiting)} did not end within "
                                    f"{RUN_TIMEOUT_S:g} s; is the board online (`poet fleet list`)?")
        if calibration is not None:
            progress = ", ".join(f"{r.run_id} {r.status} step {r.run_metrics.steps_done}" for r in waiting)
            calibration.set_stage(f"{what}: {progress}")
        time.sleep(POLL_S)


def heavy_budget_bytes(floor_bytes: int, peak_bytes: int) -> int:
    """The heavy schedules' budget for a model whose hard floor (the largest node's inputs, output and workspace)
    is above every share of :data:`HEAVY_FRACTIONS_OF_PEAK`: part of the way from the floor to the no-remat peak,
    so the schedule must still recompute or page, and the solver has room to."""
    if not 0 < floor_bytes <= peak_bytes:
        raise ValueError(f"the floor ({floor_bytes} bytes) must be positive and at most the peak ({peak_bytes} bytes)")
    return floor_bytes + int(HEAVY_SHARE_ABOVE_FLOOR * (peak_bytes - floor_bytes))


def heavy_budget_after_refusal(floor_bytes: int | None, refused_budget_bytes: float | None,
                               refused_fraction: float) -> int | None:
    """:func:`heavy_budget_bytes` for a model refused at ``refused_fraction`` of its no-remat peak
    (``refused_budget_bytes``) because its floor is above it; None when the refusal had another cause."""
    if not floor_bytes or not refused_budget_bytes or floor_bytes <= refused_budget_bytes:
        return None
    peak_bytes = round(refused_budget_bytes / refused_fraction)  # the budget was int(fraction x peak)
    return heavy_budget_bytes(floor_bytes, peak_bytes) if floor_bytes < peak_bytes else None


def _presolve(planner: Planner, board, request):
    """Solve (into the planner's schedule cache) what submitting ``request`` to ``board`` will run; the plan
    (its status, budget and floor), or None where the submission itself must say what is wrong."""
    from host.run.errors import UserError

    if board is None:
        return None
    try:
        graph = planner.model_package(request).graph
        optimizer = serde.OPTIMIZER_FROM_PB[request.optimizer]  # as submit reads it, so the cache key is the same
        plan, _ = planner.plan_board(board, graph, request, optimizer, request.runtime_budget)
    except (Refused, UserError):
        return None
    return plan


def calibrate(planner: Planner, calibration: Calibration) -> dict[str, Any]:
    """The calibration's steps (module docstring); returns the report `poet calibrate --json` prints."""
    from device_agent.agent.datasets import SYNTHETIC_DATASET
    from host.calibrate.fit import energy_mape, fit_profile, predict_step, step_time_mape
    from host.costs import PlatformProfile

    store, agent = planner.store, calibration.agent
    started = time.time()

    # 1. the micro-benchmarks: version k
    calibration.set_stage("PROFILE job: the board measures its compute and flash")
    profile_run = planner.submit(_request(calibration, kind=fleet_pb2.JOB_KIND_PROFILE))[0]
    with calibration.lock:
        calibration.run_ids.append(profile_run.run_id)
    record = _wait(planner, calibration, [profile_run.run_id], "PROFILE job")[0]
    if record.status != RunStatus.DONE or record.run_metrics.profile_version is None:
        raise CalibrationFailed(f"the PROFILE run {record.run_id} ended {record.status}: {record.detail or 'no profile'}")
    base_version = int(record.run_metrics.profile_version)
    base = PlatformProfile.from_dict(store.get_profile_version(agent, base_version).profile,
                                     file_label=f"profile v{base_version} of {agent}")

    # 2. calibration runs, all solved on version k before the first is queued: the board never runs one while the
    #    coordinator (which may share its machine) solves the next, so what it measures is the run alone
    board_record = next((a for a in store.list_agents() if a.name == agent), None)
    chosen: list[tuple[str, str, Any, str]] = []  # (model, label, request, budget note)
    for model in calibration.models:
        for label, fractions, runtime_factor, no_paging, no_remat in SCHEDULES:
            calibration.set_stage(f"solving {model} ({label}) on profile v{base_version}")
            fields = dict(kind=fleet_pb2.JOB_KIND_TRAIN, model=model, dataset=SYNTHETIC_DATASET,
                          steps=calibration.steps, lr=CALIBRATION_LR, batch_size=calibration.batch_size,
                          runtime_budget=runtime_factor, profile_version=base_version, no_paging=no_paging,
                          no_remat=no_remat)
            for fraction in fractions:  # the heavy schedules: the smallest share the model can be trained in
                request = _request(calibration, ram_budget=fleet_pb2.RamBudget(fraction_of_peak=fraction), **fields)
                budget_note = f"{fraction:.0%} of the no-remat peak"
                plan = _presolve(planner, board_record, request)
                if plan is not None and plan.status == RunStatus.QUEUED:
                    break
            # the floor above every share (a conv model at batch 8, whose kernels' own buffers make it 94% of the
            # peak): halfway from the floor to the peak
            budget = (heavy_budget_after_refusal(plan.min_ram_budget_bytes, plan.ram_budget_bytes, fraction)
                      if plan is not None and plan.status == RunStatus.DOES_NOT_FIT else None)
            if budget is not None:
                request = _request(calibration, ram_budget=fleet_pb2.RamBudget(budget_bytes=budget), **fields)
                budget_note = f"{budget} bytes, halfway from the floor to the no-remat peak"
                _presolve(planner, board_record, request)
            chosen.append((model, label, request, budget_note))
    planned: list[dict[str, Any]] = []  # one entry per schedule; its runs are the repeats
    submitted: dict[str, tuple[str, str | None]] = {}  # run id -> (status, error) as submitted
    for repeat in range(CALIBRATION_REPEATS):  # in rounds; the schedules are cached: each submit answers at once
        for index, (model, label, request, budget_note) in enumerate(chosen):
            run = planner.submit(request)[0]
            submitted[run.run_id] = (serde.RUN_STATUS_FROM_PB[run.status], run.error or None)
            with calibration.lock:
                calibration.run_ids.append(run.run_id)
            if repeat == 0:
                planned.append({"run_id": run.run_id, "run_ids": [run.run_id], "model": model, "schedule": label,
                                "budget": budget_note, "status": submitted[run.run_id][0],
                                "error": submitted[run.run_id][1]})
            else:
                planned[index]["run_ids"].append(run.run_id)
    queued = [r for r, (status, _) in submitted.items() if status in (RunStatus.QUEUED, RunStatus.SOLVING)]
    if not queued:
        raise CalibrationFailed("no calibration run could be scheduled: "
                                + "; ".join(f"{p['model']} {p['schedule']}: {p['error']}" for p in planned))
    records = {r.run_id: r for r in _wait(planner, calibration, queued, "calibration runs")}

    # 3. fit on the even steps, compare on the odd steps from 3
    calibration.set_stage("fitting")
    fit_steps, heldout_steps = fit_and_heldout_steps(calibration.steps)
    done = [run_id for run_id in queued if records[run_id].status == RunStatus.DONE]
    for entry in planned:
        ended = [records[r] for r in entry["run_ids"] if r in records]
        if ended:  # a schedule's figures are its first run's; its status is done only when every repeat is
            record = next((r for r in ended if r.status != RunStatus.DONE), ended[0])
            entry.update(status=record.status, error=record.detail, ram_budget_bytes=ended[0].ram_budget_bytes,
                         recomputes=ended[0].run_metrics.recomputes, page_ins=ended[0].run_metrics.page_ins,
                         page_outs=ended[0].run_metrics.page_outs,
                         events_stored=sum(r.events_stored for r in ended))
    if not done:
        raise CalibrationFailed("every calibration run failed: "
                                + "; ".join(f"{p['model']} {p['schedule']}: {p['error']}" for p in planned))

    runs = stored_runs(planner, done)
    fit_runs = [split_run(r, fit_steps) for r in runs]
    by_id = dict(zip(done, runs, strict=True))
    held_by_entry: dict[str, Any] = {}  # a schedule's repeats, held-out halves pooled (same schedule only)
    for entry in planned:
        repeats = [by_id[r] for r in entry["run_ids"] if r in by_id]
        same = [r for r in repeats if r.schedule.instructions == repeats[0].schedule.instructions]
        if same:
            held_by_entry[entry["run_id"]] = pool_runs([split_run(r, heldout_steps) for r in same])
    held_runs = list(held_by_entry.values())
    if not any(r.steps for r in held_runs) or not any(r.instructions for r in fit_runs):
        raise CalibrationFailed("the calibration runs' telemetry has no steps to fit or to hold out "
                                f"(fit steps {fit_steps}, held out {heldout_steps})")
    fitted = fit_profile(base, fit_runs, note=f"calibration {calibration.calibration_id} of {agent}")
    errors = {
        "step_mape_before": step_time_mape(base, held_runs), "step_mape_after": step_time_mape(fitted, held_runs),
        "energy_mape_before": energy_mape(base, held_runs), "energy_mape_after": energy_mape(fitted, held_runs),
    }
    sources = [s.get("energy_source") for r in runs for s in r.steps if s.get("energy_source")]
    energy_source = sources[-1] if sources else None
    for entry in planned:
        held = held_by_entry.get(entry["run_id"])
        if held is not None and held.steps:
            entry["step_mape_before"] = step_time_mape(base, [held])
            entry["step_mape_after"] = step_time_mape(fitted, [held])
            entry["measured_step_s"] = statistics.median(float(s["duration_s"]) for s in held.steps)
            entry["predicted_before_s"] = predict_step(base, held.graph, held.schedule)[0]
            entry["predicted_after_s"] = predict_step(fitted, held.graph, held.schedule)[0]

    # 4. store version k+1 with its provenance
    provenance = {
        "source": "calibration", "agent": agent, "calibration_id": calibration.calibration_id,
        "operator": calibration.operator, "base_version": base_version, "profile_job_id": record_job(store, profile_run),
        "profile_run_id": profile_run.run_id, "run_ids": done, "job_ids": [records[r].job_id for r in done],
        "models": calibration.models, "steps": calibration.steps, "batch_size": calibration.batch_size,
        "repeats": CALIBRATION_REPEATS,
        "fit_steps": fit_steps, "heldout_steps": heldout_steps,
        "started_unix_s": started, "created_unix_s": time.time(), **errors, "energy_source": energy_source,
    }
    version = store.add_profile_version(agent, fitted.to_dict(), provenance=provenance)
    log.info("calibration %s of %s stored profile v%d: step MAPE %.1f%% -> %.1f%%", calibration.calibration_id,
             agent, version.version, errors["step_mape_before"], errors["step_mape_after"])
    return {"agent": agent, "calibration_id": calibration.calibration_id, "profile_version": version.version,
            "base_profile_version": base_version, **errors, "energy_source": energy_source,
            "fit_steps": fit_steps, "heldout_steps": heldout_steps,
            "profile_run_id": profile_run.run_id, "runs": planned, "seconds": round(time.time() - started, 3)}


# ------------------------------------------------------------------------------------------ refinement
class Refiner:
    """Refines calibrated boards' profiles from their ordinary runs, one run at a time, in a thread of its own."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="refine-profiles", daemon=True)
        self._thread.start()

    def run_done(self, run_id: str) -> None:
        """A TRAIN or VERIFY run reported done: refine its board's profile once its telemetry is stored."""
        self._queue.put(run_id)

    def _serve(self) -> None:
        while True:
            run_id = self._queue.get()
            try:
                outcome = refine(self._planner, run_id)
            except Exception as error:  # one failed refinement never stops the next
                log.warning("refining the profile with run %s failed: %s", run_id, error, exc_info=True)
                outcome = {"status": "failed", "detail": str(error) or type(error).__name__}
            if outcome is not None:
                self._planner.store.update_run(run_id, metrics=RunMetrics.changes(refinement=outcome))
            self._queue.task_done()


def _split_halves(run):
    """(fit half, held-out half) of a stored run, by :func:`fit_and_heldout_steps` of its last step."""
    last = max((int(s["step"]) for s in run.steps), default=0)
    fit_steps, heldout_steps = fit_and_heldout_steps(last)
    return split_run(run, fit_steps), split_run(run, heldout_steps)


def refine(planner: Planner, run_id: str) -> dict[str, Any] | None:
    """Refit the run's board on its calibration runs plus its newest ordinary runs; store the refit when it
    predicts their held-out steps at least as well. Returns what the run's metrics record (None: not a case)."""
    from host.calibrate.fit import fit_profile, step_time_mape
    from host.costs import PlatformProfile

    store = planner.store
    record = _wait(planner, None, [run_id], f"run {run_id}")[0]
    if record.kind not in ("train", "verify") or record.status != RunStatus.DONE:
        return None
    latest = store.latest_profile(record.agent)
    if latest is None or latest.provenance.get("source") not in REFINE_SOURCES:
        return {"status": "skipped", "detail": f"board {record.agent!r} has no calibrated profile yet (`poet "
                                                 f"calibrate --agent {record.agent}`)"}
    provenance = latest.provenance
    if record.run_metrics.steps_done < MIN_STEPS:
        return {"status": "skipped", "detail": f"fewer than {MIN_STEPS} steps: nothing to hold out"}
    emulated = {s["timing_source"] for s in stored_runs(planner, [run_id])[0].steps if s["timing_source"]}
    if emulated:
        return {"status": "skipped", "detail": f"the run's step times are {', '.join(sorted(emulated))}, not the "
                                                 "board's own: they would mislead its profile"}
    calibration_ids = list(provenance.get("run_ids") or [])
    train_ids = [r for r in provenance.get("train_run_ids") or [] if r != run_id]
    train_ids = (train_ids + [run_id])[-REFINE_MAX_TRAIN_RUNS:]
    base_version = int(provenance["base_version"])
    base = PlatformProfile.from_dict(store.get_profile_version(record.agent, base_version).profile,
                                     file_label=f"profile v{base_version} of {record.agent}")
    current = PlatformProfile.from_dict(latest.profile, file_label=f"profile v{latest.version} of {record.agent}")
    halves = [_split_halves(r) for r in stored_runs(planner, calibration_ids + train_ids)]
    fit_runs = [fit for fit, _ in halves if fit.instructions]
    held_runs = [held for _, held in halves if held.steps]
    fitted = fit_profile(base, fit_runs, note=f"refinement of v{latest.version} of {record.agent} with {run_id}")
    before, after = step_time_mape(current, held_runs), step_time_mape(fitted, held_runs)
    outcome: dict[str, Any] = {"refined_version": latest.version, "step_mape_before": before,
                               "step_mape_after": after, "train_run_ids": train_ids}
    if after > before:
        log.info("run %s: the refit of %s's profile predicts worse (%.1f%% against v%d's %.1f%%); v%d stays",
                 run_id, record.agent, after, latest.version, before, latest.version)
        return {"status": "kept", **outcome}
    version = store.add_profile_version(record.agent, fitted.to_dict(), provenance={
        "source": "refinement", "agent": record.agent, "base_version": base_version,
        "refines_version": latest.version, "run_ids": calibration_ids, "train_run_ids": train_ids,
        "calibration_id": provenance.get("calibration_id"), "step_mape_before": before, "step_mape_after": after,
        "created_unix_s": time.time()})
    log.info("run %s refined %s's profile: v%d (held-out step MAPE %.1f%% -> %.1f%%)", run_id, record.agent,
             version.version, before, after)
    return {"status": "stored", "profile_version": version.version, **outcome}


def record_job(store, run_info) -> str:
    return store.get_run(run_info.run_id).job_id


__all__ = ["DEFAULT_MODELS", "Calibration", "CalibrationFailed", "Refiner", "calibration_info",
           "fit_and_heldout_steps", "instruction_from_payload", "refine", "runs_from_store", "split_run",
           "start_calibration", "step_from_payload", "stored_runs", "telemetry_steps"]
