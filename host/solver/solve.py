"""From a priced graph and budgets to a validated Schedule, with an honest status."""

from __future__ import annotations

import time
from dataclasses import dataclass

from device_agent.schedule import Prediction, Schedule, SolveInfo
from host.costs.priced_graph import PricedGraph
from host.solver.backends import solve_milp
from host.solver.baselines import BaselineDoesNotFitError, checkpoint_sqrt_n_plan, keep_all_plan, paging_plan
from host.solver.milp import MilpResult, ProgressCallback, SolverProgress
from host.solver.poet2022_milp import Poet2022Formulation
from host.solver.poet_milp import FormulationOptions, PoetFormulation
from host.solver.policy_search import greedy_policy_plan
from host.solver.stage_plan import StagePlan, drop_unread_pages, lower_plan, make_schedule
from host.solver.validator import ScheduleValidationError, ValidationReport, validate_schedule

FORMULATIONS = {"poet-edge": PoetFormulation, "poet2022": Poet2022Formulation}

# Every solve stops here unless told otherwise, and returns its best schedule with its gap.
DEFAULT_TIME_LIMIT_S = 300.0


class BudgetError(ValueError):
    """A budget that no schedule can meet, or that is malformed."""


@dataclass
class SolveOptions:
    ram_budget_bytes: float
    runtime_factor: float = 1.0
    solver: str = "highs"
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S
    paging: bool = True
    remat: bool = True
    paging_in_runtime: bool = False
    mip_gap: float = 1e-3
    threads: int | None = None
    formulation: str = "poet-edge"
    warm_start: bool = True
    shortcut_non_binding: bool = True


@dataclass
class SolveResult:
    status: str  # optimal | feasible | infeasible | timeout
    schedule: Schedule | None
    report: ValidationReport | None
    objective_j: float | None
    gap: float | None
    solve_s: float
    runtime_budget_s: float
    minimum_ram_bytes: int
    message: str = ""
    model_columns: int = 0
    model_rows: int = 0
    plan: StagePlan | None = None
    interrupted: bool = False  # the user stopped the solve (Ctrl-C); the schedule is its incumbent
    retries: tuple[str, ...] = ()  # why an answer was not trusted and solved again, in order


def minimum_ram_bytes(priced: PricedGraph) -> int:
    """No schedule can go below this: computing a node holds its inputs and its output at once."""
    graph = priced.graph
    return max(n.output_bytes + sum(graph.nodes[d].output_bytes for d in n.deps) for n in graph.nodes)


def no_remat_peak_bytes(priced: PricedGraph) -> int:
    """Peak controlled RAM of plain training (everything computed once and kept until last use)."""
    return evaluate_plan(keep_all_plan(priced.graph), priced).peak_ram_bytes


def evaluate_plan(plan: StagePlan, priced: PricedGraph, **budgets) -> ValidationReport:
    schedule = make_schedule(priced.graph, lower_plan(plan, priced.graph))
    return validate_schedule(schedule, priced, **budgets)


def check_budgets(priced: PricedGraph, ram_budget_bytes: float, runtime_factor: float) -> None:
    if runtime_factor < 1.0:
        raise BudgetError(
            f"runtime budget factor {runtime_factor} is below 1.0: no schedule is faster than computing every "
            "node once; use a factor >= 1.0 (e.g. 1.2 allows 20% recomputation)"
        )
    if ram_budget_bytes <= 0:
        raise BudgetError(f"RAM budget must be a positive number of bytes, got {ram_budget_bytes}")


