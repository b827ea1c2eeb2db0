"""Train a model's real steps under its POET schedule on this machine, verify them, and the demo.

``train`` solves (or loads) a schedule, trains with real paging to ``flash_dir`` and reports predicted
against measured peak RAM, step time and energy (modelled here: CPU time x assumed power).
``verify`` trains the same model twice from the same weights and data, under the schedule and
plainly, and checks that the parameters agree, the counters equal the schedule and the budget holds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from host.run import values
from host.run.errors import InputError, SolveFailedError
from host.run.loops import OPTIMIZERS, RunResult, parameter_differences, train_plain, train_scheduled
from host.run.solve import SolveProblem, SolveReport, SolveSettings, run_solve
from host.run.sources import LOCAL_PLATFORM, ModelSource, ensure_flash_dir, load_platform
from host.solver.deadline import DEFAULT_TIME_LIMIT_S, DEMO_TIME_LIMIT_S

# verify's tolerance on max |a - b| / max |b| per parameter tensor (ops that are not deterministic)
VERIFY_RELATIVE_TOLERANCE = 1e-6
ALLOCATORS = ("keep", "return", "default")

Log = Callable[[str], None]


def _silent(message: str) -> None:
    pass


# ---------------------------------------------------------------------------------------- preparation
@dataclass
class Prepared:
    """Everything a training run needs: the traced model, its priced graph, the schedule and the partition."""

    model: str
    resolved: Any  # host.graph.resolve.ResolvedModel
    profile: Any  # PlatformProfile
    priced: Any  # PricedGraph
    no_remat_peak_bytes: int
    ram_budget_bytes: float
    schedule: Any  # device_agent.schedule.Schedule | None (None for plain training)
    partition: Any  # device_agent.executor.Partition
    solve_status: str
    solve_gap: float | None = None
    solve_message: str = ""
    solve: SolveReport | None = None  # when the schedule was solved here


def allocator_mode(allocator: str | None, cgroup: str | None) -> str:
    """The allocator policy: as asked, else keep freed memory (fastest), or return it under a cgroup."""
    if allocator is None:  # a training loop reallocates the same sizes every step: keep them, as torch's GPU caches do
        return "return" if cgroup else "keep"
    if allocator not in ALLOCATORS:
        raise InputError(f"allocator: {allocator!r} is not one of {', '.join(ALLOCATORS)}")
    return allocator


def _read_schedule(schedule: Any):
    from device_agent.schedule import Schedule
    from device_agent.serde import read_schedule_file

    if schedule is None or isinstance(schedule, Schedule):
        return schedule, "the schedule"
    return read_schedule_file(schedule), f"schedule {os.fspath(schedule)}"


def check_schedule_nodes(schedule, graph, label: str) -> None:
    """The node bytes a schedule lists are the graph's (a file edited by hand, or from another trace)."""
    for position, (listed, node) in enumerate(zip(schedule.nodes, graph.nodes, strict=False)):
        if listed.output_bytes != node.output_bytes:
            raise InputError(
                f"{label} lists node {position} ({listed.name}) with {listed.output_bytes} bytes, but the model's "
                f"graph has {node.output_bytes}: the file was edited or comes from another trace; solve it again"
            )


