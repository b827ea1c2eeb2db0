"""From a priced graph and budgets to a validated Schedule, with an honest status."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from device_agent.errors import UserError
from device_agent.schedule import Prediction, Schedule, SolveInfo
from host.costs.priced_graph import PricedGraph
from host.solver.backends import solve_milp
from host.solver.background import Background
from host.solver.baseline_pricing import (
    EJECTION_SEARCH,
    GREEDY_FROM_RESUMED_COVER,
    GREEDY_FROM_STRONGER_COVER,
    KEEP_ALL,
    MILP_NEIGHBOURHOODS,
    BaselineResult,
    cheapest_feasible,
    price_baselines,
    price_greedy,
    price_plan,
    timed_replay_s,
)
from host.solver.baselines import keep_all_plan
from host.solver.deadline import DEFAULT_TIME_LIMIT_S, Deadline, DeadlineExpired
from host.solver.eviction_bound import EVICTION_BOUND_TIME_LIMIT_S, EvictionCover, eviction_cover
from host.solver.milp import ProgressCallback, SolverProgress
from host.solver.neighbourhoods import neighbourhood_search
from host.solver.poet2022_milp import Poet2022Formulation
from host.solver.poet_milp import FormulationOptions, PoetFormulation
from host.solver.policy_search import GreedyStart, ejection_search
from host.solver.stage_plan import StagePlan, drop_unread_pages, lower_plan, make_schedule
from host.solver.validator import ScheduleValidationError, ValidationReport, validate_schedule

FORMULATIONS = {"poet-edge": PoetFormulation, "poet2022": Poet2022Formulation}


class BudgetError(UserError, ValueError):
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
    baselines: list[BaselineResult] = field(default_factory=list)  # priced on the same profile (see solve_schedule)
    # The best proven lower bound on the energy (J): the MILP's, the eviction bound's or compute-once energy.
    bound_j: float | None = None


def minimum_ram_bytes(priced: PricedGraph) -> int:
    """No schedule can go below this: computing a node holds its inputs, its output and its workspace at once."""
    graph = priced.graph
    return max(n.output_bytes + n.workspace_bytes + sum(graph.nodes[d].output_bytes for d in n.deps)
               for n in graph.nodes)


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
    """Solve the energy-optimal schedule; every returned schedule has passed the validator.

    ``options.time_limit_s`` bounds the whole call (warm start, model building, MILP, polishing and
    validation share one deadline): when it passes, the best validated schedule so far is returned
    with its proven gap. With the warm start on (the default), the baselines a user would pick instead
    are priced on the same profile (``SolveResult.baselines``), the cheapest that fits is the MILP's
    start, and the answer never costs more than the best of them.
    """
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
                f"{floor_bytes} bytes (the largest node's inputs, output and workspace together); raise --ram-budget"
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
        baseline = BaselineResult(KEEP_ALL, "feasible", report.energy_j, report.peak_ram_bytes, report.runtime_s,
                                  plan=keep_all)
        return SolveResult(
            "optimal", schedule, report, report.energy_j, 0.0, elapsed,
            message="the RAM budget does not bind: plain training meets the compute-once lower bound",
            plan=keep_all, baselines=[baseline],
            **common,
        )

    formulation_options = FormulationOptions(
        ram_budget_bytes=float(options.ram_budget_bytes),
        runtime_budget_s=runtime_budget_s,
        paging=options.paging,
        remat=options.remat,
        paging_in_runtime=options.paging_in_runtime,
    )
    baselines: list[BaselineResult] = []
    offers: list[BaselineResult] = []  # feasible baselines, cheapest first: starts and fallbacks
    # Seconds to keep for turning the MILP's columns into a validated, polished schedule.
    reserve_s = _POLISH_REPLAYS * timed_replay_s(priced) + _POLISH_FIXED_S
    # The paper's formulation is run as the paper ran it: no warm start, no baselines, no bound shortcut.
    use_baselines = options.warm_start and options.formulation == "poet-edge"
    outcome: SolveResult | None = None
    background: list[Background] = []  # phases run on threads of their own: stopped if the solve ends without them
    # Proven before any search: every node computed once, and (poet-edge) the evictions the budget forces.
    floor_bound_j = float(priced.compute_j.sum())
    try:
        if use_baselines:
            _report_phase(progress, started, "lower bound")
            # The first covering problem gets EVICTION_BOUND_TIME_LIMIT_S or its share of the time limit, whichever is less.
            # It is solved on another thread (HiGHS in its worker process, on the other core) while this one prices the
            # baselines that do not need it; the greedy from its evictions waits for it.
            bound_time_s = min(EVICTION_BOUND_TIME_LIMIT_S, _BOUND_SHARE * (options.time_limit_s or math.inf))
            cover_options = dict(remat=options.remat, paging=options.paging,
                                 paging_in_runtime=options.paging_in_runtime)
            cover_task = Background(lambda cancel: eviction_cover(
                priced, options.ram_budget_bytes, runtime_budget_s, time_limit_s=bound_time_s, cancel=cancel,
                **cover_options), "poet-eviction-bound")
            background.append(cover_task)

            def greedy_start(cover: EvictionCover | None) -> tuple[GreedyStart | None, float | None]:
                """The cover's evictions as the greedy's start, and the energy at or below which a baseline is within the
                gap of the bound it proves (optimal: nothing more to search)."""
                bound_j = _lower_bound_j(floor_bound_j, None if cover is None else cover.bound_j)
                evicts = cover is not None and bool(cover.recomputed or cover.paged)
                return cover.start(priced.graph.size) if evicts else None, _proven_optimal_below_j(options, bound_j)

            _report_phase(progress, started, "warm start")
            warm_deadline = Deadline(None if options.time_limit_s is None else
                                     (_BOUND_SHARE + _WARM_START_SHARE) * options.time_limit_s, started)
            baselines = price_baselines(priced, options.ram_budget_bytes, runtime_budget_s, remat=options.remat,
                                        paging=options.paging, paging_in_runtime=options.paging_in_runtime,
                                        pending_cover=cover_task.map(greedy_start), deadline=warm_deadline,
                                        until_one_fits=Deadline(None if options.time_limit_s is None else
                                                                options.time_limit_s - reserve_s, started))
            offers = cheapest_feasible(baselines)
            cover = cover_task.result()
            floor_bound_j = _lower_bound_j(floor_bound_j, None if cover is None else cover.bound_j)
            cover_start = greedy_start(cover)[0]
            searched: list[BaselineResult] = []  # starts the ejection search has ended its passes from, and its plans
            tried_starts = [cover_start]  # starts a greedy has run from
            # Not proven yet: more covering problems, each on another thread while this one runs ejection moves from the
            # cheapest greedy until it answers. Where the first did not close in its share, the first again, from its best
            # cover (resnet50 at 30% on m4 closes in 18-37 s of its 20; given 10 s, the answer was 47.18 J, with it
            # resumed 45.52 J); then, where the first closed (in its share, or resumed with time left), the one with
            # second restorations.
            bound_phases = [] if cover is None else [True] if cover.closed else [False, True]
            for second_restorations in bound_phases:
                stronger_time_s = _stronger_bound_time_s(options, bound_time_s, started, reserve_s,
                                                         after_resumed=second_restorations and not cover.closed)
                if not (offers and (options.remat or not second_restorations) and stronger_time_s > 0
                        and _relative_gap(offers[0].energy_j, floor_bound_j) > options.mip_gap):
                    break
                _report_phase(progress, started, "stronger lower bound" if second_restorations else "lower bound, resumed")
                # Each round of the problem that closes wakes the search beside it: its bound counts and its evictions
                # start a greedy at once, while the next round (chains of recomputations) runs. hf_bert at 45% on m4,
                # 60 s limit: the second problem's first round closes in 2 s and the greedy from it meets the bound,
                # where its chain round took the rest of its 40 s.
                greedy_name = GREEDY_FROM_STRONGER_COVER if second_restorations else GREEDY_FROM_RESUMED_COVER
                wake = _Wake()
                stronger_task = Background(
                    lambda cancel, second_restorations=second_restorations, time_s=stronger_time_s, wake=wake:
                    wake.after(lambda: eviction_cover(priced, options.ram_budget_bytes, runtime_budget_s,
                                                      time_limit_s=time_s, second_restorations=second_restorations,
                                                      cancel=cancel, resume=None if second_restorations else cover,
                                                      on_closed_round=wake.post, **cover_options)),
                    "poet-stronger-bound")
                background.append(stronger_task)
                closed_rounds = wake.posted
                beside = Deadline(stronger_time_s)
                while True:
                    enough_j = _proven_optimal_below_j(options, floor_bound_j)
                    woken = wake.event()
                    offers = _search_ejections(priced, options, runtime_budget_s, baselines, searched, started,
                                               reserve_s, progress, Deadline(beside.remaining_s(), until=woken),
                                               enough_j)
                    if (stronger_task.done() or beside.expired()
                            or (enough_j is not None and offers[0].energy_j <= enough_j)):
                        break
                    while closed_rounds:  # a round closed: its bound, then a greedy from its evictions
                        floor_bound_j, offers = _take_cover(priced, options, runtime_budget_s, baselines,
                                                            closed_rounds.pop(0), tried_starts, floor_bound_j, offers,
                                                            greedy_name)
                    if _relative_gap(offers[0].energy_j, floor_bound_j) <= options.mip_gap:
                        break
                    if not woken.is_set():  # the search's passes had ended: wait for the problem (Ctrl-C reaches this)
                        woken.wait(min(_WAKE_PERIOD_S, beside.remaining_s()))
                enough_j = _proven_optimal_below_j(options, floor_bound_j)
                if enough_j is not None and offers[0].energy_j <= enough_j:
                    # Proven by the bound already: the covering problem is stopped, not waited for (hf_bert at 45% on
                    # m4, 60 s limit: optimal at 5.1 s, by the greedy from its first round, where waiting for its
                    # chain round took 46.5 s).
                    stronger_task.stop()
                    break
                stronger = stronger_task.result()
                if stronger is None:
                    break
                # The evictions of each of its solved rounds not tried yet start a greedy, and so does the best cover
                # of a round cut short by its deadline (a start only).
                floor_bound_j, offers = _take_cover(priced, options, runtime_budget_s, baselines, stronger,
                                                    tried_starts, floor_bound_j, offers, greedy_name)
                if not stronger.closed:
                    break  # the second problem needs the first closed
            # With HiGHS, which stops on an event, the ejection moves from the cheapest plan run beside the MILP
            # instead (below); the PuLP backends are not stopped so, and get them first.
            if (offers and options.solver != "highs"
                    and _relative_gap(offers[0].energy_j, floor_bound_j) > options.mip_gap):
                offers = _search_ejections(priced, options, runtime_budget_s, baselines, searched, started, reserve_s,
                                           progress, enough_j=_proven_optimal_below_j(options, floor_bound_j))
            # A baseline within the gap of the bound proven so far is optimal without the MILP.
            if (offers and options.shortcut_non_binding
                    and _relative_gap(offers[0].energy_j, floor_bound_j) <= options.mip_gap):
                return _proven_baseline_answer(priced, offers[0], options, runtime_budget_s, started, baselines,
                                               common, floor_bound_j)
        # Model building and the MILP stop early enough to leave the reserve for the answer's validation.
        work_deadline = Deadline(None if options.time_limit_s is None else options.time_limit_s - reserve_s, started)
        work_deadline.check("the baselines and searches before the MILP ran")

        starts = offers[:_STARTS_TRIED]

        def milp_phase(cancel: threading.Event | None = None) -> SolveResult:
            """Build the model, map the cheapest offer it admits onto it as the start, and solve it; ``cancel`` (from
            another thread) stops it as Ctrl-C does."""
            deadline = work_deadline if cancel is None else work_deadline.until_set(cancel)
            _report_phase(progress, started, "building model")
            formulation = FORMULATIONS[options.formulation](priced, formulation_options, _building_deadline(deadline))
            start = None
            for offer in starts:
                deadline.check("mapping the warm start onto the model")
                start = formulation.start_from_plan(offer.plan)
                if start is not None:
                    break
            if use_baselines and options.solver == "highs" and start is not None:
                start = _search_neighbourhoods(priced, formulation, options, runtime_budget_s, start, baselines,
                                               started, deadline, progress, cancel)
            return _solve_milp(priced, formulation, options, runtime_budget_s, start, started, floor_bytes, deadline,
                               progress, floor_bound_j, cancel)

        enough_j = _proven_optimal_below_j(options, floor_bound_j)
        if (use_baselines and options.solver == "highs" and offers
                and _relative_gap(offers[0].energy_j, floor_bound_j) > options.mip_gap
                and _unsearched_start(offers, searched) is not None):
            milp_task = Background(milp_phase, "poet-milp")
            background.append(milp_task)
            outcome = _milp_beside_ejections(milp_task, priced, options, runtime_budget_s, baselines, searched, started,
                                             reserve_s, work_deadline, enough_j, progress)
            offers = cheapest_feasible(baselines)
            if outcome is None:  # an ejection plan proven by the bound: the MILP was stopped
                return _proven_baseline_answer(priced, offers[0], options, runtime_budget_s, started, baselines,
                                               common, floor_bound_j)
        else:
            outcome = milp_phase()
    except DeadlineExpired as expired:
        offers = cheapest_feasible(baselines)  # with the plans found beside the MILP
        if not offers:
            return SolveResult("timeout", None, None, None, None, time.perf_counter() - started,
                               message=f"{expired}: no schedule was found within the time limit of "
                                       f"{options.time_limit_s:g} s; raise --time-limit",
                               baselines=baselines, **common)
        return _baseline_answer(priced, offers[0], options, runtime_budget_s, started, baselines, None, common,
                                floor_bound_j, message=f"{expired}: the {offers[0].name} schedule "
                                                       f"({offers[0].energy_j:.9g} J), the best found, is returned")
    except KeyboardInterrupt:
        # Ctrl-C between the warm start and the MILP (the stronger bound, its greedies, building the model): the
        # baselines priced so far are schedules; the best is returned, marked interrupted, as the MILP's would be.
        offers = cheapest_feasible(baselines)  # with the plans a search interrupted had found
        if not offers:
            raise
        answer = _baseline_answer(priced, offers[0], options, runtime_budget_s, started, baselines, None, common,
                                  floor_bound_j, message=f"interrupted: the {offers[0].name} schedule, the best "
                                                         f"found so far, is returned")
        answer.interrupted = True
        return answer
    finally:
        _stop(background)
    if offers and (outcome.schedule is None or offers[0].energy_j < outcome.objective_j):
        # Never worse than the best baseline: a MILP stopped early, or whose model does not admit the baseline.
        best = offers[0]
        why = (f"the MILP found no schedule ({outcome.status}: {outcome.message})" if outcome.schedule is None else
               f"the MILP's schedule ({outcome.objective_j:.9g} J, {outcome.status}) costs more")
        answer = _baseline_answer(priced, best, options, runtime_budget_s, started, baselines, outcome, common,
                                  floor_bound_j,
                                  message=f"{why}: the {best.name} schedule ({best.energy_j:.9g} J) is returned")
        answer.retries, answer.interrupted = outcome.retries, outcome.interrupted
        return answer
    outcome.baselines = baselines
    outcome.solve_s = time.perf_counter() - started
    if outcome.schedule is not None:
        outcome.schedule.solve.solve_s = outcome.solve_s
    return outcome


def _milp_beside_ejections(milp_task: Background[SolveResult], priced: PricedGraph, options: SolveOptions,
                           runtime_budget_s: float, baselines: list[BaselineResult], searched: list[BaselineResult],
                           started: float, reserve_s: float, work_deadline: Deadline, enough_j: float | None,
                           progress: ProgressCallback | None) -> SolveResult | None:
    """Ejection moves on this thread while the MILP is built and solved on ``milp_task``'s (HiGHS in its worker
    process, on the other core), until it answers; then, where it proved nothing and time is left, on their own
    until their passes end. None: a plan within the gap of the bound was found, and the MILP was stopped.

    A Ctrl-C stops the MILP, whose incumbent is the answer's candidate (marked interrupted), as during a MILP alone;
    stopped before the MILP started, it is raised for the baselines to answer."""
    interrupted = False
    try:
        _search_ejections(priced, options, runtime_budget_s, baselines, searched, started, reserve_s, None,
                          work_deadline.until_set(milp_task.finished), enough_j)
    except KeyboardInterrupt:
        interrupted = True
        milp_task.cancel.set()
    else:
        offers = cheapest_feasible(baselines)
        if enough_j is not None and offers and offers[0].energy_j <= enough_j:
            milp_task.stop()
            return None
    try:
        try:
            outcome = milp_task.result()
        except KeyboardInterrupt:  # while waiting for it: result() has stopped it, and kept what it answered
            interrupted = True
            outcome = milp_task.result()
    except DeadlineExpired:  # the MILP did not start: stopped before it could, or no time was left
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    if not interrupted and outcome.status != "optimal" and not work_deadline.expired():
        # The MILP ended without a proof and before the deadline (an error): the moves resume where they stopped.
        _search_ejections(priced, options, runtime_budget_s, baselines, searched, started, reserve_s, progress,
                          enough_j=enough_j)
    return outcome


def _unsearched_start(offers: list[BaselineResult], searched: list[BaselineResult]) -> BaselineResult | None:
    """The cheapest offer with policies whose ejection passes have not ended."""
    return next((offer for offer in offers if offer.policies is not None
                 and not any(offer is done for done in searched)), None)


def _proven_optimal_below_j(options: SolveOptions, bound_j: float) -> float | None:
    """A baseline at or below this energy is within the gap of ``bound_j``: optimal, nothing more to search."""
    return bound_j / (1 - options.mip_gap) if options.shortcut_non_binding and options.mip_gap < 1 else None


def _stop(background: list[Background]) -> None:
    """Stop the phases still running on threads of their own, and wait for them (and their HiGHS workers) to end."""
    for task in background:
        task.stop()


def _stronger_bound_time_s(options: SolveOptions, bound_time_s: float, started: float, reserve_s: float,
                           after_resumed: bool = False) -> float:
    """The time of a covering problem after the first: at least _STRONGER_BOUND_TIMES the first's, and with a time
    limit all the time left but what its greedies, the ejection moves and the answer need, and never more than is left
    before the answer's reserve (at most 0: no time for it). ``after_resumed``: the first problem was solved again
    (and closed), and this one runs only where that much is left before its greedies' and the moves' share."""
    least_s = _STRONGER_BOUND_TIMES * bound_time_s
    if options.time_limit_s is None:
        return least_s
    elapsed_s = time.perf_counter() - started
    ends_at_s = (1 - _EJECTION_SHARE) * options.time_limit_s - reserve_s
    if after_resumed and ends_at_s - elapsed_s < least_s:
        return 0.0
    # Never past the time limit's work deadline: the baselines may have run until one fitted, near the limit.
    return min(max(least_s, ends_at_s - elapsed_s), options.time_limit_s - reserve_s - elapsed_s)


def _take_cover(priced: PricedGraph, options: SolveOptions, runtime_budget_s: float, baselines: list[BaselineResult],
                cover: EvictionCover, tried_starts: list[GreedyStart | None], floor_bound_j: float,
                offers: list[BaselineResult], greedy_name: str) -> tuple[float, list[BaselineResult]]:
    """A later covering problem's cover (a closed round, or its answer): its bound lifts ``floor_bound_j``, and where
    that leaves a gap, the evictions of each of its rounds not in ``tried_starts`` (added to it) start a greedy named
    ``greedy_name`` (EvictionCover.starts), even where its bound is no higher: covers of equal cost differ, and on
    hf_bert at 45% on m4 the second problem's greedy meets the bound (0.0818268 J) where the first problem's stops
    0.05% above it. Returns the bound and the offers."""
    floor_bound_j = _lower_bound_j(floor_bound_j, cover.bound_j)
    starts = [start for start in cover.starts(priced.graph.size) if start not in tried_starts]
    tried_starts += starts
    if starts and _relative_gap(offers[0].energy_j, floor_bound_j) > options.mip_gap:
        offers = _greedies_from(priced, options, runtime_budget_s, baselines, starts, greedy_name)
    return floor_bound_j, offers


T = TypeVar("T")


class _Wake:
    """What a covering problem on another thread tells the solve's thread: each round that closed (``posted``, in
    order), and that it answered. :meth:`event` is a fresh event for the next wait, set at once if either happened
    since the last, so that nothing posted between two waits is missed, and a search's deadline keeps the event that
    stopped it."""

    def __init__(self) -> None:
        self.posted: list[EvictionCover] = []
        self._lock = threading.Lock()
        self._current = threading.Event()
        self._pending = False

    def post(self, round_cover: EvictionCover) -> None:
        with self._lock:
            self.posted.append(round_cover)
            self._pending = True
            self._current.set()

    def after(self, target: Callable[[], T]) -> T:
        """``target()``, waking the solve's thread when it has returned or raised."""
        try:
            return target()
        finally:
            with self._lock:
                self._pending = True
                self._current.set()

    def event(self) -> threading.Event:
        with self._lock:
            self._current = threading.Event()
            if self._pending:
                self._current.set()
            self._pending = False
            return self._current


