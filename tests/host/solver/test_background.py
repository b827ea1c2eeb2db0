"""Phases of a solve on a thread of their own: the covering problems' HiGHS workers on one core, the baselines and the
ejection moves on the other; stopped from the solve's thread (Ctrl-C lands there only), and never left running."""

import os
import random
import signal
import threading
import time

import pytest

from host.solver import baseline_pricing, solve
from host.solver.backends.highs import solve_highs
from host.solver.background import Background
from host.solver.baseline_pricing import GREEDY, GREEDY_FROM_COVER
from host.solver.deadline import Deadline
from host.solver.milp import MilpProblem
from host.solver.solve import SolveOptions, minimum_ram_bytes, solve_schedule

from .graphs import price_simply, residual_graph
from .solve_phases import first_cover_left_open

WAIT_S = 60.0  # how long a phase waits for the one that should run beside it (a sequential solve never gets there)


def _market_split(seed: int = 1, rows: int = 5, cols: int = 40) -> MilpProblem:
    """Cornuéjols and Dawande's market split: a few equality rows on 40 binaries that HiGHS does not settle in a
    minute (it finds no solution in 20 s)."""
    rng = random.Random(seed)
    problem = MilpProblem("market split")
    x = [problem.add_var(cost=rng.random()) for _ in range(cols)]
    for _ in range(rows):
        weights = [rng.randint(0, 99) for _ in range(cols)]
        problem.add_row(list(zip(x, map(float, weights), strict=True)), lb=sum(weights) // 2, ub=sum(weights) // 2)
    return problem


def _block_at_its_floor():
    """One residual block at its hard floor: the first covering problem closes without proving the greedy, so the
    second one runs (tests/host/solver/test_eviction_bound.py)."""
    priced = price_simply(residual_graph(1, [400, 400, 400, 400, 100, 200, 400]), page_j_per_byte=1e-4)
    return priced, minimum_ram_bytes(priced)


def _second_cover_runs_until_stopped(monkeypatch, entered: threading.Event | None = None) -> list[bool]:
    """The second covering problem replaced by one that runs until told to stop (up to WAIT_S), then ends as
    eviction_cover does when its HiGHS solve is cancelled; the list gets whether it was told (``entered`` is set as it
    starts)."""
    stopped: list[bool] = []
    real_cover = solve.eviction_cover

    def second_cover_runs_until_stopped(*args, second_restorations=False, cancel=None, **kwargs):
        if not second_restorations:
            return real_cover(*args, cancel=cancel, **kwargs)
        if entered is not None:
            entered.set()
        stopped.append(cancel.wait(WAIT_S))
        raise KeyboardInterrupt

    monkeypatch.setattr(solve, "eviction_cover", second_cover_runs_until_stopped)
    return stopped


def _milp_waits(monkeypatch, for_event: threading.Event | None = None,
                entered: threading.Event | None = None) -> list[bool]:
    """The MILP's backend call waits (up to WAIT_S) for ``for_event``, or for its cancel when none is given, then
    solves; the list gets whether it came (``entered`` is set as the call starts)."""
    came: list[bool] = []
    real_milp = solve.solve_milp

    def waiting_milp(*args, cancel=None, **kwargs):
        if entered is not None:
            entered.set()
        came.append((for_event or cancel).wait(WAIT_S))
        return real_milp(*args, cancel=cancel, **kwargs)

    monkeypatch.setattr(solve, "solve_milp", waiting_milp)
    return came


def test_a_deadline_with_an_event_passes_when_the_event_is_set():
    event = threading.Event()
    deadline = Deadline(None, until=event)
    assert not deadline.expired() and deadline.remaining_s() == float("inf")
    event.set()
    assert deadline.expired() and deadline.remaining_s() == 0.0
    timed = Deadline(60.0).until_set(threading.Event())
    assert not timed.expired() and 59 < timed.remaining_s() <= 60
    with pytest.raises(ValueError, match="event of its own"):
        deadline.until_set(threading.Event())


def test_a_background_task_answers_raises_its_error_and_stops_when_told():
    assert Background(lambda cancel: 42, "answer").result() == 42
    with pytest.raises(ZeroDivisionError):
        Background(lambda cancel: 1 / 0, "error").result()
    saw_cancel = []
    task = Background(lambda cancel: saw_cancel.append(cancel.wait(WAIT_S)), "waits")
    started = time.perf_counter()
    task.stop()
    assert task.done() and saw_cancel == [True] and time.perf_counter() - started < 5


def test_a_ctrl_c_while_waiting_for_a_background_task_stops_it_and_is_raised():
    saw_cancel = []
    task = Background(lambda cancel: saw_cancel.append(cancel.wait(WAIT_S)), "waits")
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    started = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        task.result()
    assert task.done() and saw_cancel == [True] and time.perf_counter() - started < 5


def test_a_highs_solve_on_another_thread_is_stopped_by_its_cancel_event():
    """HiGHS on a problem it does not settle within a minute, waited for on a thread Ctrl-C does not reach: setting
    the event stops the worker within its grace, and the result is marked interrupted."""
    cancel = threading.Event()
    task = Background(lambda _: solve_highs(_market_split(), time_limit_s=WAIT_S, mip_gap=0.0, cancel=cancel),
                      "market split")
    time.sleep(2.0)
    assert not task.done()
    started = time.perf_counter()
    cancel.set()
    result = task.result()
    assert result.interrupted and time.perf_counter() - started < 5
    cancel_first = threading.Event()
    cancel_first.set()
    early = solve_highs(_market_split(), time_limit_s=WAIT_S, cancel=cancel_first)
    assert early.interrupted and early.message == "interrupted before the solver started"


def test_the_plain_greedy_is_priced_while_the_first_covering_problem_is_solved(monkeypatch):
    """The first covering problem waits (up to a minute) for the plain greedy to be priced: on one thread it would wait
    the whole minute, beside it the greedy runs at once; the greedy from its evictions follows it."""
    plain_greedy_ran = threading.Event()
    cover_saw_it = []
    real_cover, real_greedy = solve.eviction_cover, baseline_pricing.greedy_policy_search

    def first_cover_waits_for_the_greedy(*args, second_restorations=False, **kwargs):
        if not second_restorations:
            cover_saw_it.append(plain_greedy_ran.wait(WAIT_S))
        return real_cover(*args, second_restorations=second_restorations, **kwargs)

    def greedy(*args, start=None, **kwargs):
        found = real_greedy(*args, start=start, **kwargs)
        if start is None:
            plain_greedy_ran.set()
        return found

    monkeypatch.setattr(solve, "eviction_cover", first_cover_waits_for_the_greedy)
    monkeypatch.setattr(baseline_pricing, "greedy_policy_search", greedy)
    priced, budget = _block_at_its_floor()
    started = time.perf_counter()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, time_limit_s=120))
    assert cover_saw_it == [True] and time.perf_counter() - started < WAIT_S
    names = [row.name for row in result.baselines]
    assert GREEDY in names and GREEDY_FROM_COVER in names
    assert result.status == "optimal" and result.objective_j == pytest.approx(0.88173, rel=1e-6)