def prepare(source: ModelSource, *, platform: Any = None, ram_budget: Any = None,
            settings: SolveSettings | None = None, schedule: Any = None, flash_dir: str | None = ".",
            threads: int | None = None, allocator: str | None = None, cgroup: str | None = None,
            need_schedule: bool = True, optimizer: str = "sgd", log: Log = _silent,
            progress: Callable[[Any], None] | None = None) -> Prepared:
    """Trace the model, price it with ``optimizer``'s state in its fixed bytes, and solve or load its schedule;
    every check happens before training."""
    from host.costs import list_platforms, price_graph
    from host.graph.partition import partition_from_traced
    from host.solver.solve import no_remat_peak_bytes
    from host.solver.validator import ScheduleValidationError, validate_schedule

    settings = settings or SolveSettings()
    budget = values.checked("ram_budget", values.RamBudget.parse, ram_budget) if ram_budget is not None else None
    if threads is not None:
        import torch

        torch.set_num_threads(values.checked("threads", values.count, threads))
    if flash_dir is not None:
        flash_dir = ensure_flash_dir(flash_dir, log)
    if allocator_mode(allocator, cgroup) == "keep":
        from device_agent.executor.allocator import keep_freed_memory

        keep_freed_memory()
    loaded, label = _read_schedule(schedule) if need_schedule else (None, "")
    if budget is None and loaded is None and need_schedule:
        raise InputError("ram_budget is required unless a schedule is given")
    if platform is None and loaded is not None and loaded.platform in list_platforms():
        platform = loaded.platform  # price and label the run as the schedule was solved
    profile = load_platform(platform, flash_dir=flash_dir or ".", log=log)
    log(f"tracing {source.name}")
    resolved = source.resolve()
    if resolved.traced is None:
        raise InputError(
            f"{source.name!r} is a reference graph without weights; training needs a real PyTorch model "
            "(a zoo name, module:callable or an nn.Module)"
        )
    priced = price_graph(resolved.graph.with_optimizer(optimizer), profile)  # the schedule's fixed bytes count it
    peak = no_remat_peak_bytes(priced)
    if budget is not None:
        budget_bytes = budget.resolve(peak)
    elif loaded is not None and loaded.ram_budget_bytes > 0:
        budget_bytes = loaded.ram_budget_bytes
    else:
        budget_bytes = float(peak)  # plain training: the budget is only reported
    solve_report = None
    status, gap, message = "", None, ""
    if loaded is not None:
        try:
            validate_schedule(loaded, priced, ram_budget_bytes=budget_bytes)
        except ScheduleValidationError as error:
            raise InputError(f"{label} cannot run on {source.name!r}: {error}") from None
        check_schedule_nodes(loaded, resolved.graph, label)
        status, gap = loaded.solve.status or "loaded", loaded.solve.gap
    elif need_schedule:
        log(f"solving the schedule for {budget_bytes:,.0f} bytes ({100 * budget_bytes / peak:.0f}% of the no-remat "
            "peak)")
        problem = SolveProblem(source.name, resolved, profile, priced, peak, budget_bytes, settings, time.perf_counter(),
                               optimizer=optimizer)
        solve_report = run_solve(problem, progress=progress)
        if solve_report.interrupted:
            raise KeyboardInterrupt  # stopped while solving: do not go on to train
        if solve_report.schedule is None:
            raise SolveFailedError(solve_report.status, solve_report.message)
        loaded = solve_report.schedule
        status, gap, message = solve_report.status, solve_report.gap, solve_report.message
    return Prepared(
        model=source.name, resolved=resolved, profile=profile, priced=priced, no_remat_peak_bytes=peak,
        ram_budget_bytes=budget_bytes, schedule=loaded, partition=partition_from_traced(resolved.traced),
        solve_status=status, solve_gap=gap, solve_message=message, solve=solve_report,
    )


# ---------------------------------------------------------------------------------------- reports
@dataclass
class Measured:
    """Measured on this machine; medians over steps (the first step pays one-off costs)."""

    peak_tracked_bytes: int | None  # the executor's exact count of controlled tensors (None: plain)
    step_s: float
    energy_j: float
    rss_peak_bytes: int


@dataclass
class Predicted:
    """What the schedule predicted, for the platform it was solved for."""

    peak_ram_bytes: float
    step_s: float
    energy_j: float