def _greedies_from(priced: PricedGraph, options: SolveOptions, runtime_budget_s: float,
                   baselines: list[BaselineResult], starts: list[GreedyStart], name: str) -> list[BaselineResult]:
    """The greedy from each start (a later covering problem's rounds), named ``name``, one row of that name kept in
    ``baselines`` (changed in place, so that Ctrl-C keeps it), the cheapest of this call's and an earlier call's (a
    round's greedy run as it closed): the offers. The warm start's share may be spent by now: these greedies get the
    bound's share again, in equal parts, so that the first does not leave the others no time."""
    greedies_started = time.perf_counter()
    for number, start in enumerate(starts, 1):
        greedy_deadline = Deadline(None if options.time_limit_s is None else
                                   _BOUND_SHARE * options.time_limit_s * number / len(starts), greedies_started)
        found = price_greedy(priced, options.ram_budget_bytes, runtime_budget_s, options.remat, options.paging,
                             options.paging_in_runtime, greedy_deadline, start, name)
        named = [row for row in baselines if row.name == name] + found
        baselines[:] = [row for row in baselines if row.name != name] + (cheapest_feasible(named) or named)[:1]
    return cheapest_feasible(baselines)


def _search_ejections(priced: PricedGraph, options: SolveOptions, runtime_budget_s: float,
                      baselines: list[BaselineResult], searched: list[BaselineResult], started: float,
                      reserve_s: float, progress: ProgressCallback | None,
                      beside: Deadline | None = None, enough_j: float | None = None) -> list[BaselineResult]:
    """Ejection moves (host.solver.policy_search.ejection_search) from the cheapest plan with policies whose passes
    have not ended (``searched``: the starts and plans of searches that ended on their own; one cut short resumes
    from its last plan), priced as a baseline of its own and kept in ``baselines`` (changed in place, so that a
    deadline or Ctrl-C keeps each cheaper plan as soon as it is found): the offers.

    ``beside``: the search runs beside the second covering problem, until it answers; otherwise it gets its share of
    the time limit, never into the time kept for the answer. It stops at a plan that costs at most ``enough_j``
    (within the gap of the bound proven so far)."""
    offers = cheapest_feasible(baselines)
    start = _unsearched_start(offers, searched)
    if start is None:
        return offers
    _report_phase(progress, started, "ejection search")
    # Without a limit, its share of the default one: its last round tries every move with the local search after
    # each, passes until none is taken, which on resnet50 (351 nodes) takes minutes a pass.
    if beside is not None:
        limit_s = beside.remaining_s()
    else:
        limit_s = _EJECTION_SHARE * (options.time_limit_s or DEFAULT_TIME_LIMIT_S)
    if options.time_limit_s is not None:
        limit_s = min(limit_s, options.time_limit_s - reserve_s - (time.perf_counter() - started))
    deadline = Deadline(max(0.0, limit_s), until=None if beside is None else beside.until)
    # an earlier search's row, replaced if beaten
    best = min((row.energy_j for row in baselines if row.name == EJECTION_SEARCH and row.feasible), default=math.inf)
    plans: list[BaselineResult] = []
    for plan, policies in ejection_search(priced, (start.plan, start.policies), options.ram_budget_bytes,
                                          runtime_budget_s, paging=options.paging, remat=options.remat,
                                          paging_in_runtime=options.paging_in_runtime, deadline=deadline):
        result = price_plan(EJECTION_SEARCH, plan, priced, options.ram_budget_bytes, runtime_budget_s,
                            options.paging_in_runtime)
        if not result.feasible:  # the search's memory model and the validator's replay disagree: never expected
            break
        result.policies = policies
        plans.append(result)
        if result.energy_j < best:
            _replace_offer(baselines, EJECTION_SEARCH, result)
            best = result.energy_j
        if enough_j is not None and result.energy_j <= enough_j:
            break
    else:
        if not deadline.expired():  # its passes ended: from these, there is nothing more to find
            searched += [start, *plans]
    return cheapest_feasible(baselines)


