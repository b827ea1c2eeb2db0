"""HiGHS through highspy: the default backend (in-process, warm start, live progress)."""

from __future__ import annotations

import time

import highspy
import numpy as np

from host.fdio import stdout_to_stderr
from host.solver.milp import MilpProblem, MilpResult, ProgressCallback, SolverProgress

_PROGRESS_PERIOD_S = 0.5
# Tuned on the POET benchmarks (bench/solver.py): primal heuristics pay off on these models,
# whose objective is dominated by a constant (compute-once energy).
_EXTRA_OPTIONS: dict[str, object] = {}


_WAIT_PERIOD_S = 0.1  # how often the waiting thread wakes up to notice Ctrl-C or the deadline

# HiGHS neither checks its time limit nor a cancel during symmetry detection and presolve: on a model
# of 2.7M nonzeros (MobileNetV2, 410 nodes) they took about 3 s and 5 s on a loaded 2-core machine,
# whatever the limit. Each is skipped when this estimate of its cost exceeds a quarter of the time left.
_SETUP_S_PER_NONZERO = 2e-6
_SETUP_SHARE_OF_TIME_LEFT = 0.25


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) and abs(value) < 1e29 else None


def _new_highs() -> highspy.Highs:
    with stdout_to_stderr():  # HiGHS prints its banner on the process's stdout
        return highspy.Highs()


def _run(highs: highspy.Highs, deadline_at: float | None = None) -> bool:
    """Run the solver in its own thread; Ctrl-C asks HiGHS to stop and keep its incumbent.

    At ``deadline_at`` (time.perf_counter()) the solve is cancelled the same way, in case HiGHS has
    not stopped at its own time limit. Returns True when the run was interrupted by the user. A Ctrl-C
    can land anywhere here, even inside ``startSolve`` after the solver thread began, so the wait is on
    the solver's own state, never on a thread handle this function may not have received.
    """
    highs.HandleUserInterrupt = True
    interrupted = cancelled = False
    try:
        highs.startSolve()
    except KeyboardInterrupt:
        interrupted = True
        highs.cancelSolve()
    while True:
        try:
            done, _status = highs.wait(_WAIT_PERIOD_S)
            if done:
                break
            if deadline_at is not None and not cancelled and time.perf_counter() >= deadline_at:
                cancelled = True
                highs.cancelSolve()
        except KeyboardInterrupt:
            interrupted = True
            highs.cancelSolve()
    if interrupted or cancelled:
        # Workers of a cancelled MIP can outlive the run; without this, the process aborts at exit
        # ("terminate called without an active exception").
        highspy.Highs.resetGlobalScheduler(True)
    return interrupted


def solve_highs(
    problem: MilpProblem,
    *,
    time_limit_s: float | None = None,
    mip_gap: float = 1e-3,
    threads: int | None = None,
    start: np.ndarray | None = None,
    progress: ProgressCallback | None = None,
    presolve: bool = True,
    deadline_at: float | None = None,
) -> MilpResult:
    """Solve with HiGHS; ``deadline_at`` (time.perf_counter()) bounds the whole call, model loading included."""
    started = time.perf_counter()
    try:
        highs = _prepared_highs(problem, mip_gap=mip_gap, threads=threads, start=start, presolve=presolve)
    except KeyboardInterrupt:  # before the solver started: no incumbent of its own (the caller has the start)
        return MilpResult("timeout", None, None, None, None, time.perf_counter() - started,
                          "interrupted before the solver started", interrupted=True)
    if deadline_at is not None:
        time_left_s = deadline_at - time.perf_counter()
        if time_left_s <= 0:
            return MilpResult("timeout", None, None, None, None, time.perf_counter() - started,
                              "the time limit passed while the model was loaded into HiGHS")
        time_limit_s = time_left_s if time_limit_s is None else min(time_limit_s, time_left_s)
    if time_limit_s is not None:
        highs.setOptionValue("time_limit", float(time_limit_s))
        setup_s = _SETUP_S_PER_NONZERO * problem.num_nonzeros
        if setup_s > _SETUP_SHARE_OF_TIME_LEFT * time_limit_s:
            highs.setOptionValue("mip_detect_symmetry", False)
        if 2 * setup_s > _SETUP_SHARE_OF_TIME_LEFT * time_limit_s:  # presolve costs about twice as much
            highs.setOptionValue("presolve", "off")
    if progress is not None:
        _subscribe_progress(highs, progress, started)
    interrupted = _run(highs, deadline_at)
    return _result(highs, interrupted, time.perf_counter() - started)