@dataclass
class TrainReport:
    """One training run: ``mode`` is ``schedule`` or ``plain``. Energy J, time s, memory bytes."""

    model: str
    mode: str
    platform: str  # the profile this run was priced on
    predicted_platform: str | None  # the platform the schedule was solved for
    predicted_energy_source: str | None
    measured_energy_source: str
    steps: int
    optimizer: str
    losses: list[float]  # per optimizer step (the mean over its micro-batches)
    ram_budget_bytes: float
    no_remat_peak_bytes: int
    fixed_bytes: int
    measured: Measured
    events_file: str | None = None
    accumulate_steps: int = 1  # micro-batches per optimizer step
    solve_status: str | None = None
    solve_gap: float | None = None
    predicted: Predicted | None = None
    planned: dict[str, int] | None = None
    executed: dict[str, int] | None = None
    inductor: bool = False  # node functions ran inductor's kernels (--compile): not bitwise eager

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _train_report(prepared: Prepared, run: RunResult, *, plain: bool, steps: int, optimizer: str,
                  events_file: str | None, accumulate_steps: int = 1, inductor: bool = False) -> TrainReport:
    schedule = prepared.schedule
    profile = prepared.profile
    report = TrainReport(
        model=prepared.model, mode="plain" if plain else "schedule", platform=profile.name,
        predicted_platform=None, predicted_energy_source=None, measured_energy_source=run.energy_source,
        steps=steps, accumulate_steps=accumulate_steps, optimizer=optimizer, losses=run.losses, ram_budget_bytes=prepared.ram_budget_bytes,
        no_remat_peak_bytes=prepared.no_remat_peak_bytes,
        fixed_bytes=prepared.resolved.graph.with_optimizer(optimizer).fixed_bytes,
        measured=Measured(
            peak_tracked_bytes=None if plain else run.peak_tracked_bytes,
            step_s=run.median_step_s,
            energy_j=statistics.median(run.energy_j),
            rss_peak_bytes=run.rss_peak_bytes,
        ),
        events_file=events_file if not plain else None,
        inductor=inductor,
    )
    if schedule is not None and not plain:
        prediction = schedule.prediction
        report.predicted_platform = schedule.platform or profile.name
        report.predicted_energy_source = (profile.energy_source if report.predicted_platform == profile.name
                                          else "as recorded in the schedule")
        report.solve_status, report.solve_gap = prepared.solve_status, prepared.solve_gap
        report.predicted = Predicted(
            peak_ram_bytes=prediction.peak_ram_bytes,
            step_s=prediction.runtime_s + (0.0 if schedule.paging_in_runtime else prediction.paging_s),
            energy_j=prediction.energy_j,
        )
        report.planned = schedule.counts()
        report.executed = run.executed[-1] if run.executed else None
    return report


# ---------------------------------------------------------------------------------------- train
_KEYWORDS = """
    - ``model``: a zoo name (``resnet18_cifar``, see `poet models`), ``package.module:factory``, or an
      ``nn.Module`` with ``inputs`` and ``labels``. (``poet2022:`` graphs have no weights to train.)
    - ``platform``: the platform the schedule is solved and priced for: a shipped name (``a72``), a
      profile ``.json`` path or a ``PlatformProfile``; None or ``"local"`` (default) measures this
      machine quickly. With a ``schedule`` solved for a shipped platform, that platform is the default.
    - ``ram_budget``: bytes (``737719``), a size string (``"3MB"``) or a share of the no-remat peak
      (``"50%"``); optional with ``schedule`` (the schedule carries its budget).
    - ``inputs``, ``labels``, ``loss_fn``: the batch of an ``nn.Module`` model (tensor or tuple of
      tensors, batch first), its labels, and ``loss_fn(output, labels)`` (default cross-entropy).
    - ``steps``: training steps (optimizer steps), >= 1 (default {steps}).
    - ``accumulate_steps``: micro-batches per optimizer step, >= 1 (default 1): gradient accumulation as
      eager ``(loss / accumulate_steps).backward()`` per micro-batch, the schedule solved per micro-batch (the
      batch given or traced), so a larger effective batch fits the same RAM budget. Each micro-batch here is
      the example batch; losses are per optimizer step (the mean of its micro-batches).
    - ``optimizer``: ``sgd`` (momentum 0.9, default) or ``adamw``; ``lr``: learning rate > 0 (default:
      sgd 0.01, adamw 0.001).
    - ``seed``: seed of a named model's weights and batch, and of the training RNG (default 0).
    - ``flash_dir``: directory on the storage to page to (default: the current directory; created if
      missing). Page files live in a private subdirectory, removed when the run ends or fails.
    - ``schedule``: a schedule file from `poet solve --out` (or a Schedule) to run instead of solving;
      its graph fingerprint and node bytes are checked against the model.
    - ``runtime_budget`` (factor >= 1.0, default 1.2), ``time_limit_s`` (default 300), ``solve_threads``,
      ``solver``, ``formulation``, ``mip_gap``, ``paging``, ``remat``, ``paging_in_runtime``: the solve,
      as in :func:`poet_edge.solve`.
    - ``input_shape``, ``batch_size`` (>= 1), ``granularity``: as in :func:`poet_edge.solve`.
    - ``threads``: torch CPU threads, >= 1 (default: torch's choice).
    - ``allocator``: freed memory is kept for reuse (``keep``: the default, fastest), handed to glibc's
      heuristics (``default``) or returned to the OS after every free (``return``, so RSS follows the
      schedule).
    - ``log``: called with one-line messages; ``progress``: called with solver progress
      (``SolverProgress``) while solving and ``StepProgress`` after each step.
"""


