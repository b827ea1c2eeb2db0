"""The baselines a user would pick instead of POET: priced by the validator's replay, and never beaten by the answer."""

import math

import pytest

from host.solver import backends
from host.solver.backends import highs as highs_backend
from host.solver.baseline_pricing import (
    EJECTION_SEARCH,
    GREEDY,
    GREEDY_FROM_COVER,
    KEEP_ALL,
    cheapest_feasible,
    price_baselines,
    replay_plan,
)
from host.solver.baselines import block_boundaries, checkpoint_sequential_plan, keep_all_plan
from host.solver.deadline import DEFAULT_TIME_LIMIT_S
from host.solver.eviction_bound import EVICTION_BOUND_TIME_LIMIT_S
from host.solver.solve import SolveOptions, minimum_ram_bytes, no_remat_peak_bytes, solve_schedule
from host.solver.validator import validate_schedule

from .graphs import chain_graph, price_simply, random_training_graph, training_graph_from_forward
from .solve_phases import first_cover_left_open


def test_checkpoint_sequential_follows_torch():
    """10 functions (9 forward nodes and the loss): 2 segments of 5; the first keeps only its input and
    recomputes its 3 inner activations for the backward; the last segment keeps its activations."""
    graph = chain_graph(length=9)
    priced = price_simply(graph)
    assert (checkpoint_sequential_plan(graph, 1).recompute == keep_all_plan(graph).recompute).all()
    assert replay_plan(checkpoint_sequential_plan(graph, 1), priced).recomputes == 0
    assert replay_plan(checkpoint_sequential_plan(graph, 2), priced).recomputes == 3
    assert replay_plan(checkpoint_sequential_plan(graph, 10), priced).recomputes == 0  # one function a segment
    peaks = [replay_plan(checkpoint_sequential_plan(graph, k), priced).peak_ram_bytes for k in (1, 2, 3)]
    assert peaks[1] < peaks[0] and peaks[2] < peaks[0]


def test_block_boundaries_are_the_single_tensors_between_residual_blocks():
    # 0 -> 1 -> {2, 3}, 2 -> 3 (a skip over node 2), 3 -> 4 -> {5, 6}, 5 -> 6 (a skip over node 5)
    deps = [[], [0], [1], [1, 2], [3], [4], [4, 5]]
    graph = training_graph_from_forward("residual", deps, [100] * 7, [0] + [1000] * 6)
    assert block_boundaries(graph) == [0, 1, 3, 4, 6]


def test_every_baseline_is_priced_by_the_validators_replay():
    graph = chain_graph(length=12)
    priced = price_simply(graph, page_j_per_byte=1e-3)
    budget = 0.6 * no_remat_peak_bytes(priced)
    runtime_budget_s = 1.5 * priced.base_runtime_s
    results = price_baselines(priced, budget, runtime_budget_s)
    names = [r.name for r in results]
    assert len(names) == len(set(names))
    assert {KEEP_ALL, "page what does not fit", "checkpoint √n (Chen)", "checkpoint_sequential(2)", "greedy"} <= set(names)
    # every number of segments is priced unless its plan is one already listed (k > n/2 is plain training)
    assert {f"checkpoint_sequential({k})" for k in range(2, 7)} <= set(names)
    for result in results:
        report = replay_plan(result.plan, priced)
        assert result.energy_j == pytest.approx(report.energy_j, rel=1e-12)
        assert result.peak_ram_bytes == report.peak_ram_bytes
        fits = report.peak_ram_bytes <= budget and report.runtime_s <= runtime_budget_s
        assert result.status == ("feasible" if fits else "infeasible"), result.name
    keep_all = results[names.index(KEEP_ALL)]
    assert keep_all.status == "infeasible" and "over the RAM budget" in keep_all.message
    assert cheapest_feasible(results)


def test_ablations_limit_the_baselines():
    priced = price_simply(chain_graph(length=8))
    budget = 0.6 * no_remat_peak_bytes(priced)
    remat_only = {r.name for r in price_baselines(priced, budget, 2 * priced.base_runtime_s, paging=False)}
    assert "page what does not fit" not in remat_only and "checkpoint_sequential(2)" in remat_only
    paging_only = {r.name for r in price_baselines(priced, budget, 2 * priced.base_runtime_s, remat=False)}
    assert not any(name.startswith("checkpoint") for name in paging_only)


@pytest.fixture
def first_incumbent_backend(monkeypatch):
    """HiGHS stopped at the first schedule it finds itself (no start): a real solve stopped early."""
    found = []

    def first(problem, *, start=None, **kwargs):
        monkeypatch.setitem(highs_backend._EXTRA_OPTIONS, "mip_max_improving_sols", 1)
        result = backends.BACKENDS["highs"](problem, start=None, **kwargs)
        monkeypatch.delitem(highs_backend._EXTRA_OPTIONS, "mip_max_improving_sols")
        found.append(result.objective)
        return result

    monkeypatch.setitem(backends.BACKENDS, "first-incumbent", first)
    return found