def _replace_offer(baselines: list[BaselineResult], name: str, result: BaselineResult) -> None:
    """Put ``result`` in ``baselines`` in place of the row named ``name``, if any. The ejection moves (on the solve's
    thread) and the MILP's neighbourhoods (on the MILP's) change the list at once: each removal and append is one
    operation under the interpreter's lock, so neither loses the other's row, as rebuilding the list could."""
    for row in [row for row in baselines if row.name == name]:
        baselines.remove(row)
    baselines.append(result)


def _search_neighbourhoods(priced: PricedGraph, formulation: PoetFormulation, options: SolveOptions,
                           runtime_budget_s: float, start: np.ndarray, baselines: list[BaselineResult], started: float,
                           deadline: Deadline, progress: ProgressCallback | None,
                           cancel: threading.Event | None) -> np.ndarray:
    """The MILP's start improved window by window (host.solver.neighbourhoods) for _NEIGHBOURHOOD_SHARE of the MILP's
    time; each cheaper plan is priced and kept in ``baselines`` at once (a deadline or Ctrl-C keeps it). Returns the
    columns the MILP starts from."""
    _report_phase(progress, started, "MILP neighbourhoods")
    limit_s = None if deadline.at is None else _NEIGHBOURHOOD_SHARE * max(0.0, deadline.remaining_s())
    search_deadline = Deadline(limit_s, until=deadline.until)
    best_j = min((row.energy_j for row in baselines if row.feasible), default=math.inf)
    for x in neighbourhood_search(formulation, start, search_deadline, cancel=cancel):
        result = price_plan(MILP_NEIGHBOURHOODS, formulation.plan_from_solution(x), priced, options.ram_budget_bytes,
                            runtime_budget_s, options.paging_in_runtime)
        if not result.feasible:  # the model's memory and the validator's replay disagree: never expected
            break
        start = x
        if result.energy_j < best_j:
            _replace_offer(baselines, MILP_NEIGHBOURHOODS, result)
            best_j = result.energy_j
    return start