def _documented(**blocks: str):
    def decorate(function):
        function.__doc__ = function.__doc__.format(**blocks)
        return function

    return decorate


@_documented(keywords=_KEYWORDS.format(steps=5))
def train(
    model: Any,
    platform: Any = None,
    ram_budget: Any = None,
    *,
    inputs: Any = None,
    labels: Any = None,
    loss_fn: Callable | None = None,
    steps: int = 5,
    accumulate_steps: int = 1,
    optimizer: str = "sgd",
    lr: float | None = None,
    seed: int = 0,
    flash_dir: str | os.PathLike = ".",
    schedule: Any = None,
    plain: bool = False,
    runtime_budget: float = 1.2,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    solve_threads: int | None = None,
    solver: str = "highs",
    formulation: str = "poet-edge",
    mip_gap: float = 1e-3,
    paging: bool = True,
    remat: bool = True,
    paging_in_runtime: bool = False,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int | None = None,
    granularity: str = "layer",
    threads: int | None = None,
    allocator: str | None = None,
    events: str | os.PathLike | None = None,
    cgroup: str | None = None,
    inductor: bool = False,
    log: Log | None = None,
    progress: Callable[[Any], None] | None = None,
) -> TrainReport:
    """Train ``model`` for ``steps`` real steps under its POET schedule, paging to ``flash_dir``.

    An ``nn.Module`` is trained in place: its parameters hold the result. Returns a
    :class:`TrainReport`: losses, predicted against measured peak RAM, step time and energy, and the
    planned against the executed instruction counts.

    Keywords (energy in joules, time in seconds, memory in bytes):
    {keywords}
    - ``plain``: ordinary PyTorch training instead, for comparison (no schedule; default False).
    - ``events``: write one JSON line per executed instruction and a summary per step to this file.
    - ``cgroup``: join this cgroup directory after tracing and solving, so its memory limit applies to
      training only (the allocator then defaults to ``return``).
    - ``inductor``: run the node functions through inductor (``poet train --compile``): fused kernels, faster
      on coarse nodes (``granularity="block"``), not bitwise equal to eager; the schedule still changes nothing
      the compiled step computes. Compiling takes seconds per distinct node on the first step.
    """
    log = log or _silent
    if inductor and plain:
        raise InputError("--compile runs POET's node functions through inductor; plain training has none "
                         "(for compiled plain training, wrap the model in torch.compile)")
    steps = values.checked("steps", values.count, steps)
    accumulate_steps = values.checked("accumulate_steps", values.count, accumulate_steps)
    _check_training_keywords(optimizer, lr)
    source = ModelSource(model, inputs=inputs, labels=labels, loss_fn=loss_fn, input_shape=input_shape,
                         batch_size=batch_size, granularity=granularity, seed=seed)
    settings = SolveSettings(runtime_budget=runtime_budget, time_limit_s=time_limit_s, solve_threads=solve_threads,
                             solver=solver, formulation=formulation, mip_gap=mip_gap, paging=paging, remat=remat,
                             paging_in_runtime=paging_in_runtime)
    prepared = prepare(source, platform=platform, ram_budget=ram_budget, settings=settings, schedule=schedule,
                       flash_dir=None if plain else flash_dir, threads=threads, allocator=allocator, cgroup=cgroup,
                       need_schedule=not plain, optimizer=optimizer, log=log, progress=progress)
    bundle = prepared.resolved.bundle
    if cgroup:
        from device_agent.executor.allocator import release_free_memory
        from device_agent.meters.memory import join_cgroup

        release_free_memory()  # tracing's freed pages must not be reused outside the cgroup
        try:
            join_cgroup(cgroup)
        except OSError as error:
            raise InputError(f"cannot join cgroup {cgroup!r}: {error}") from None
        log(f"joined cgroup {cgroup}: its memory limit applies to training from here on")
    writer = stream = None
    if events is not None and not plain:
        from device_agent.executor import EventStream, JsonLinesWriter

        writer = JsonLinesWriter(os.fspath(events))
        stream = EventStream(keep=False)
        stream.subscribe(writer)
    try:
        if plain:
            run = train_plain(bundle, steps=steps, optimizer_name=optimizer, lr=lr, seed=seed,
                              profile=prepared.profile, progress=progress, accumulate_steps=accumulate_steps)
        else:
            run = train_scheduled(prepared.partition, prepared.schedule, bundle, steps=steps,
                                  optimizer_name=optimizer, lr=lr, seed=seed, flash_dir=os.fspath(flash_dir),
                                  profile=prepared.profile, events=stream, progress=progress,
                                  return_freed_memory=allocator_mode(allocator, cgroup) == "return",
                                  accumulate_steps=accumulate_steps, inductor=inductor, log=log)
    finally:
        if writer is not None:
            writer.close()
    return _train_report(prepared, run, plain=plain, steps=steps, optimizer=optimizer,
                         events_file=os.fspath(events) if events is not None else None,
                         accumulate_steps=accumulate_steps, inductor=inductor)