def test_a_milp_stopped_early_never_answers_above_the_best_baseline(first_incumbent_backend):
    priced = price_simply(random_training_graph(4, 10), page_j_per_byte=1e-3)
    budget = max(minimum_ram_bytes(priced), 0.5 * no_remat_peak_bytes(priced))
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, solver="first-incumbent",
                                                 shortcut_non_binding=False, time_limit_s=30))
    best = cheapest_feasible(result.baselines)[0]
    assert first_incumbent_backend and first_incumbent_backend[0] > best.energy_j * 1.5  # the MILP's was far worse
    assert result.objective_j == pytest.approx(best.energy_j, rel=1e-12)
    assert result.schedule.solve.formulation == best.name and best.name in result.message
    replayed = validate_schedule(result.schedule, priced)
    assert replayed.energy_j == pytest.approx(result.objective_j, rel=1e-12) and replayed.peak_ram_bytes <= budget
    assert result.gap is not None and result.gap >= 0


def test_the_paper_formulation_runs_without_baselines():
    priced = price_simply(chain_graph(length=6))
    budget = 0.7 * no_remat_peak_bytes(priced)
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=2.0, formulation="poet2022",
                                                 warm_start=False, shortcut_non_binding=False))
    assert result.baselines == [] and result.schedule.solve.formulation == "poet2022"


@pytest.mark.slow  # ~19 s
def test_without_a_time_limit_the_ejection_moves_get_a_quarter_of_the_default_one(monkeypatch):
    """Random graph 5 of 16 nodes at 40% with no time limit, where no greedy is proven: the ejection search is still
    bounded (its last round runs the local search after every move, minutes a pass on large graphs): beside the second
    covering problem by that problem's time (1.5 times the first's 20 s), alone by a quarter of the default 300 s,
    beside the MILP by the MILP's time.
    Stopped there (Ctrl-C), the solve answers with the best baseline, marked interrupted."""
    from host.solver import solve

    limits_s: list[float | None] = []

    def stopped_at_once(*args, deadline, **kwargs):
        limits_s.append(deadline.limit_s)
        raise KeyboardInterrupt
        yield  # a generator, as ejection_search is

    monkeypatch.setattr(solve, "ejection_search", stopped_at_once)
    priced = price_simply(random_training_graph(5, 16))
    budget = max(minimum_ram_bytes(priced) * 1.05, 0.4 * no_remat_peak_bytes(priced))
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=10, mip_gap=1e-6,
                                                 time_limit_s=None))
    assert len(limits_s) == 1 and limits_s[0] is not None and 0 < limits_s[0] <= 1.5 * EVICTION_BOUND_TIME_LIMIT_S
    assert result.interrupted and result.schedule is not None
    # alone (no other covering problem: the first one, as if cut short, did not close, and no time is left to solve it
    # again; a PuLP backend, which only the
    # solve's own thread can stop, so the moves run before its MILP), a quarter of the default limit
    first_cover_left_open(monkeypatch)
    limits_s.clear()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=10, mip_gap=1e-6,
                                                 time_limit_s=None, solver="cbc"))
    assert limits_s == [pytest.approx(0.25 * DEFAULT_TIME_LIMIT_S)]
    assert result.interrupted and result.schedule is not None
    # beside the MILP (HiGHS, which another thread can stop), until the MILP answers: no limit of its own
    limits_s.clear()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=10, mip_gap=1e-6,
                                                 time_limit_s=None))
    assert limits_s == [math.inf]
    assert result.interrupted and result.schedule is not None


def test_a_greedy_not_proven_optimal_is_improved_by_ejection_moves_and_offered():
    """Random graph 25 of 40 nodes at 40%, at a gap no greedy meets: the solve runs ejection moves from the cheapest
    greedy (beside the second covering problem, which runs until 75% of the limit here), lists the cheaper plan as a
    baseline of its own, and answers with no more than it. A greedy from the second problem's covers may then be
    cheaper still, and the moves from it run beside the MILP, which can answer before they find anything: the row is
    compared with the greedies it started from."""
    priced = price_simply(random_training_graph(25, 40))
    budget = max(minimum_ram_bytes(priced) * 1.05, 0.4 * no_remat_peak_bytes(priced))
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=10, mip_gap=1e-6,
                                                 time_limit_s=20))
    rows = {r.name: r for r in result.baselines}
    ejected = rows[EJECTION_SEARCH]
    assert ejected.feasible and ejected.peak_ram_bytes <= budget
    greedy_j = min(r.energy_j for name, r in rows.items() if name in (GREEDY, GREEDY_FROM_COVER) and r.feasible)
    assert ejected.energy_j < greedy_j
    assert result.objective_j <= ejected.energy_j + 1e-12
    assert ejected.energy_j == pytest.approx(replay_plan(ejected.plan, priced).energy_j)
