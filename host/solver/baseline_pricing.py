"""The baselines a user would pick instead of POET, priced by the validator's replay on the same profile.

`poet solve` lists them beside its answer, offers the cheapest that fits as the MILP's start, and never
answers with a schedule that costs more than the best of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from host.costs.priced_graph import PricedGraph
from host.solver.background import Pending
from host.solver.baselines import (
    BaselineDoesNotFitError,
    block_boundaries,
    block_checkpoint_plan,
    checkpoint_sequential_plan,
    checkpoint_sqrt_n_plan,
    forward_order,
    keep_all_plan,
    paging_plan,
)
from host.solver.deadline import Deadline
from host.solver.policy_search import GreedyStart, greedy_policy_search
from host.solver.stage_plan import StagePlan, lower_plan, make_schedule
from host.solver.validator import ScheduleValidationError, ValidationReport, validate_schedule

KEEP_ALL = "keep all (plain PyTorch)"
GREEDY = "greedy"
GREEDY_FROM_COVER = "greedy from the eviction cover"
# The greedy from the covering problem with second restorations (host.solver.eviction_bound), where it differs.
GREEDY_FROM_STRONGER_COVER = "greedy from the eviction cover with second restorations"
# ... from the first covering problem's cover, solved again with more time where it did not close in its own
GREEDY_FROM_RESUMED_COVER = "greedy from the resumed eviction cover"
# The cheapest greedy's plan improved by ejection moves (host.solver.policy_search.ejection_search).
EJECTION_SEARCH = "ejection search from the cheapest greedy"
# The MILP's start improved window by window, the rest of it fixed (host.solver.neighbourhoods).
MILP_NEIGHBOURHOODS = "MILP neighbourhoods from the cheapest plan"


@dataclass
class BaselineResult:
    """One baseline on the solve's graph and profile. ``status``: feasible | infeasible (``message`` says why)."""

    name: str
    status: str
    energy_j: float | None
    peak_ram_bytes: int | None
    runtime_s: float | None
    message: str = ""
    plan: StagePlan | None = field(default=None, repr=False, compare=False)
    # A greedy's plan as policies and kept gaps (host.solver.policy_search), for searches that start from it.
    policies: GreedyStart | None = field(default=None, repr=False, compare=False)

    @property
    def feasible(self) -> bool:
        return self.status == "feasible"

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "predicted_energy_j": self.energy_j,
                "peak_ram_bytes": self.peak_ram_bytes, "runtime_s": self.runtime_s, "message": self.message}


def replay_plan(plan: StagePlan, priced: PricedGraph, paging_in_runtime: bool = False) -> ValidationReport:
    """The validator's replay of the lowered plan, without budgets (they are compared by the caller)."""
    schedule = make_schedule(priced.graph, lower_plan(plan, priced.graph))
    return validate_schedule(schedule, priced, paging_in_runtime=paging_in_runtime)


def price_plan(name: str, plan: StagePlan, priced: PricedGraph, ram_budget_bytes: float, runtime_budget_s: float,
               paging_in_runtime: bool = False) -> BaselineResult:
    """Replay ``plan``; feasible when its peak and runtime are within the budgets (no tolerance)."""
    try:
        report = replay_plan(plan, priced, paging_in_runtime)
    except ScheduleValidationError as error:  # never expected of a baseline: reported, never offered
        return BaselineResult(name, "infeasible", None, None, None, f"the validator refused it: {error}")
    problems = []
    if report.peak_ram_bytes > ram_budget_bytes:
        problems.append(f"peak {report.peak_ram_bytes} bytes is over the RAM budget of {ram_budget_bytes:.0f}")
    if report.runtime_s > runtime_budget_s:
        problems.append(f"runtime {report.runtime_s:.6g} s is over the budget of {runtime_budget_s:.6g} s")
    return BaselineResult(name, "infeasible" if problems else "feasible", report.energy_j, report.peak_ram_bytes,
                          report.runtime_s, "; ".join(problems), plan)


def segment_counts(forward_count: int) -> tuple[list[int], list[int]]:
    """Every number of segments checkpoint_sequential takes, 2..n (1 is plain training), in two lists: the
    usual ones (powers of two and the neighbourhood of √n, Chen et al.'s choice) and the rest."""
    everything = range(2, forward_count + 1)
    root = round(forward_count**0.5)
    usual = [k for k in everything if k & (k - 1) == 0 or abs(k - root) <= 2]
    return usual, [k for k in everything if k not in usual]


_GREEDY_TURN = object()  # where the greedy runs among the baselines