def test_ejection_moves_run_while_the_second_covering_problem_is_solved_and_stop_when_it_answers(monkeypatch):
    """The second covering problem waits for the ejection search to start: beside it, the search starts at once; it is
    then told to stop as soon as the second problem has answered (its deadline passes on that event)."""
    search_started = threading.Event()
    stronger_saw_it, search_deadlines = [], []
    real_cover, real_search = solve.eviction_cover, solve.ejection_search

    def second_cover_waits_for_the_search(*args, second_restorations=False, **kwargs):
        if second_restorations:
            stronger_saw_it.append(search_started.wait(WAIT_S))
        return real_cover(*args, second_restorations=second_restorations, **kwargs)

    def search(*args, deadline, **kwargs):
        search_started.set()
        search_deadlines.append(deadline)
        yield from real_search(*args, deadline=deadline, **kwargs)

    monkeypatch.setattr(solve, "eviction_cover", second_cover_waits_for_the_search)
    monkeypatch.setattr(solve, "ejection_search", search)
    priced, budget = _block_at_its_floor()
    phases = []
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-9,
                                                 time_limit_s=120),
                            progress=lambda report: phases.append(report.phase))
    assert stronger_saw_it == [True]
    assert phases.index("stronger lower bound") < phases.index("ejection search")
    beside = search_deadlines[0]
    assert beside.until is not None and beside.until.is_set() and beside.expired()
    assert result.status == "optimal" and result.objective_j == pytest.approx(0.88173, rel=1e-6)


def _milp_runs_until_stopped(monkeypatch, entered: threading.Event | None = None) -> list[bool]:
    """No second covering problem, and the MILP beside the ejection moves waits until told to stop."""
    first_cover_left_open(monkeypatch)
    return _milp_waits(monkeypatch, entered=entered)


