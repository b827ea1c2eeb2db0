import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from host.solver.baselines import BaselineDoesNotFitError, checkpoint_sqrt_n_plan, keep_all_plan, paging_plan
from host.solver.solve import (
    BudgetError,
    SolveOptions,
    evaluate_plan,
    minimum_ram_bytes,
    no_remat_peak_bytes,
    solve_schedule,
)
from host.solver.validator import validate_schedule

from .graphs import chain_graph, price_simply, random_training_graph

EXACT = 1e-9  # tiny graphs: ask for proven optimality, not 0.1%
TOL = 1e-7


def _solve(priced, budget, **kw):
    kw.setdefault("mip_gap", EXACT)
    kw.setdefault("runtime_factor", 2.0)
    return solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, **kw))


def test_non_binding_budget_is_answered_at_once_and_proven_optimal():
    priced = price_simply(chain_graph(length=12))
    result = _solve(priced, 10 * no_remat_peak_bytes(priced))
    assert result.status == "optimal" and result.gap == 0.0
    assert result.objective_j == pytest.approx(priced.base_compute_j)
    assert result.schedule.solve.formulation == "keep-all"
    assert result.solve_s < 1.0


def test_budget_below_the_floor_states_the_minimum():
    priced = price_simply(chain_graph())
    floor = minimum_ram_bytes(priced)
    result = _solve(priced, floor - 1)
    assert result.status == "infeasible" and result.schedule is None
    assert str(floor) in result.message and "raise --ram-budget" in result.message


def test_runtime_factor_below_one_is_rejected():
    priced = price_simply(chain_graph())
    with pytest.raises(BudgetError, match="below 1.0"):
        _solve(priced, 1e9, runtime_factor=0.9)


def test_binding_budget_recomputes_or_pages_within_budget():
    priced = price_simply(chain_graph(length=8))
    budget = 0.6 * no_remat_peak_bytes(priced)
    result = _solve(priced, budget)
    assert result.status == "optimal"
    report = validate_schedule(result.schedule, priced)
    assert report.peak_ram_bytes <= budget
    assert report.recomputes + report.page_ins > 0
    assert report.energy_j > priced.base_compute_j


def test_remat_only_without_paging_has_no_paging_instructions():
    priced = price_simply(chain_graph(length=8), page_j_per_byte=1e-9)
    budget = 0.6 * no_remat_peak_bytes(priced)
    result = _solve(priced, budget, paging=False)
    assert result.status == "optimal"
    assert result.report.page_ins == result.report.page_outs == 0 and result.report.recomputes > 0


def test_paging_only_never_recomputes():
    priced = price_simply(chain_graph(length=8), page_j_per_byte=1e-3)
    result = _solve(priced, 0.6 * no_remat_peak_bytes(priced), remat=False)
    assert result.status == "optimal"
    assert result.report.recomputes == 0 and result.report.page_outs > 0


@pytest.mark.parametrize("share", [0.55, 0.7, 0.85])
def test_poet2022_formulation_is_never_better_than_ours(share):
    priced = price_simply(random_training_graph(3, 6))
    budget = share * no_remat_peak_bytes(priced)
    ours = _solve(priced, budget)
    paper = _solve(priced, budget, formulation="poet2022", warm_start=False)
    if paper.status == "optimal":
        assert ours.status == "optimal"
        # ours admits a superset of the paper's schedules: never worse
        assert ours.objective_j <= paper.objective_j * (1 + TOL)
        validate_schedule(paper.schedule, priced)  # the paper's solutions lower to valid schedules too
    else:
        assert paper.status == "infeasible"


def test_baselines_validate():
    graph = random_training_graph(7, 10)
    priced = price_simply(graph)
    peak = evaluate_plan(keep_all_plan(graph), priced).peak_ram_bytes
    assert evaluate_plan(checkpoint_sqrt_n_plan(graph), priced).recomputes > 0
    budget = max(minimum_ram_bytes(priced), 0.6 * peak)
    report = evaluate_plan(paging_plan(graph, budget), priced, ram_budget_bytes=budget)
    assert report.peak_ram_bytes <= budget
    with pytest.raises(BaselineDoesNotFitError):
        paging_plan(graph, minimum_ram_bytes(priced) - 1)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), size=st.integers(3, 7), share=st.floats(0.35, 0.95))
def test_random_dags_validate_and_respect_bounds(seed, size, share):
    _random_dag_case(seed, size, share)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), size=st.integers(3, 7), share=st.floats(0.35, 0.95))
def test_random_dags_validate_and_respect_bounds_many_graphs(seed, size, share):
    _random_dag_case(seed, size, share)


def _random_dag_case(seed: int, size: int, share: float) -> None:
    """Every emitted schedule replays within its budget, never above a fitting baseline or below compute-once;
    more RAM never costs more, and an ablation never beats the joint solve."""
    priced = price_simply(random_training_graph(seed, size))
    peak = no_remat_peak_bytes(priced)
    budget = max(minimum_ram_bytes(priced), share * peak)
    low = _solve(priced, budget)
    if low.status != "optimal":
        assert low.status == "infeasible"
        return
    report = validate_schedule(low.schedule, priced)  # every emitted schedule replays cleanly
    assert report.peak_ram_bytes <= budget
    fitting = [b.energy_j for b in low.baselines if b.feasible]
    assert low.objective_j <= min(fitting, default=float("inf"))  # never above a baseline that fits
    assert low.objective_j >= priced.base_compute_j * (1 - TOL)  # never below compute-once
    high = _solve(priced, budget + 0.25 * peak)
    assert high.objective_j <= low.objective_j * (1 + TOL)  # more RAM never costs more energy
    for ablation in ({"paging": False}, {"remat": False}):
        restricted = _solve(priced, budget, **ablation)
        if restricted.status == "optimal":
            assert low.objective_j <= restricted.objective_j * (1 + TOL)  # ablations never beat the joint solve