def _check_training_keywords(optimizer: str, lr: float | None) -> None:
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if lr is not None:
        values.checked("lr", values.learning_rate, lr)


# ---------------------------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    """Scheduled against plain training from the same weights and data. ``ok`` when all three hold:
    parameters within ``tolerance_rel``, executed counters equal to the plan, peak within the budget."""

    model: str
    platform: str
    steps: int
    accumulate_steps: int  # micro-batches per optimizer step
    optimizer: str
    max_abs_param_diff: float
    max_rel_param_diff: float
    bitwise_equal: bool
    worst_tensor: str | None
    tolerance_rel: float
    peak_tracked_bytes: int
    predicted_peak_bytes: float
    ram_budget_bytes: float
    no_remat_peak_bytes: int
    planned: dict[str, int]
    executed: dict[str, int]
    counters_match: bool
    within_budget: bool
    step_time_s: float
    plain_step_time_s: float
    step_time_ratio: float | None
    losses: list[float]
    plain_losses: list[float]
    solve_status: str
    solve_gap: float | None
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@_documented(keywords=_KEYWORDS.format(steps=3))
def verify(
    model: Any,
    platform: Any = None,
    ram_budget: Any = None,
    *,
    inputs: Any = None,
    labels: Any = None,
    loss_fn: Callable | None = None,
    steps: int = 3,
    accumulate_steps: int = 1,
    optimizer: str = "sgd",
    lr: float | None = None,
    seed: int = 0,
    flash_dir: str | os.PathLike = ".",
    schedule: Any = None,
    runtime_budget: float = 1.2,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    solve_threads: int | None = None,
    solver: str = "highs",
    formulation: str = "poet-edge",
    mip_gap: float = 1e-3,
    paging: bool = True,
    remat: bool = True,
    paging_in_runtime: bool = False,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int | None = None,
    granularity: str = "layer",
    threads: int | None = None,
    allocator: str | None = None,
    log: Log | None = None,
    progress: Callable[[Any], None] | None = None,
) -> VerifyReport:
    """Check scheduled training against plain PyTorch: parameters, executed counters and the RAM budget.

    Trains copies of ``model`` (an ``nn.Module`` passed in is left untouched) for ``steps`` steps from
    the same weights, data and seed: once under the schedule, once plainly. Returns a
    :class:`VerifyReport` whose ``ok`` is the verdict.

    Keywords (energy in joules, time in seconds, memory in bytes):
    {keywords}
    """
    log = log or _silent
    steps = values.checked("steps", values.count, steps)
    accumulate_steps = values.checked("accumulate_steps", values.count, accumulate_steps)
    _check_training_keywords(optimizer, lr)
    source = ModelSource(model, inputs=inputs, labels=labels, loss_fn=loss_fn, input_shape=input_shape,
                         batch_size=batch_size, granularity=granularity, seed=seed)
    reference = source.copy()  # the plain run's own weights, taken before anything trains
    if not isinstance(source.model, str):
        source = source.copy()
    settings = SolveSettings(runtime_budget=runtime_budget, time_limit_s=time_limit_s, solve_threads=solve_threads,
                             solver=solver, formulation=formulation, mip_gap=mip_gap, paging=paging, remat=remat,
                             paging_in_runtime=paging_in_runtime)
    prepared = prepare(source, platform=platform, ram_budget=ram_budget, settings=settings, schedule=schedule,
                       flash_dir=flash_dir, threads=threads, allocator=allocator, optimizer=optimizer, log=log,
                       progress=progress)
    scheduled_bundle = prepared.resolved.bundle
    plain_bundle = reference.bundle()
    scheduled = train_scheduled(prepared.partition, prepared.schedule, scheduled_bundle, steps=steps,
                                optimizer_name=optimizer, lr=lr, seed=seed, flash_dir=os.fspath(flash_dir),
                                profile=prepared.profile, progress=progress,
                                return_freed_memory=allocator_mode(allocator, None) == "return",
                                accumulate_steps=accumulate_steps)
    plain = train_plain(plain_bundle, steps=steps, optimizer_name=optimizer, lr=lr, seed=seed,
                        profile=prepared.profile, progress=progress, accumulate_steps=accumulate_steps)
    diffs = parameter_differences(scheduled_bundle.module, plain_bundle.module)
    planned = prepared.schedule.counts()
    planned_counts = {k: planned[k] for k in ("computes", "recomputes", "page_ins", "page_outs")}
    counters_match = all(step == planned_counts for step in scheduled.executed)
    within_budget = scheduled.peak_tracked_bytes <= prepared.ram_budget_bytes * (1 + 1e-9)
    ok = diffs["max_rel_param_diff"] <= VERIFY_RELATIVE_TOLERANCE and counters_match and within_budget
    return VerifyReport(
        model=prepared.model,
        platform=prepared.profile.name,
        steps=steps,
        accumulate_steps=accumulate_steps,
        optimizer=optimizer,
        max_abs_param_diff=diffs["max_abs_param_diff"],
        max_rel_param_diff=diffs["max_rel_param_diff"],
        bitwise_equal=diffs["bitwise_equal"],
        worst_tensor=diffs["worst"] or None,
        tolerance_rel=VERIFY_RELATIVE_TOLERANCE,
        peak_tracked_bytes=scheduled.peak_tracked_bytes,
        predicted_peak_bytes=prepared.schedule.prediction.peak_ram_bytes,
        ram_budget_bytes=prepared.ram_budget_bytes,
        no_remat_peak_bytes=prepared.no_remat_peak_bytes,
        planned=planned_counts,
        executed=scheduled.executed[-1],
        counters_match=counters_match,
        within_budget=within_budget,
        step_time_s=scheduled.median_step_s,
        plain_step_time_s=plain.median_step_s,
        step_time_ratio=scheduled.median_step_s / plain.median_step_s if plain.median_step_s > 0 else None,
        losses=scheduled.losses,
        plain_losses=plain.losses,
        solve_status=prepared.solve_status,
        solve_gap=prepared.solve_gap,
        ok=ok,
    )


# ---------------------------------------------------------------------------------------- demo
def demo(
    model: str = "resnet18_cifar",
    *,
    flash_dir: str | os.PathLike = ".",
    steps: int = 3,
    batch_size: int | None = None,
    ram_budget: Any = "50%",
    runtime_budget: float = 2.0,
    time_limit_s: float = DEMO_TIME_LIMIT_S,
    threads: int | None = None,
    log: Log | None = None,
    progress: Callable[[Any], None] | None = None,
) -> TrainReport:
    """Profile this machine, solve ``model`` at ``ram_budget`` for it, train ``steps`` steps with real paging.

    Keywords: ``model`` a zoo name or ``module:callable`` (default resnet18_cifar); ``flash_dir`` the
    directory to page to (default: current directory; created if missing); ``steps`` >= 1 (default 3);
    ``batch_size`` >= 1 (default: the model's); ``ram_budget`` bytes, a size or a share of the
    no-remat peak (default "50%"); ``runtime_budget`` factor >= 1.0 of the plain runtime (default 2.0);
    ``time_limit_s`` solver seconds (default 60); ``threads`` torch CPU threads (default: torch's);
    ``log`` and ``progress`` as in :func:`train`. Returns the :class:`TrainReport` (with the solve's
    status and gap): predicted against measured on this machine.
    """
    return train(model, LOCAL_PLATFORM, ram_budget, steps=steps, batch_size=batch_size, flash_dir=flash_dir,
                 runtime_budget=runtime_budget, time_limit_s=time_limit_s, threads=threads, log=log,
                 progress=progress)