# The MILP's start is improved by its neighbourhoods for this share of the MILP's time (the MILP gets the rest): the
# MILP improved on no hard case's start within 120 s; in a 120 s solve of hf_bert at 30% on m4 its windows took the
# answer from 0.0956399 J to 0.0949926 J.
_NEIGHBOURHOOD_SHARE = 0.75
# The solve's thread, with no ejection moves left to try beside a covering problem, wakes this often to see whether
# it answered (or a round closed).
_WAKE_PERIOD_S = 0.5
# The warm start (baselines and the greedy) gets at most this share of the time limit after the first covering
# problem's share (it ends when both have passed, counted from the start), so the MILP has time. When the first
# problem's share grew from 1/8 to 1/6 with the warm start still ending at 30%, a 5 s solve of a 405-node MLP priced
# no baseline in time and returned no schedule.
_WARM_START_SHARE = 0.175
# The first covering problem of the eviction bound gets at most this share of the time limit, and
# EVICTION_BOUND_TIME_LIMIT_S: 20 s of 120 s. On resnet50 at 30% on m4 it closes in 17.8 s (not in 15 s, its
# best cover then 2.7 times its bound), which lets the second problem run: 2.25% -> 1.94% with the ejection search.
_BOUND_SHARE = 1 / 6
# The one with second restorations (where the first does not prove the answer) is larger and gets at least this many
# times the first's time, and with a time limit everything until (1 - _EJECTION_SHARE) of it, less the answer's reserve
# (its greedies and the ejection moves share the rest; the MILP gets what they leave). On MobileNetV2 at 30% on jetsontx2
# it closes in 57 s (+7.87 mJ above compute-once, the first problem +6.85 mJ), and the greedy from its evictions lands
# 0.20% above that bound (from the first's, 2.60%); given 30 s it stopped at +7.39 mJ with a poor cover.
_STRONGER_BOUND_TIMES = 1.5
# Ejection moves on the cheapest greedy (where it is not proven optimal) get at most this share of the time limit (30 s
# of 120 s): on MobileNetV2 at 30% on m4 they take 30 s to lower the greedy's 0.48194 J to 0.47775 J; resnet50 at 30%
# on m4 goes from 45.830 to 45.655 J within them. The MILP they take it from improved on no hard case's greedy within 120 s
# (nor on MobileNetV2 at 30% on m4 within 900 s: docs/benchmarks.md).
_EJECTION_SHARE = 0.25
# Feasible baselines tried as the MILP start, cheapest first (one the model does not admit maps to None).
_STARTS_TRIED = 4
# The reserve kept for after the MILP: this many replays of plain training (solution, polish, validation)
# plus fixed seconds for reading the columns back.
_POLISH_REPLAYS = 4
_POLISH_FIXED_S = 0.2
# A model abandoned at the deadline takes time to free (measured: 0.2 s after 3.6 s of building, 405 nodes):
# building stops this share of its time before the deadline.
_TEARDOWN_SHARE = 0.1