def _finish(
    priced: PricedGraph,
    plan: StagePlan,
    options: SolveOptions,
    runtime_budget_s: float,
    status: str,
    solver_name: str,
    formulation: str,
    gap: float | None,
    solve_s: float,
) -> tuple[Schedule, ValidationReport]:
    graph = priced.graph
    schedule = make_schedule(
        graph,
        lower_plan(plan, graph),
        platform=priced.platform,
        ram_budget_bytes=float(options.ram_budget_bytes),
        runtime_budget_s=runtime_budget_s,
        paging_in_runtime=options.paging_in_runtime,
    )
    report = validate_schedule(schedule, priced)
    schedule.prediction = Prediction(
        peak_ram_bytes=report.peak_ram_bytes,
        energy_j=report.energy_j,
        compute_j=report.compute_j,
        paging_j=report.paging_j,
        runtime_s=report.runtime_s,
        paging_s=report.paging_s,
        recomputes=report.recomputes,
        page_ins=report.page_ins,
        page_outs=report.page_outs,
    )
    schedule.solve = SolveInfo(
        status=status, solver=solver_name, formulation=formulation, gap=gap or 0.0, solve_s=solve_s
    )
    return schedule, report


def solve_schedule(priced: PricedGraph, options: SolveOptions, progress: ProgressCallback | None = None) -> SolveResult:
    """Solve the energy-optimal schedule; every returned schedule has passed the validator."""
    check_budgets(priced, options.ram_budget_bytes, options.runtime_factor)
    started = time.perf_counter()
    runtime_budget_s = options.runtime_factor * priced.base_runtime_s
    floor_bytes = minimum_ram_bytes(priced)
    common = dict(runtime_budget_s=runtime_budget_s, minimum_ram_bytes=floor_bytes)
    if options.ram_budget_bytes < floor_bytes:
        return SolveResult(
            "infeasible", None, None, None, None, time.perf_counter() - started,
            message=(
                f"RAM budget {options.ram_budget_bytes:.0f} bytes is below the minimum any schedule can meet: "
                f"{floor_bytes} bytes (the largest node's inputs and output together); raise --ram-budget"
            ),
            **common,
        )

    # A budget that does not bind: plain training reaches the compute-once lower bound, so it is optimal.
    if options.shortcut_non_binding and no_remat_peak_bytes(priced) <= options.ram_budget_bytes:
        keep_all = keep_all_plan(priced.graph)
        elapsed = time.perf_counter() - started
        schedule, report = _finish(
            priced, keep_all, options, runtime_budget_s, "optimal", "bound", "keep-all", 0.0, elapsed
        )
        return SolveResult(
            "optimal", schedule, report, report.energy_j, 0.0, elapsed,
            message="the RAM budget does not bind: plain training meets the compute-once lower bound",
            plan=keep_all,
            **common,
        )

    formulation_options = FormulationOptions(
        ram_budget_bytes=float(options.ram_budget_bytes),
        runtime_budget_s=runtime_budget_s,
        paging=options.paging,
        remat=options.remat,
        paging_in_runtime=options.paging_in_runtime,
    )
    candidates: list[tuple[float, StagePlan]] = []
    # The paper's formulation is run as the paper ran it: no warm start, no bound shortcut.
    if options.warm_start and options.formulation == "poet-edge":
        _report_phase(progress, started, "warm start")
        candidates = _candidate_plans(priced, options, runtime_budget_s)
        # Every node is computed at least once, so compute-once energy bounds every schedule from
        # below; a heuristic plan within the gap of that bound is proven optimal without the MILP.
        if candidates and options.shortcut_non_binding:
            energy_j, plan = candidates[0]
            bound_j = _lower_bound_j(priced, None)
            gap = _relative_gap(energy_j, bound_j)
            if gap <= options.mip_gap:
                elapsed = time.perf_counter() - started
                schedule, report = _finish(priced, plan, options, runtime_budget_s, "optimal", "bound",
                                           "greedy", gap, elapsed)
                return SolveResult(
                    "optimal", schedule, report, report.energy_j, gap, elapsed,
                    message=(f"the greedy schedule is within {gap:.3%} of the compute-once lower bound "
                             f"{bound_j:.6g} J: optimal within the gap {options.mip_gap:g}"),
                    plan=plan, **common,
                )
    _report_phase(progress, started, "building model")
    formulation = FORMULATIONS[options.formulation](priced, formulation_options)
    start = None
    for _energy_j, plan in candidates:
        start = formulation.start_from_plan(plan)
        if start is not None:
            break
    sizes = dict(model_columns=formulation.problem.num_cols, model_rows=formulation.problem.num_rows)
    retries: list[str] = []
    # An answer is tried as given, then without the warm start, then without presolve: a backend
    # that reports one objective and returns other columns (HiGHS 1.16 can hand back the start
    # vector unchanged) is never trusted, and never called optimal.
    attempts = [(start, True)] + ([(None, True)] if start is not None else []) + [(None, False)]
    for attempt_start, presolve in attempts:
        time_left_s = None
        if options.time_limit_s is not None:
            time_left_s = max(1.0, options.time_limit_s - (time.perf_counter() - started))
        _report_phase(progress, started, "solving")
        result = solve_milp(
            formulation.problem,
            options.solver,
            time_limit_s=time_left_s,
            mip_gap=options.mip_gap,
            threads=options.threads,
            start=attempt_start,
            progress=progress,
            presolve=presolve,
        )
        if result.x is None and result.status == "timeout" and start is not None:
            # Stopped (time limit, Ctrl-C) before the backend kept a solution: the warm start is one.
            # (its gap is proven against the bound in _checked_outcome)
            result = MilpResult("feasible", start, formulation.problem.objective(start), result.bound, None,
                                result.solve_s,
                                result.message + "; the schedule is the warm start", interrupted=result.interrupted)
        outcome = _checked_outcome(priced, formulation, options, runtime_budget_s, result, started, floor_bytes,
                                   sizes)
        distrust = outcome.message if outcome.status == "untrusted" else None
        if distrust is None or result.interrupted:
            break
        retries.append(distrust)
    if outcome.status == "untrusted":
        # Every attempt disagreed with itself: keep the validated schedule, claim nothing about optimality.
        outcome.status = "feasible" if outcome.schedule is not None else "error"
        outcome.gap = None
        if outcome.schedule is not None:
            outcome.schedule.solve.status = outcome.status
            outcome.schedule.solve.gap = 0.0
    outcome.retries = tuple(retries)
    outcome.solve_s = time.perf_counter() - started
    if outcome.schedule is not None:
        outcome.schedule.solve.solve_s = outcome.solve_s
    return outcome


