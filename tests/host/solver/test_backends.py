import pulp
import pytest

from host.solver.backends import UnknownSolverError, get_backend, solve_milp
from host.solver.milp import MilpProblem
from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

from .graphs import chain_graph, price_simply


def _knapsack() -> MilpProblem:
    # max 3a + 2b + 4c  s.t. 2a + b + 3c <= 4  (binary)  → a=1, b=0... optimum a + c? 2+3=5>4; a+b=3 (5); b+c=4 (6)
    problem = MilpProblem("knapsack")
    cols = [problem.add_var(cost=-v) for v in (3.0, 2.0, 4.0)]
    problem.add_row(list(zip(cols, (2.0, 1.0, 3.0), strict=True)), ub=4.0)
    return problem


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_backends_prove_the_same_optimum(solver):
    result = solve_milp(_knapsack(), solver, mip_gap=0.0)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(-6.0)
    assert list(result.x.round()) == [0.0, 1.0, 1.0]


def test_infeasible_model_is_reported():
    problem = MilpProblem("infeasible")
    col = problem.add_var()
    problem.add_row([(col, 1.0)], lb=2.0)
    assert solve_milp(problem, "highs").status == "infeasible"


def test_unknown_solver_lists_the_choices():
    with pytest.raises(UnknownSolverError, match="highs, cbc, gurobi"):
        get_backend("glpk")


@pytest.mark.skipif("GUROBI" in pulp.listSolvers(onlyAvailable=True), reason="Gurobi is installed here")
def test_gurobi_without_a_licence_says_what_to_do():
    from host.solver.backends.pulp_backend import SolverUnavailableError

    with pytest.raises(SolverUnavailableError, match="--solver highs"):
        solve_milp(_knapsack(), "gurobi")


def test_cbc_solves_a_schedule_like_highs():
    priced = price_simply(chain_graph(length=6))
    budget = 0.6 * no_remat_peak_bytes(priced)
    results = {
        solver: solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=2.0, solver=solver,
                                                    mip_gap=1e-9))
        for solver in ("highs", "cbc")
    }
    assert {r.status for r in results.values()} == {"optimal"}
    assert results["cbc"].objective_j == pytest.approx(results["highs"].objective_j, rel=1e-9)


@pytest.mark.timeout(60)  # without the kill, the solve hangs: the worker blocks writing a schedule nobody reads
def test_a_progress_display_that_fails_stops_the_worker_instead_of_waiting_for_it():
    """The progress callback runs on the thread that reads the worker's frames. When it raises (a display whose
    stderr has gone), nobody reads the worker any more: it is killed at once, not waited for until its own time
    limit (or forever, blocked writing a schedule to a pipe nobody reads)."""
    import time

    import psutil

    from host.costs import load_profile, price_graph
    from host.run.sources import ModelSource
    from host.solver.backends.highs import solve_highs
    from host.solver.poet_milp import FormulationOptions, PoetFormulation

    priced = price_graph(ModelSource("poet2022:resnet18_cifar").resolve().graph, load_profile("m4"))
    problem = PoetFormulation(priced, FormulationOptions(737719, 1.5 * priced.base_runtime_s)).problem
    calls = []

    def failing_display(report):
        calls.append(report)
        raise BrokenPipeError("stderr is gone")

    started = time.perf_counter()
    result = solve_highs(problem, time_limit_s=60, mip_gap=1e-9, threads=1, progress=failing_display)
    assert calls, "HiGHS never reported progress"
    assert time.perf_counter() - started < 15  # the worker's own limit is 60 s
    assert result.status == "error" and "ended" in result.message, result.message
    assert not [p for p in psutil.Process().children() if "highs_worker" in " ".join(p.cmdline())]