def _building_deadline(deadline: Deadline) -> Deadline:
    if deadline.at is None:
        return deadline
    now = time.perf_counter()
    return Deadline(max(0.0, deadline.at - now) * (1 - _TEARDOWN_SHARE), now, until=deadline.until)


# The MILP starts (and is retried) only with at least this many seconds left: a worker process to start and the
# model to load before HiGHS can find anything. It can be stopped anywhere (host/solver/backends/highs.py).
_MILP_MIN_S = 2.0


def _solve_milp(priced, formulation, options: SolveOptions, runtime_budget_s: float, start, started: float,
                floor_bytes: int, deadline: Deadline, progress, floor_bound_j: float,
                cancel: threading.Event | None = None) -> SolveResult:
    """The MILP, retried without the start and then without presolve while its answers disagree with themselves.

    ``deadline`` is the MILP's: the solve's own, less the reserve for validating and polishing the answer.
    ``cancel`` (HiGHS only): set from another thread, it stops the solve as Ctrl-C does.
    """
    sizes = dict(model_columns=formulation.problem.num_cols, model_rows=formulation.problem.num_rows)
    retries: list[str] = []
    # An answer is tried as given, then without the warm start, then without presolve: a backend
    # that reports one objective and returns other columns (HiGHS 1.16 can hand back the start
    # vector unchanged) is never trusted, and never called optimal.
    attempts = [(start, True)] + ([(None, True)] if start is not None else []) + [(None, False)]
    for number, (attempt_start, presolve) in enumerate(attempts):
        if deadline.remaining_s() < _MILP_MIN_S:
            if number == 0:
                raise DeadlineExpired("starting the MILP", (
                    f"the MILP was not started: {max(0.0, deadline.remaining_s()):.1f} s were left, less than the "
                    f"{_MILP_MIN_S:g} s it needs to start"))
            retries.append("no time was left to solve again")
            break
        _report_phase(progress, started, "solving")
        result = solve_milp(
            formulation.problem,
            options.solver,
            time_limit_s=None if deadline.at is None else max(0.1, deadline.remaining_s()),
            mip_gap=options.mip_gap,
            threads=options.threads,
            start=attempt_start,
            progress=_on_solve_clock(progress, started),
            presolve=presolve,
            deadline_at=deadline.at,
            cancel=cancel,
        )
        outcome = _checked_outcome(priced, formulation, options, runtime_budget_s, result, started, floor_bytes,
                                   sizes, floor_bound_j)
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
    return outcome


