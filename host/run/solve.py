"""Solve a model's energy-optimal schedule on a platform: the library behind `poet solve` and `poet pareto`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from device_agent.optimizers import DEFAULT_OPTIMIZER
from host.run import values
from host.run.errors import InputError
from host.run.sources import ModelSource, load_platform
from host.solver.solve import DEFAULT_TIME_LIMIT_S, FORMULATIONS

SOLVERS = ("highs", "cbc", "gurobi")


def checked_optimizer(optimizer: Any) -> str:
    """``optimizer`` if it is one whose state the plan can count (the names `poet train` takes), else InputError."""
    from device_agent.optimizers import OPTIMIZER_STATE

    if optimizer not in OPTIMIZER_STATE:
        raise InputError(f"optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZER_STATE)} (its state is part "
                         "of the fixed bytes)")
    return optimizer


@dataclass
class SolveSettings:
    """How to solve: budgets other than RAM, the backend and its limits, the ablations."""

    runtime_budget: float = 1.2
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S
    solve_threads: int | None = None
    solver: str = "highs"
    formulation: str = "poet-edge"
    mip_gap: float = 1e-3
    paging: bool = True
    remat: bool = True
    paging_in_runtime: bool = False

    def __post_init__(self) -> None:
        self.runtime_budget = values.checked("runtime_budget", values.runtime_factor, self.runtime_budget)
        if self.time_limit_s is not None:
            self.time_limit_s = values.checked("time_limit_s", values.time_limit_s, self.time_limit_s)
        if self.solve_threads is not None:
            self.solve_threads = values.checked("solve_threads", values.count, self.solve_threads)
        self.mip_gap = values.checked("mip_gap", values.mip_gap, self.mip_gap)
        if self.solver not in SOLVERS:
            raise InputError(f"solver: {self.solver!r} is not one of {', '.join(SOLVERS)}")
        if self.formulation not in FORMULATIONS:
            raise InputError(f"formulation: {self.formulation!r} is not one of {', '.join(FORMULATIONS)}")

    def options(self, ram_budget_bytes: float):
        from host.solver.solve import SolveOptions

        return SolveOptions(
            ram_budget_bytes=ram_budget_bytes,
            runtime_factor=self.runtime_budget,
            solver=self.solver,
            time_limit_s=self.time_limit_s,
            paging=self.paging,
            remat=self.remat,
            paging_in_runtime=self.paging_in_runtime,
            mip_gap=self.mip_gap,
            threads=self.solve_threads,
            formulation=self.formulation,
        )


@dataclass
class SolveProblem:
    """A traced, priced model with its RAM budget in bytes: everything the solver needs.

    ``optimizer`` names the optimizer training will use: its state counts in the reported fixed bytes.
    """

    model: str
    resolved: Any  # host.graph.resolve.ResolvedModel
    profile: Any  # host.costs.PlatformProfile
    priced: Any  # host.costs.PricedGraph
    no_remat_peak_bytes: int
    ram_budget_bytes: float
    settings: SolveSettings
    started: float  # time.perf_counter() when the model started loading
    optimizer: str = DEFAULT_OPTIMIZER

    @property
    def graph(self):
        return self.resolved.graph


@dataclass
class SolveReport:
    """The outcome of a solve. Energy in joules, time in seconds, memory in bytes (per training step).

    ``status`` is ``optimal`` (proven within ``mip_gap``), ``feasible`` (a time limit or an interruption
    stopped the solver: ``gap`` says how far from proven it was), ``infeasible`` (``message`` says why,
    ``minimum_ram_bytes`` is the hard floor), ``timeout`` (no schedule found in time) or ``error``.
    ``schedule`` is the validated :class:`device_agent.schedule.Schedule` (None without one); write it
    with :meth:`save`.
    """

    status: str
    model: str
    platform: str
    energy_source: str
    objective_j: float | None
    compute_j: float | None
    paging_j: float | None
    runtime_s: float | None
    runtime_budget_s: float
    peak_ram_bytes: int | None
    ram_budget_bytes: float
    no_remat_peak_bytes: int
    minimum_ram_bytes: int
    fixed_bytes: int  # weights, their gradients, the optimizer's state, the batch, buffers: see fixed_breakdown_bytes
    optimizer: str
    fixed_breakdown_bytes: dict[str, int]
    recomputes: int | None
    page_ins: int | None
    page_outs: int | None
    solve_s: float
    total_s: float
    gap: float | None
    solver: str
    formulation: str | None
    nodes: int
    edges: int
    flops_per_step: float
    message: str
    interrupted: bool
    # The baselines a user would pick instead, priced on the same profile by the validator's replay: dicts with
    # name, status (feasible | infeasible), predicted_energy_j, peak_ram_bytes, runtime_s and message.
    baselines: list[dict[str, Any]] = field(default_factory=list)
    schedule: Any = field(default=None, repr=False)  # device_agent.schedule.Schedule | None
    plan: Any = field(default=None, repr=False, compare=False)  # the solver's StagePlan (for plots)
    validation: Any = field(default=None, repr=False, compare=False)  # the validator's ValidationReport

    @property
    def ok(self) -> bool:
        """A schedule was found (optimal or feasible)."""
        return self.schedule is not None

    def to_dict(self) -> dict[str, Any]:
        """Every figure as plain JSON-able values (the schedule itself is left out: see :meth:`save`)."""
        skip = {"schedule", "plan", "validation"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    def save(self, path: str | os.PathLike) -> None:
        """Write the schedule as a poet.v1.Schedule JSON file (atomically), for `poet train --schedule`."""
        from device_agent.serde import write_schedule_file

        if self.schedule is None:
            raise InputError(f"there is no schedule to save (status {self.status})")
        write_schedule_file(self.schedule, path)


def prepare_solve(source: ModelSource, platform: Any, ram_budget: Any, settings: SolveSettings,
                  log: Callable[[str], None] = lambda message: None,
                  optimizer: str = DEFAULT_OPTIMIZER) -> SolveProblem:
    """Trace and price the model, resolve the RAM budget against its no-remat peak."""
    from host.costs import price_graph
    from host.solver.solve import no_remat_peak_bytes

    started = time.perf_counter()
    optimizer = checked_optimizer(optimizer)
    budget = values.checked("ram_budget", values.RamBudget.parse, ram_budget)
    profile = load_platform(platform, log=log)
    log(f"tracing {source.name}")
    resolved = source.resolve()
    priced = price_graph(resolved.graph.with_optimizer(optimizer), profile)  # the schedule's fixed bytes count it
    peak = no_remat_peak_bytes(priced)
    return SolveProblem(source.name, resolved, profile, priced, peak, budget.resolve(peak), settings, started,
                        optimizer)


def run_solve(problem: SolveProblem, progress: Callable[[Any], None] | None = None) -> SolveReport:
    """Solve ``problem``; every schedule returned has passed the independent validator."""
    from host.solver.solve import solve_schedule

    result = solve_schedule(problem.priced, problem.settings.options(problem.ram_budget_bytes), progress=progress)
    report, schedule, graph = result.report, result.schedule, problem.graph
    planned = graph.with_optimizer(problem.optimizer)  # the fixed bytes with the optimizer's state

    def figure(name: str):
        return getattr(report, name) if report is not None else None

    return SolveReport(
        status=result.status,
        model=problem.model,
        platform=problem.profile.name,
        energy_source=problem.profile.energy_source,
        objective_j=figure("energy_j"),
        compute_j=figure("compute_j"),
        paging_j=figure("paging_j"),
        runtime_s=figure("runtime_s"),
        runtime_budget_s=result.runtime_budget_s,
        peak_ram_bytes=figure("peak_ram_bytes"),
        ram_budget_bytes=problem.ram_budget_bytes,
        no_remat_peak_bytes=problem.no_remat_peak_bytes,
        minimum_ram_bytes=result.minimum_ram_bytes,
        fixed_bytes=planned.fixed_bytes,
        optimizer=problem.optimizer,
        fixed_breakdown_bytes=planned.fixed_breakdown_bytes(),
        recomputes=figure("recomputes"),
        page_ins=figure("page_ins"),
        page_outs=figure("page_outs"),
        solve_s=result.solve_s,
        total_s=time.perf_counter() - problem.started,
        gap=result.gap,
        solver=schedule.solve.solver if schedule else problem.settings.solver,
        formulation=schedule.solve.formulation if schedule else None,
        nodes=graph.size,
        edges=len(graph.edges),
        flops_per_step=graph.total_flops,
        message=result.message,
        interrupted=result.interrupted,
        baselines=[baseline.to_dict() for baseline in result.baselines],
        schedule=schedule,
        plan=result.plan,
        validation=report,
    )


def solve(
    model: Any,
    platform: Any,
    ram_budget: Any,
    *,
    runtime_budget: float = 1.2,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    solve_threads: int | None = None,
    solver: str = "highs",
    formulation: str = "poet-edge",
    mip_gap: float = 1e-3,
    paging: bool = True,
    remat: bool = True,
    paging_in_runtime: bool = False,
    inputs: Any = None,
    labels: Any = None,
    loss_fn: Callable | None = None,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int | None = None,
    granularity: str = "layer",
    seed: int = 0,
    optimizer: str = DEFAULT_OPTIMIZER,
    progress: Callable[[Any], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> SolveReport:
    """Solve the energy-optimal training schedule of ``model`` on ``platform`` under ``ram_budget``.

    Example (the POET paper's call, on the paper's own graph)::

        solve(model="poet2022:resnet18_cifar", platform="m4", ram_budget=737719, runtime_budget=1.5,
              time_limit_s=400, solve_threads=16)

    Keywords (energy in joules, time in seconds, memory in bytes):

    - ``model``: a zoo name (``resnet18_cifar``, see `poet models`), ``poet2022:<name>`` for the paper
      code's reference graph, ``package.module:factory``, or an ``nn.Module`` with ``inputs`` and ``labels``.
    - ``platform``: a shipped platform name (``m4``, ``a72``, see `poet platforms`), a profile ``.json``
      path, a ``PlatformProfile``, or ``"local"`` to measure this machine quickly.
    - ``ram_budget``: bytes (``737719``), a size string (``"3MB"``, ``"2.5MiB"``) or a share of the
      model's no-remat peak (``"50%"``: the controlled RAM of plain training). It bounds activations,
      their gradients and paged-in buffers; weights, their gradients and optimizer state are fixed bytes.
    - ``runtime_budget``: factor of the plain forward+backward runtime, >= 1.0 (default 1.2).
    - ``time_limit_s``: wall-clock limit of the whole solve in seconds, tracing excluded (default 300; None:
      no limit). When it expires, the best validated schedule found is returned with status ``feasible``
      and its ``gap``; it is never costlier than the best baseline (``baselines`` in the report).
    - ``solve_threads``: solver threads (default: the solver's choice).
    - ``solver``: ``highs`` (default), ``cbc`` or ``gurobi``.
    - ``formulation``: ``poet-edge`` (default: the fast formulation) or ``poet2022`` (the paper's MILP).
    - ``mip_gap``: relative gap that counts as optimal, in [0, 1] (default 0.001 = 0.1%).
    - ``paging`` / ``remat``: allow paging to flash / recomputation (default both; ablations turn one off).
    - ``paging_in_runtime``: count paging time in the runtime budget (default False, as the paper).
    - ``inputs``, ``labels``, ``loss_fn``: the batch of an ``nn.Module`` model (tensor or tuple of
      tensors, batch first), its labels, and ``loss_fn(output, labels)`` (default cross-entropy).
    - ``input_shape``: for a ``module:factory`` returning a bare module, batch first, e.g. ``(32, 64)``.
    - ``batch_size``: batch size of a zoo or ``poet2022:`` model (default: the model's), >= 1.
    - ``granularity``: ``layer`` (default), ``block`` or ``op``: how traced ops become schedulable nodes.
    - ``seed``: seed of a named model's weights and batch (default 0).
    - ``optimizer``: the optimizer training will use, ``sgd`` (momentum: one buffer per trainable weight,
      default) or ``adamw`` (two, and a step count): its state is part of ``fixed_bytes``.
    - ``progress``: called with ``host.solver.milp.SolverProgress`` reports (elapsed_s, incumbent_j,
      bound_j, gap, phase) while solving.
    - ``log``: called with one-line messages (default: silent).

    Returns a :class:`SolveReport`. Ctrl-C during the solve returns the incumbent (``interrupted`` set).
    Raises :class:`InputError` (and the model, platform and budget errors) on bad input.
    """
    settings = SolveSettings(runtime_budget=runtime_budget, time_limit_s=time_limit_s, solve_threads=solve_threads,
                             solver=solver, formulation=formulation, mip_gap=mip_gap, paging=paging, remat=remat,
                             paging_in_runtime=paging_in_runtime)
    source = ModelSource(model, inputs=inputs, labels=labels, loss_fn=loss_fn, input_shape=input_shape,
                         batch_size=batch_size, granularity=granularity, seed=seed)
    problem = prepare_solve(source, platform, ram_budget, settings, log=log or (lambda message: None),
                            optimizer=optimizer)
    return run_solve(problem, progress=progress)


@dataclass
class ParetoReport:
    """Energy against RAM budget: one row per (budget, method); POET, its ablations and the baselines."""

    model: str
    platform: str
    energy_source: str
    runtime_budget: float
    rows: list[dict[str, Any]]
    optimizer: str = DEFAULT_OPTIMIZER
    fixed_bytes: int = 0  # as in SolveReport: every row adds these to its controlled RAM
    fixed_breakdown_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pareto(
    model: Any,
    platform: Any,
    *,
    points: int = 6,
    runtime_budget: float = 1.2,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    solver: str = "highs",
    formulation: str = "poet-edge",
    input_shape: tuple[int, ...] | None = None,
    batch_size: int | None = None,
    granularity: str = "layer",
    seed: int = 0,
    optimizer: str = DEFAULT_OPTIMIZER,
    log: Callable[[str], None] | None = None,
) -> ParetoReport:
    """Energy against RAM budget, at ``points`` budgets from the hard floor to the no-remat peak.

    ``model``, ``platform``, ``runtime_budget``, ``time_limit_s`` (per solve), ``solver``, ``formulation``,
    ``input_shape``, ``batch_size``, ``granularity``, ``seed`` and ``optimizer`` (its state is in ``fixed_bytes``)
    are as in :func:`solve`; ``points`` >= 2
    (default 6); ``log`` gets a line per solve. Each row has ``ram_budget_bytes``, ``method``, ``status``,
    ``energy_j``, ``runtime_s``, ``peak_ram_bytes``, ``recomputes``, ``page_ins`` and ``page_outs``.
    """
    from host.costs import price_graph
    from host.solver.pareto import pareto_sweep

    points = values.checked("points", values.count, points, minimum=2)
    optimizer = checked_optimizer(optimizer)
    settings = SolveSettings(runtime_budget=runtime_budget, time_limit_s=time_limit_s, solver=solver,
                             formulation=formulation)
    source = ModelSource(model, input_shape=input_shape, batch_size=batch_size, granularity=granularity, seed=seed)
    log = log or (lambda message: None)
    profile = load_platform(platform, log=log)
    log(f"tracing {source.name}")
    graph = source.resolve().graph
    priced = price_graph(graph, profile)
    rows = pareto_sweep(priced, points=points, runtime_factor=settings.runtime_budget, solver=settings.solver,
                        time_limit_s=settings.time_limit_s, progress=log, formulation=settings.formulation)
    planned = graph.with_optimizer(optimizer)
    return ParetoReport(source.name, profile.name, profile.energy_source, settings.runtime_budget, rows, optimizer,
                        planned.fixed_bytes, planned.fixed_breakdown_bytes())