def _prepared_highs(problem: MilpProblem, *, mip_gap, threads, start, presolve) -> highspy.Highs:
    highs = _new_highs()
    highs.setOptionValue("output_flag", False)
    if not presolve:
        highs.setOptionValue("presolve", "off")
    highs.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads is not None:
        highs.setOptionValue("threads", int(threads))
    for option, value in _EXTRA_OPTIONS.items():
        highs.setOptionValue(option, value)

    lp = highspy.HighsLp()
    lp.num_col_ = problem.num_cols
    lp.num_row_ = problem.num_rows
    lp.col_cost_ = np.asarray(problem.col_cost, dtype=np.float64)
    lp.col_lower_ = np.asarray(problem.col_lb, dtype=np.float64)
    lp.col_upper_ = np.asarray(problem.col_ub, dtype=np.float64)
    lp.row_lower_ = np.asarray(problem.row_lb, dtype=np.float64)
    lp.row_upper_ = np.asarray(problem.row_ub, dtype=np.float64)
    lp.offset_ = problem.objective_offset
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.asarray(problem.row_start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(problem.row_index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(problem.row_value, dtype=np.float64)
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if integer else highspy.HighsVarType.kContinuous
        for integer in problem.col_integer
    ]
    highs.passModel(lp)

    if start is not None:
        solution = highspy.HighsSolution()
        solution.col_value = list(np.asarray(start, dtype=np.float64))
        solution.value_valid = True
        highs.setSolution(solution)
    return highs


def _subscribe_progress(highs: highspy.Highs, progress: ProgressCallback, started: float) -> None:
    last_report = [0.0]

    def report(event) -> None:
        now = time.perf_counter() - started
        if now - last_report[0] < _PROGRESS_PERIOD_S:
            return
        last_report[0] = now
        data = event.data_out
        progress(
            SolverProgress(
                elapsed_s=now,
                incumbent_j=_finite(data.mip_primal_bound),
                bound_j=_finite(data.mip_dual_bound),
                gap=_finite(data.mip_gap),
            )
        )

    highs.cbMipInterrupt.subscribe(report)
    highs.cbMipImprovingSolution.subscribe(report)


def _result(highs: highspy.Highs, interrupted: bool, solve_s: float) -> MilpResult:
    status = highs.getModelStatus()
    info = highs.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(highs.getSolution().col_value) if has_solution else None
    objective = float(info.objective_function_value) if has_solution else None
    bound = _finite(info.mip_dual_bound)
    gap = _finite(info.mip_gap) if has_solution else None
    if interrupted:
        if has_solution:
            return MilpResult("feasible", x, objective, bound, gap, solve_s, "interrupted", interrupted=True)
        return MilpResult("timeout", None, None, bound, None, solve_s, "interrupted before any schedule was found",
                          interrupted=True)
    if status == highspy.HighsModelStatus.kOptimal:
        return MilpResult("optimal", x, objective, bound, gap if gap is not None else 0.0, solve_s)
    if status == highspy.HighsModelStatus.kInfeasible:
        return MilpResult("infeasible", None, None, bound, None, solve_s, "the model is infeasible")
    if status in (
        highspy.HighsModelStatus.kTimeLimit,
        highspy.HighsModelStatus.kInterrupt,
        highspy.HighsModelStatus.kSolutionLimit,
        highspy.HighsModelStatus.kIterationLimit,
    ):
        if has_solution:
            return MilpResult("feasible", x, objective, bound, gap, solve_s, "time limit reached")
        return MilpResult("timeout", None, None, bound, None, solve_s, "time limit reached with no solution")
    return MilpResult("error", x, objective, bound, gap, solve_s, f"HiGHS ended with {highs.modelStatusToString(status)}")