def _baseline_answer(priced: PricedGraph, baseline: BaselineResult, options: SolveOptions, runtime_budget_s: float,
                     started: float, baselines: list[BaselineResult], milp: SolveResult | None, common: dict,
                     floor_bound_j: float, *, message: str, status: str | None = None) -> SolveResult:
    """A feasible baseline as the answer, validated like any other, with the gap proven against the best bound."""
    bound_j = _lower_bound_j(floor_bound_j, milp.bound_j if milp is not None else None)
    gap = _relative_gap(baseline.energy_j, bound_j)
    if status is None:
        status = "optimal" if gap <= options.mip_gap else "feasible"
    elapsed = time.perf_counter() - started
    schedule, report = _finish(priced, baseline.plan, options, runtime_budget_s, status, "baseline", baseline.name,
                               gap, elapsed)
    sizes = {} if milp is None else dict(model_columns=milp.model_columns, model_rows=milp.model_rows)
    return SolveResult(status, schedule, report, report.energy_j, gap, elapsed, message=message, plan=baseline.plan,
                       baselines=baselines, bound_j=bound_j, **common, **sizes)


def _proven_baseline_answer(priced: PricedGraph, best: BaselineResult, options: SolveOptions, runtime_budget_s: float,
                            started: float, baselines: list[BaselineResult], common: dict,
                            floor_bound_j: float) -> SolveResult:
    """A baseline within the gap of the bound proven before the MILP: optimal without it."""
    gap = _relative_gap(best.energy_j, floor_bound_j)
    return _baseline_answer(
        priced, best, options, runtime_budget_s, started, baselines, None, common, floor_bound_j, status="optimal",
        message=(f"the {best.name} schedule is within {gap:.3%} of the lower bound {floor_bound_j:.6g} J (compute-once "
                 f"energy and forced evictions): optimal within the gap {options.mip_gap:g}"))


