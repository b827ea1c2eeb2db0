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
    from host.solver.backends.highs import solve_highs, waiting_worker_pids
    from host.solver.poet_milp import FormulationOptions, PoetFormulation

    priced = price_graph(ModelSource("poet2022:resnet18_cifar").resolve().graph, load_profile("m4"))
    problem = PoetFormulation(priced, FormulationOptions(737719, 1.5 * priced.base_runtime_s)).problem
    calls = []

    def failing_display(report):
        calls.append(time.perf_counter())
        raise BrokenPipeError("stderr is gone")

    result = solve_highs(problem, time_limit_s=600, mip_gap=1e-9, threads=1, progress=failing_display)
    assert calls, "HiGHS never reported progress"
    assert time.perf_counter() - calls[0] < 10  # killed at once; the worker's own limit is 600 s
    assert result.status == "error" and "ended" in result.message, result.message
    workers = [p for p in psutil.Process().children() if "highs_worker" in " ".join(p.cmdline())]
    assert sorted(p.pid for p in workers) == sorted(waiting_worker_pids())  # only workers waiting for a solve are left


def test_a_small_solves_worker_waits_for_the_next_solve_and_solves_it():
    """A run of small solves does not start a worker each: the one that solved waits for the next (the threads asked
    for may differ), beside the spare started ahead; no process is started for the later solves."""
    import psutil

    from host.solver.backends.highs import solve_highs, spare_worker_pid, waiting_worker_pids

    assert solve_highs(_knapsack(), mip_gap=0.0).status == "optimal"
    waiting = sorted(waiting_worker_pids())
    assert spare_worker_pid() in waiting and len(waiting) >= 2  # the spare, and at least the worker that solved
    children = sorted(p.pid for p in psutil.Process().children())
    for threads in (1, None, 2):
        result = solve_highs(_knapsack(), mip_gap=0.0, threads=threads)
        assert result.status == "optimal" and result.objective == pytest.approx(-6.0)
    assert sorted(waiting_worker_pids()) == waiting
    assert sorted(p.pid for p in psutil.Process().children()) == children


def _pids_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    gone, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return sorted({*pids} - {p.pid for p in alive})


def test_a_worker_stopped_at_its_limit_or_given_a_large_model_ends_with_its_solve():
    """Only a small solve that HiGHS ended on its own leaves its worker waiting: one stopped at its time limit ends
    (HiGHS may still run a task its cancel does not reach), and so does one that held a large model (its memory is
    given back with the process)."""
    from host.solver.backends.highs import REUSE_MAX_NONZEROS, solve_highs, waiting_worker_pids
    from tests.host.solver.test_background import _market_split

    solve_highs(_knapsack(), mip_gap=0.0)
    before = waiting_worker_pids()
    stopped = solve_highs(_market_split(), time_limit_s=1.0, mip_gap=0.0)
    assert stopped.status in ("feasible", "timeout")
    [gone] = _pids_gone(before, timeout_s=1.0)  # the worker that solved it (already waited for)
    assert gone not in waiting_worker_pids()

    large = MilpProblem("one row of many binaries")
    columns = [large.add_var(cost=-1.0) for _ in range(REUSE_MAX_NONZEROS + 1)]
    large.add_row([(column, 1.0) for column in columns], ub=1.0)
    before = waiting_worker_pids()
    result = solve_highs(large, mip_gap=0.0)
    assert result.status == "optimal" and result.objective == pytest.approx(-1.0)
    [gone] = _pids_gone(before, timeout_s=1.0)
    assert gone not in waiting_worker_pids()


def test_a_cancel_that_crosses_a_small_solves_result_leaves_its_worker_waiting_and_the_solver_answers(monkeypatch):
    """The solver asks the worker to stop (the deadline, Ctrl-C, a proven plan beside it) just as HiGHS ends on its
    own: the worker has sent its result and waits for another request, skipping that cancel. The solver answered,
    kept the worker, and the next solve on it answers; it once waited for that worker to exit, forever (a CI run
    stopped at its limit)."""
    import select
    import threading
    import time

    from host.solver.backends import highs

    highs.solve_highs(_knapsack(), mip_gap=0.0)  # a worker that solved waits: the next solve takes it
    request = {"problem": _knapsack(), "mip_gap": 0.0, "threads": None, "presolve": True, "start": None,
               "time_limit_s": None, "extra_options": {}}
    worker = highs._Worker(request)
    assert select.select([worker.process.stdout], [], [], 30)[0], "the worker sent nothing"
    time.sleep(0.2)  # its result is in the pipe, unread
    read = highs._Worker._read

    def read_late(self, *args):  # the reader is scheduled after the solver's first look at the cancel
        time.sleep(3 * highs._WAIT_PERIOD_S)
        read(self, *args)

    monkeypatch.setattr(highs._Worker, "_read", read_late)
    cancel = threading.Event()
    cancel.set()
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(worker.wait(time.perf_counter(), None, None, cancel)),
                               daemon=True)
    waiting.start()
    waiting.join(timeout=20)
    assert answers, "the solver waited for a worker that waits for its next request"
    [result] = answers
    assert result.status == "optimal" and result.objective == pytest.approx(-6.0) and result.interrupted
    assert worker.process.pid in highs.waiting_worker_pids()
    monkeypatch.undo()
    following = highs.solve_highs(_knapsack(), mip_gap=0.0)
    assert following.status == "optimal" and not following.interrupted


def test_waiting_workers_killed_while_they_waited_are_replaced_and_the_solve_answers():
    import os
    import signal

    from host.solver.backends.highs import solve_highs, waiting_worker_pids

    solve_highs(_knapsack(), mip_gap=0.0)
    killed = waiting_worker_pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    assert _pids_gone(killed) == sorted(killed)
    result = solve_highs(_knapsack(), mip_gap=0.0)
    assert result.status == "optimal" and result.objective == pytest.approx(-6.0)
    assert waiting_worker_pids() and not set(waiting_worker_pids()) & set(killed)


def test_the_spare_worker_ends_with_the_process_that_started_it():
    """No worker outlives its solver: a process that solved once exits at once and leaves no waiting worker behind."""
    import subprocess
    import sys
    import time

    code = ("from host.solver.backends.highs import solve_highs, waiting_worker_pids\n"
            "from tests.host.solver.test_backends import _knapsack\n"
            "assert solve_highs(_knapsack(), mip_gap=0.0).status == 'optimal'\n"
            "print(*waiting_worker_pids(), flush=True)\n")
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    waiting = [int(pid) for pid in out.stdout.split()]
    assert len(waiting) == 2  # the spare, and the worker that solved
    assert _pids_gone(waiting) == sorted(waiting), "a waiting worker outlived the process that started it"
    assert time.perf_counter() - started < 30