# Relative tolerance between the solver's objective, its columns' objective and the validated energy.
# A larger disagreement is trusted only when the validated energy is still within the gap of the bound.
OBJECTIVE_AGREEMENT_RTOL = 1e-6


def _lower_bound_j(priced: PricedGraph, solver_bound_j: float | None) -> float:
    """The best proven lower bound: the solver's, or computing every node once (no schedule does less)."""
    compute_once_j = float(priced.compute_j.sum())
    return compute_once_j if solver_bound_j is None else max(solver_bound_j, compute_once_j)


def _relative_gap(energy_j: float, bound_j: float) -> float:
    return max(0.0, (energy_j - bound_j) / max(1e-12, abs(energy_j)))


def _report_phase(progress: ProgressCallback | None, started: float, phase: str) -> None:
    if progress is not None:
        progress(SolverProgress(elapsed_s=time.perf_counter() - started, incumbent_j=None, bound_j=None, gap=None,
                                phase=phase))


def _checked_outcome(priced, formulation, options: SolveOptions, runtime_budget_s: float, result, started: float,
                     floor_bytes: int, sizes: dict) -> SolveResult:
    """Turn a backend's answer into a SolveResult; status "untrusted" when its numbers disagree."""
    elapsed = time.perf_counter() - started
    common = dict(runtime_budget_s=runtime_budget_s, minimum_ram_bytes=floor_bytes, interrupted=result.interrupted,
                  **sizes)
    if result.x is None:
        status, message = result.status, result.message
        if status in ("optimal", "feasible"):  # a solver that claims an answer but gives no columns
            status = "error"
            message = f"the {options.solver} backend reported {result.status} but returned no solution"
        if status == "infeasible":
            message = (
                f"no schedule meets {options.ram_budget_bytes:.0f} bytes and a runtime factor of "
                f"{options.runtime_factor} with {_ablation(options)}; the hard floor is {floor_bytes} bytes — "
                "raise --ram-budget or --runtime-budget" + ("" if options.paging else ", or allow paging")
            )
        return SolveResult(status, None, None, None, result.gap, elapsed, message=message, **common)
    plan = formulation.plan_from_solution(result.x)
    try:
        schedule, report = _finish(
            priced, plan, options, runtime_budget_s, result.status, options.solver, formulation.name,
            result.gap, elapsed,
        )
    except ScheduleValidationError as error:
        return SolveResult(
            "error", None, None, result.objective, result.gap, elapsed,
            message=f"the {formulation.name} solution failed validation: {error}", **common,
        )
    columns_j = formulation.problem.objective(result.x)
    scale_j = max(1e-12, abs(columns_j))
    disagreements = []
    if result.objective is not None and abs(result.objective - columns_j) > OBJECTIVE_AGREEMENT_RTOL * scale_j:
        disagreements.append(f"the solver reported {result.objective:.9g} J but its columns cost {columns_j:.9g} J")
    if abs(report.energy_j - columns_j) > OBJECTIVE_AGREEMENT_RTOL * scale_j:
        disagreements.append(f"the columns cost {columns_j:.9g} J but the validator replays {report.energy_j:.9g} J")
    # The gap that is actually proven: the validated energy against the solver's lower bound.
    # Computing every node once is a lower bound of its own, so a gap is always proven.
    bound_j = _lower_bound_j(priced, result.bound)
    pruned = None if disagreements else drop_unread_pages(plan)
    if pruned is not None:  # checked as solved; then polished: cheaper, same RAM, re-validated
        try:
            schedule, report = _finish(priced, pruned, options, runtime_budget_s, result.status, options.solver,
                                       formulation.name, result.gap, elapsed)
            plan = pruned
        except ScheduleValidationError:  # never expected; the checked schedule stands
            pass
    proven_gap = _relative_gap(report.energy_j, bound_j)
    status, message = result.status, result.message
    gap = proven_gap
    if disagreements:
        message = "; ".join(disagreements)
    if status == "optimal" and proven_gap > options.mip_gap + OBJECTIVE_AGREEMENT_RTOL:
        status = "untrusted"  # the proof does not cover the schedule that was returned
        if not disagreements:
            message = (f"the validated energy {report.energy_j:.9g} J is {proven_gap:.3g} above the bound "
                       f"{bound_j:.9g} J, more than the gap {options.mip_gap:g}")
    if result.interrupted:
        message = "interrupted: the best schedule found so far" + (f" ({message})" if disagreements else "")
        if status in ("untrusted", "optimal"):
            status = "feasible"
    schedule.solve.status = status if status != "untrusted" else "feasible"
    schedule.solve.gap = gap or 0.0
    return SolveResult(status, schedule, report, report.energy_j, gap, elapsed, message=message, plan=plan, **common)