# Relative tolerance between the solver's objective, its columns' objective and the validated energy.
# A larger disagreement is trusted only when the validated energy is still within the gap of the bound.
OBJECTIVE_AGREEMENT_RTOL = 1e-6


def _lower_bound_j(floor_bound_j: float, solver_bound_j: float | None) -> float:
    """The best proven lower bound: the solver's, or the one proven before it ran (compute-once energy, at least)."""
    return floor_bound_j if solver_bound_j is None else max(solver_bound_j, floor_bound_j)


def _relative_gap(energy_j: float, bound_j: float) -> float:
    return max(0.0, (energy_j - bound_j) / max(1e-12, abs(energy_j)))


def _on_solve_clock(progress: ProgressCallback | None, started: float) -> ProgressCallback | None:
    """The backend's reports, timed from its own start, with the solve's elapsed time instead (as the phases are): the
    progress display's clock does not jump back when the MILP starts reporting."""
    if progress is None:
        return None
    return lambda report: progress(replace(report, elapsed_s=time.perf_counter() - started))


def _report_phase(progress: ProgressCallback | None, started: float, phase: str) -> None:
    if progress is not None:
        progress(SolverProgress(elapsed_s=time.perf_counter() - started, incumbent_j=None, bound_j=None, gap=None,
                                phase=phase))


def _checked_outcome(priced, formulation, options: SolveOptions, runtime_budget_s: float, result, started: float,
                     floor_bytes: int, sizes: dict, floor_bound_j: float) -> SolveResult:
    """Turn a backend's answer into a SolveResult; status "untrusted" when its numbers disagree."""
    elapsed = time.perf_counter() - started
    bound_j = _lower_bound_j(floor_bound_j, result.bound)
    common = dict(runtime_budget_s=runtime_budget_s, minimum_ram_bytes=floor_bytes, interrupted=result.interrupted,
                  bound_j=bound_j, **sizes)
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