def _plans(priced: PricedGraph, ram_budget_bytes: float, remat: bool, paging: bool) -> Iterator[tuple[str, object]]:
    """(name, plan or BaselineDoesNotFitError) for every baseline the ablations allow, in the order priced:
    the common choices, then the greedy, then checkpoint_sequential's less usual segment counts."""
    graph = priced.graph
    yield KEEP_ALL, keep_all_plan(graph)
    if paging:
        try:
            yield "page what does not fit", paging_plan(graph, ram_budget_bytes)
        except BaselineDoesNotFitError as error:
            yield "page what does not fit", error
    if not remat:
        yield GREEDY, _GREEDY_TURN
        return
    if len(block_boundaries(graph)) > 1:
        yield "checkpoint every block", block_checkpoint_plan(graph)
    yield "checkpoint √n (Chen)", checkpoint_sqrt_n_plan(graph)
    usual, rest = segment_counts(len(forward_order(graph)))
    for segments in usual:
        yield f"checkpoint_sequential({segments})", checkpoint_sequential_plan(graph, segments)
    yield GREEDY, _GREEDY_TURN
    for segments in rest:
        yield f"checkpoint_sequential({segments})", checkpoint_sequential_plan(graph, segments)


def price_baselines(priced: PricedGraph, ram_budget_bytes: float, runtime_budget_s: float, *, remat: bool = True,
                    paging: bool = True, paging_in_runtime: bool = False, greedy: bool = True,
                    cover_start: GreedyStart | None = None, enough_j: float | None = None,
                    pending_cover: Pending[tuple[GreedyStart | None, float | None]] | None = None,
                    deadline: Deadline | None = None, until_one_fits: Deadline | None = None) -> list[BaselineResult]:
    """Every baseline, replayed, until ``deadline`` (the rest are left out of the list); while none fits, until
    ``until_one_fits`` instead when given (the solve's own deadline: a loaded machine that spends the warm start's
    share before any baseline fits still gets a schedule, where it had returned none).

    With ``cover_start`` (host.solver.eviction_bound: the evictions its bound chose), the greedy also
    runs from those evictions instead of keeping everything, and is priced as a baseline of its own; when
    that plan costs at most ``enough_j`` (already proven optimal within the gap), the plain greedy is skipped.
    ``pending_cover`` gives both from a covering problem still being solved on another thread: the greedy's turn
    waits for it, running the plain greedy meanwhile (cut short when the cover arrives, and then run again after the
    cover's greedy, as without one).

    Plans identical to one already priced are skipped (checkpoint_sequential(k) for large k is plain training).
    """
    results: list[BaselineResult] = []
    seen: set[bytes] = set()

    def current() -> Deadline:
        if until_one_fits is None or any(result.feasible for result in results):
            return deadline or Deadline.none()
        return until_one_fits

    for name, plan in _plans(priced, ram_budget_bytes, remat, paging):
        if current().expired():
            break
        if plan is _GREEDY_TURN:
            if greedy:
                plain: list[BaselineResult] = []
                if pending_cover is not None:
                    if not pending_cover.done():
                        plain = price_greedy(priced, ram_budget_bytes, runtime_budget_s, remat, paging,
                                             paging_in_runtime, current().until_set(pending_cover.finished))
                    cover_start, enough_j = pending_cover.result()
                # From the cover first: it is usually the cheaper plan, and the deadline may not leave time for both.
                if cover_start is not None:
                    results += price_greedy(priced, ram_budget_bytes, runtime_budget_s, remat, paging,
                                       paging_in_runtime, current(), cover_start, GREEDY_FROM_COVER)
                    if enough_j is not None and any(r.feasible and r.energy_j <= enough_j for r in results[-1:]):
                        results += plain
                        continue
                if not plain and not current().expired():
                    plain = price_greedy(priced, ram_budget_bytes, runtime_budget_s, remat, paging,
                                         paging_in_runtime, current())
                results += plain
            continue
        if isinstance(plan, BaselineDoesNotFitError):
            results.append(BaselineResult(name, "infeasible", None, None, None, str(plan)))
            continue
        key = plan.recompute.tobytes() + plan.keep_ram.tobytes() + plan.page_out.tobytes()
        if key in seen:
            continue
        seen.add(key)
        results.append(price_plan(name, plan, priced, ram_budget_bytes, runtime_budget_s, paging_in_runtime))
    return results


def price_greedy(priced, ram_budget_bytes, runtime_budget_s, remat, paging, paging_in_runtime, deadline,
                 start: GreedyStart | None = None, name: str = GREEDY) -> list[BaselineResult]:
    """The greedy from ``start`` (keeping everything when None), priced: one row, or none if ``deadline`` passed."""
    found = greedy_policy_search(priced, ram_budget_bytes, runtime_budget_s, paging=paging, remat=remat,
                                 paging_in_runtime=paging_in_runtime, deadline=deadline, start=start)
    if found is not None:
        result = price_plan(name, found[0], priced, ram_budget_bytes, runtime_budget_s, paging_in_runtime)
        result.policies = found[1]
        return [result]
    if deadline.expired():
        return []
    return [BaselineResult(name, "infeasible", None, None, None, f"the {name} found no plan within the budgets")]


def cheapest_feasible(results: list[BaselineResult]) -> list[BaselineResult]:
    return sorted((r for r in results if r.feasible), key=lambda r: r.energy_j)


def timed_replay_s(priced: PricedGraph) -> float:
    """Seconds one lowering and replay of plain training takes: the unit of the solve's reserve for polishing."""
    started = time.perf_counter()
    replay_plan(keep_all_plan(priced.graph), priced)
    return time.perf_counter() - started
