"""The MILP's neighbourhoods: each move is a cheaper schedule of the whole model, and none beats its optimum."""

import numpy as np
import pytest

from host.solver import neighbourhoods
from host.solver.baselines import paging_plan
from host.solver.deadline import Deadline
from host.solver.neighbourhoods import column_tensors, neighbourhood_search, windows_costliest_first
from host.solver.poet_milp import FormulationOptions, PoetFormulation
from host.solver.solve import SolveOptions, evaluate_plan, no_remat_peak_bytes, solve_schedule

from .graphs import price_simply, residual_graph


def _residual_case(share: float = 0.4):
    """Three residual blocks (36 nodes: windows of 12 tensors leave most of the model fixed) at ``share`` of their
    peak, and the model, started from paging what does not fit (feasible, and far from the optimum)."""
    priced = price_simply(residual_graph(3, [400, 400, 400] + [400, 400, 400, 400] * 3), page_j_per_byte=1e-4)
    budget = share * no_remat_peak_bytes(priced)
    runtime_s = 1.5 * priced.base_runtime_s
    formulation = PoetFormulation(priced, FormulationOptions(ram_budget_bytes=budget, runtime_budget_s=runtime_s))
    start = formulation.start_from_plan(paging_plan(priced.graph, budget))
    assert start is not None, "the model does not admit the paging plan"
    return priced, budget, runtime_s, formulation, start


def test_every_decision_column_belongs_to_a_tensor_and_the_ram_columns_to_none():
    """A window fixes the columns of the tensors outside it: a decision column with no tensor would stay free in every
    window, one given the wrong tensor would be fixed where it should move."""
    _, _, _, formulation, _ = _residual_case()
    tensor_of = column_tensors(formulation)
    integer = np.asarray(formulation.problem.col_integer)
    assert (tensor_of[integer] >= 0).all()
    assert set(tensor_of[~integer]) == {-1}
    for (_, tensor), col in formulation.vars.keep_ram.items():
        assert tensor_of[col] == tensor


def test_windows_cover_every_tensor_and_the_costliest_comes_first():
    priced, _, _, formulation, start = _residual_case()
    windows = windows_costliest_first(formulation, start)
    assert set().union(*map(set, windows)) == set(range(priced.graph.size))
    assert all(len(window) <= neighbourhoods.WINDOW_TENSORS for window in windows)
    plan = formulation.plan_from_solution(start)
    paged_j = plan.page_in.sum(axis=0) * priced.page_in_j + plan.page_out.sum(axis=0) * priced.page_out_j
    costliest = int(np.argmax(paged_j))
    assert paged_j[costliest] > 0 and costliest in windows[0]


@pytest.mark.slow  # ~50 s: the windows' passes, then the MILP's bound
def test_each_move_is_a_cheaper_valid_schedule_of_the_whole_model_and_none_beats_the_optimum():
    """From paging what does not fit: every vector yielded satisfies the whole model, costs less than the one before,
    replays (the validator) to its objective, and the last is at or above the MILP's proven bound."""
    priced, budget, runtime_s, formulation, start = _residual_case()
    problem = formulation.problem
    energies = [problem.objective(start)]
    for x in neighbourhood_search(formulation, start, Deadline(30)):
        assert problem.max_violation(x) <= 1e-6 * budget
        report = evaluate_plan(formulation.plan_from_solution(x), priced, ram_budget_bytes=budget,
                               runtime_budget_s=runtime_s)
        assert report.energy_j == pytest.approx(problem.objective(x), rel=1e-6)
        energies.append(problem.objective(x))
    assert len(energies) > 1, "no window improved on paging what does not fit"
    assert all(later < earlier for earlier, later in zip(energies, energies[1:], strict=False))
    milp = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.5, mip_gap=1e-9,
                                               warm_start=False, shortcut_non_binding=False, time_limit_s=20))
    assert milp.bound_j > float(priced.compute_j.sum())
    assert energies[-1] >= milp.bound_j * (1 - 1e-6)
    assert energies[-1] < energies[0] * 0.97  # 1.68343 -> 1.60373 J


def test_a_passed_deadline_takes_no_move():
    _, _, _, formulation, start = _residual_case()
    assert list(neighbourhood_search(formulation, start, Deadline(0.0))) == []


def test_a_windows_own_problem_is_the_whole_model_with_the_rest_fixed():
    """A window's problem holds only its free columns: at the start's values it costs what the whole model does and
    satisfies its rows, and its answer put back into the start satisfies the whole model at the cost HiGHS gave it.
    Dropping a row whose fixed part the start does not meet, or moving a fixed column's activity into the wrong
    bound, fails."""
    from host.solver.backends.highs import solve_highs

    _, budget, _, formulation, start = _residual_case()
    problem = formulation.problem
    whole = neighbourhoods._ModelArrays(problem)
    tensor_of = column_tensors(formulation)
    energies = []
    for window in windows_costliest_first(formulation, start)[:2]:
        free = (tensor_of >= window.start) & (tensor_of < window.stop)
        fixed = whole.fixed_outside(free)
        assert not fixed[free].any() and fixed[(tensor_of >= 0) & ~free].all()
        sub, free_cols = whole.restricted(fixed, start)
        assert 0 < sub.num_cols < problem.num_cols and sub.num_rows < problem.num_rows
        assert sub.objective(start[free_cols]) == pytest.approx(problem.objective(start), rel=1e-12)
        assert sub.max_violation(start[free_cols]) <= 1e-9 * budget
        answer = solve_highs(sub, time_limit_s=5, mip_gap=1e-6, threads=1, start=start[free_cols])
        assert answer.x is not None
        x = start.copy()
        x[free_cols] = answer.x
        assert problem.max_violation(x) <= 1e-6 * budget
        assert problem.objective(x) == pytest.approx(answer.objective, rel=1e-9)
        energies.append(problem.objective(x))
    assert min(energies) < problem.objective(start) * 0.99  # some window holds a move from paging what does not fit