@pytest.mark.parametrize("runs_beside", [_second_cover_runs_until_stopped, _milp_runs_until_stopped],
                         ids=["second covering problem", "MILP"])
def test_a_ctrl_c_while_a_phase_runs_beside_stops_it_and_keeps_the_best_schedule(monkeypatch, runs_beside):
    """A Ctrl-C lands on the solve's thread while the second covering problem, or the MILP, runs on another (here it
    runs until told to stop): that phase is stopped, the solve waits for it, and the best schedule found so far is
    the answer, marked interrupted."""
    stopped = runs_beside(monkeypatch)
    priced, budget = _block_at_its_floor()
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    started = time.perf_counter()
    timer.start()
    try:
        result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-9,
                                                     time_limit_s=120))
    finally:
        timer.cancel()
    assert stopped == [True] and time.perf_counter() - started < 10
    assert result.interrupted and result.status == "feasible" and result.schedule is not None
    assert result.report.peak_ram_bytes <= budget
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("poet-")]


@pytest.mark.parametrize("runs_beside", [_second_cover_runs_until_stopped, _milp_runs_until_stopped],
                         ids=["second covering problem", "MILP"])
def test_a_plan_proven_by_the_bound_while_a_phase_runs_beside_stops_that_phase(monkeypatch, runs_beside):
    """Where the ejection moves beside the second covering problem, or beside the MILP, reach a plan within the gap
    of the bound proven so far (here every plan is, by the threshold given), that phase is stopped rather than waited
    for, and the plan is the answer (past the second problem, the same threshold stops the MILP too)."""
    import math

    # The moves wait until that phase runs: their first plan can otherwise come before the MILP's model is built,
    # which stops it before its solve (a race the test lost one time in three).
    entered = threading.Event()
    stopped = runs_beside(monkeypatch, entered)
    real_search = solve.ejection_search

    def search_once_the_phase_runs(*args, **kwargs):
        assert entered.wait(WAIT_S), "the phase beside never started"
        yield from real_search(*args, **kwargs)

    monkeypatch.setattr(solve, "ejection_search", search_once_the_phase_runs)
    monkeypatch.setattr(solve, "_proven_optimal_below_j", lambda options, bound_j: math.inf)
    priced, budget = _block_at_its_floor()
    started = time.perf_counter()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-9,
                                                 time_limit_s=120))
    assert stopped == [True] and time.perf_counter() - started < WAIT_S
    assert not result.interrupted and result.status == "optimal" and result.schedule.solve.solver == "baseline"
    assert result.objective_j == pytest.approx(0.88173, rel=1e-6)  # the block's cheapest plan is its optimum
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("poet-")]


def test_ejection_moves_run_while_the_milp_is_solved_and_stop_when_it_answers(monkeypatch):
    """The MILP waits for the ejection search to start: beside it, the search starts at once, and is told to stop as
    soon as the MILP has answered; the MILP's proof is the answer's."""
    first_cover_left_open(monkeypatch)
    search_started = threading.Event()
    milp_saw_it = _milp_waits(monkeypatch, search_started)
    search_deadlines = []
    real_search = solve.ejection_search

    def search(*args, deadline, **kwargs):
        search_started.set()
        search_deadlines.append(deadline)
        yield from real_search(*args, deadline=deadline, **kwargs)

    monkeypatch.setattr(solve, "ejection_search", search)
    priced, budget = _block_at_its_floor()
    phases = []
    started = time.perf_counter()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-9,
                                                 time_limit_s=120),
                            progress=lambda report: phases.append(report.phase))
    assert milp_saw_it == [True] and time.perf_counter() - started < WAIT_S
    assert "ejection search" not in phases and "solving" in phases  # the display shows the MILP's figures
    [beside] = search_deadlines
    assert beside.until is not None and beside.until.is_set() and beside.expired()
    assert result.status == "optimal" and result.objective_j == pytest.approx(0.88173, rel=1e-6)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("poet-")]


def test_the_milps_reports_are_timed_on_the_solves_clock():
    """The MILP's worker times its reports from the MILP's own start; the solve passes them on timed from its own, as
    its phases are, so the progress display's clock never jumps back when the MILP starts reporting."""
    priced, budget = _block_at_its_floor()
    reports = []
    solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, mip_gap=1e-9, time_limit_s=120),
                   progress=lambda report: reports.append((report.phase, report.elapsed_s)))
    assert sum(phase == "solving" for phase, _ in reports) >= 2, reports  # the phase, and the MILP's own reports
    times = [elapsed for _, elapsed in reports]
    assert times == sorted(times), reports