def _ablation(options: SolveOptions) -> str:
    if not options.paging and not options.remat:
        return "neither paging nor recomputation"
    if not options.paging:
        return "recomputation only"
    if not options.remat:
        return "paging only"
    return "recomputation and paging"


def _candidate_plans(priced: PricedGraph, options: SolveOptions, runtime_budget_s: float) -> list[tuple[float, StagePlan]]:
    """Heuristic plans that meet both budgets, cheapest first, with their validated energy."""
    plans: list[StagePlan] = []
    greedy = greedy_policy_plan(priced, options.ram_budget_bytes, runtime_budget_s, paging=options.paging,
                                remat=options.remat, paging_in_runtime=options.paging_in_runtime)
    if greedy is not None:
        plans.append(greedy)
    if options.paging:
        try:
            plans.append(paging_plan(priced.graph, options.ram_budget_bytes))
        except BaselineDoesNotFitError:
            pass
    if options.remat:
        plans.append(checkpoint_sqrt_n_plan(priced.graph))
    candidates = []
    for plan in plans:
        try:
            report = evaluate_plan(plan, priced, ram_budget_bytes=options.ram_budget_bytes,
                                   runtime_budget_s=runtime_budget_s, paging_in_runtime=options.paging_in_runtime)
        except ScheduleValidationError:
            continue
        candidates.append((report.energy_j, plan))
    return sorted(candidates, key=lambda candidate: candidate[0])
