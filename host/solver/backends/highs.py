"""HiGHS through highspy: the default backend (warm start, live progress), solving in a worker process
(host/solver/backends/highs_worker.py) so that a deadline or Ctrl-C stops it at once, wherever HiGHS is."""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import highspy
import numpy as np

from host.fdio import stdout_to_stderr
from host.solver.milp import MilpProblem, MilpResult, ProgressCallback, SolverProgress

_PROGRESS_PERIOD_S = 0.5
# Tuned on the POET benchmarks (bench/solver.py): primal heuristics pay off on these models,
# whose objective is dominated by a constant (compute-once energy).
_EXTRA_OPTIONS: dict[str, object] = {}


_WAIT_PERIOD_S = 0.1  # how often the waiting side wakes up to notice Ctrl-C, the deadline or a message
# After a cancel, HiGHS gets this long to stop and answer; then its process is killed and the last incumbent it
# sent is the answer. HiGHS cannot be stopped everywhere: while it loads the model, presolves, or computes its root
# node's analytic centre (an interior-point task its cancel does not reach). In this process, traced MobileNetV2
# with a 60 s limit returned after 147 s, and traced resnet50 with 120 s limits after 259-370 s (a loaded 2-core
# machine); so the solve runs in a process of its own, and the time limit holds.
_KILL_GRACE_S = 1.0

# HiGHS neither checks its time limit nor a cancel during symmetry detection and presolve: on a model
# of 2.7M nonzeros (MobileNetV2, 410 nodes) they took about 3 s and 5 s on a loaded 2-core machine,
# whatever the limit. Each is skipped when this estimate of its cost exceeds a quarter of the time left,
# so that the solver reaches its search (and an incumbent) before the deadline.
_SETUP_S_PER_NONZERO = 2e-6
_SETUP_SHARE_OF_TIME_LEFT = 0.25

# A worker whose HiGHS ended on its own (optimal or infeasible, no cancel) on a model of at most this many nonzeros
# waits for another solve instead of exiting: starting one costs about 0.15 s of wall time and 0.12 s of CPU, most of
# a small solve (the covering problems' rounds, the property tests' thousands of solves of 3-8 layer graphs), and
# nothing on a large one, whose memory is then given back with its process.
REUSE_MAX_NONZEROS = 200_000
# Workers kept waiting after their solve, besides the spare started ahead: one solve runs one HiGHS model at a time,
# and a process may run a few solves at once (the fleet's --solver-workers threads).
_WAITING_WORKERS = 2


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) and abs(value) < 1e29 else None


def _new_highs() -> highspy.Highs:
    with stdout_to_stderr():  # HiGHS prints its banner on the process's stdout
        return highspy.Highs()


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
    cancel: threading.Event | None = None,
) -> MilpResult:
    """Solve with HiGHS in a worker process; ``deadline_at`` (time.perf_counter()) bounds the whole call.

    At the deadline the worker is asked to stop, and killed :data:`_KILL_GRACE_S` later if HiGHS has not
    answered; a Ctrl-C (or SIGTERM turned into one) does the same and marks the result interrupted, and so does
    ``cancel`` being set (a solve waited for on a thread other than the main one, which Ctrl-C does not reach).
    Either way the best schedule HiGHS had found is returned.
    """
    started = time.perf_counter()
    if deadline_at is not None:
        time_left_s = deadline_at - started
        if time_left_s <= 0:
            return MilpResult("timeout", None, None, None, None, 0.0, "the time limit passed before the solver started")
        time_limit_s = time_left_s if time_limit_s is None else min(time_limit_s, time_left_s)
    request = {"problem": problem, "mip_gap": float(mip_gap), "threads": threads, "presolve": presolve,
               "start": None if start is None else np.asarray(start, dtype=np.float64), "time_limit_s": time_limit_s,
               "extra_options": dict(_EXTRA_OPTIONS)}
    try:
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt
        worker = _Worker(request)
    except KeyboardInterrupt:  # before the solver started: no incumbent of its own (the caller has the start)
        return MilpResult("timeout", None, None, None, None, time.perf_counter() - started,
                          "interrupted before the solver started", interrupted=True)
    return worker.wait(started, deadline_at, progress, cancel)


def configure_time_limit(highs: highspy.Highs, problem: MilpProblem, time_limit_s: float | None) -> None:
    """HiGHS's own time limit, and the setup it cannot interrupt skipped when it would eat the time."""
    if time_limit_s is None:
        return
    highs.setOptionValue("time_limit", float(time_limit_s))
    setup_s = _SETUP_S_PER_NONZERO * problem.num_nonzeros
    if setup_s > _SETUP_SHARE_OF_TIME_LEFT * time_limit_s:
        highs.setOptionValue("mip_detect_symmetry", False)
    if 2 * setup_s > _SETUP_SHARE_OF_TIME_LEFT * time_limit_s:  # presolve costs about twice as much
        highs.setOptionValue("presolve", "off")


class _Worker:
    """The worker process (host.solver.backends.highs_worker) and what it sent: progress, incumbents, result."""

    def __init__(self, request: dict) -> None:
        self.process = _SPARE.take()
        self.incumbent: tuple | None = None  # (x, objective, bound, gap) of the best schedule sent
        self.bound: float | None = None
        self.result: dict | None = None
        self.waits = False  # the worker said it waits for another solve after its result
        self.killed = False
        try:
            try:
                send_frame(self.process.stdin.fileno(), request)
            except BrokenPipeError:  # a spare that died while it waited (killed from outside): one fresh try
                self._kill()
                self.process = _start_worker(_worker_env())
                send_frame(self.process.stdin.fileno(), request)
        except BaseException:
            self._kill()
            raise

    def wait(self, started: float, deadline_at: float | None, progress: ProgressCallback | None,
             cancel: threading.Event | None = None) -> MilpResult:
        # The reader says when it is done through an event, not through the thread: a Ctrl-C that lands in
        # Thread.join() marks a live thread as stopped (Python 3.11, bpo-45274's handling), and the kill below
        # was then never reached (a SIGINT during a large model's presolve took 2.7 s to land instead of 1 s).
        done = threading.Event()
        reader = threading.Thread(target=self._read, args=(started, progress, done), name="poet-highs-reader",
                                  daemon=True)
        reader.start()
        user = False
        cancelled_at: float | None = None  # when the worker was asked to stop (deadline or Ctrl-C)
        while not done.is_set():
            try:
                done.wait(_WAIT_PERIOD_S)
                now = time.perf_counter()
                if cancelled_at is None and cancel is not None and cancel.is_set():
                    user = True
                    cancelled_at = self._cancel(user=True)
                if cancelled_at is None and deadline_at is not None and now >= deadline_at:
                    cancelled_at = self._cancel(user=False)
                if cancelled_at is not None and now >= cancelled_at + _KILL_GRACE_S and not done.is_set():
                    self._kill()
            except KeyboardInterrupt:
                user = True
                if cancelled_at is None:
                    cancelled_at = self._cancel(user=True)
        if self.result is None:  # the reader stopped without an answer: the worker may be blocked writing to it
            self._kill()
        reader.join()
        code = None
        if self.result is not None and self.waits and not self.killed:
            # It waits for another request, even where a cancel crossed its result (it skips that cancel): waiting
            # for it to exit here would wait forever.
            _SPARE.give_back(self.process)
        else:
            code = _exit_code(self.process)
        solve_s = time.perf_counter() - started
        if self.result is not None:
            result = MilpResult(**{**self.result, "solve_s": solve_s})
            if user and not result.interrupted:
                result.interrupted, result.message = True, "interrupted"
            return result
        if cancelled_at is None:  # nobody stopped it: the worker died on its own
            what = f"the HiGHS worker process ended with exit code {code} before answering (its error is above)"
            x, objective, _bound, gap = self.incumbent or (None, None, None, None)
            return MilpResult("error", x, objective, self.bound, gap, solve_s, what)
        if self.incumbent is not None:
            x, objective, _bound, gap = self.incumbent
            what = "interrupted" if user else "time limit reached"
            return MilpResult("feasible", x, objective, self.bound, gap, solve_s, f"{what}: HiGHS was stopped",
                              interrupted=user)
        message = "interrupted before any schedule was found" if user else "time limit reached with no solution"
        return MilpResult("timeout", None, None, self.bound, None, solve_s, message, interrupted=user)

    def _read(self, started: float, progress: ProgressCallback | None, done: threading.Event) -> None:
        try:
            self._read_frames(started, progress)
        finally:
            done.set()

    def _read_frames(self, started: float, progress: ProgressCallback | None) -> None:
        fd = self.process.stdout.fileno()
        while (message := receive_frame(fd)) is not None:
            kind = message[0]
            if kind in ("incumbent", "progress"):  # an improving schedule is reported as progress too
                if kind == "incumbent":
                    self.incumbent = message[1:]
                    incumbent_j, bound_j, gap = message[2:]
                else:
                    _, incumbent_j, bound_j, gap = message
                self.bound = bound_j if bound_j is not None else self.bound
                if progress is not None:
                    progress(SolverProgress(elapsed_s=time.perf_counter() - started, incumbent_j=incumbent_j,
                                            bound_j=bound_j, gap=gap))
            elif kind == "result":  # the last frame of this solve (a worker that waits sends nothing more)
                self.result, self.waits = message[1], bool(message[2])
                return

    def _cancel(self, *, user: bool) -> float:
        try:
            send_frame(self.process.stdin.fileno(), ("cancel", user))
        except OSError:  # the worker already ended
            pass
        return time.perf_counter()

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.killed = True


def _worker_env() -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[3])  # the directory holding the host package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    # The worker uses no BLAS: numpy's OpenBLAS threads, started at import, cost 0.1 s of CPU per worker for nothing.
    env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def _start_worker(env: dict[str, str]) -> subprocess.Popen:
    """A new worker process: it imports Python, numpy and highspy (about 0.15 s), then waits for its request."""
    return subprocess.Popen([sys.executable, "-m", "host.solver.backends.highs_worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


def _exit_code(process: subprocess.Popen) -> int:
    """The exit code of a worker that ends on its own after its answer (or was killed), killing it if it has not
    ended within _KILL_GRACE_S: no solve waits for a worker forever."""
    try:
        return process.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _end_worker(process: subprocess.Popen) -> None:
    """End a worker waiting for its request (the end of its stdin), killing it if it does not go at once."""
    process.stdin.close()
    _exit_code(process)
    process.stdout.close()


class _SpareWorker:
    """One started worker kept waiting for the next solve, so that a run of solves does not wait for each worker to
    start (about 0.15 s of 0.25 s for a small solve): the eviction bound's rounds, the MILP, the fleet's solver workers,
    the property tests' thousands of small solves. The spare that takes its place is started as it is taken. A worker
    whose small solve ended on its own waits too (up to _WAITING_WORKERS of them, taken before the spare); any other
    is ended or killed with its solve. A waiting worker holds 15-18 MB of its own, about 60 MB after a solve near
    REUSE_MAX_NONZEROS (59.6-63.5 MB after one of 180,000 nonzeros: glibc keeps the freed heap, and a gc.collect()
    there gives none of it back), and ends with this process (the end of its stdin). They are not shared across a fork
    (the child starts its own), and one started with another interpreter or PYTHONPATH is ended, not used."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._solved: list[subprocess.Popen] = []  # workers that solved and wait for another request
        self._owner_pid = -1
        self._launch: tuple[str, str] = ("", "")  # (interpreter, PYTHONPATH) the waiting workers were started with

    def take(self) -> subprocess.Popen:
        """A worker waiting for its request: one that solved before if one is alive, else the spare if it is alive
        (a new spare is then started), else a new one."""
        env = _worker_env()
        launch = (sys.executable, env["PYTHONPATH"])
        stale: list[subprocess.Popen] = []
        with self._lock:
            if self._owner_pid != os.getpid():  # a forked child: its parent's workers are not its own
                self._process, self._solved, self._owner_pid = None, [], os.getpid()
            if self._launch != launch:
                stale += self._waiting()
                self._process, self._solved, self._launch = None, [], launch
            while self._solved:
                process = self._solved.pop()
                if process.poll() is None:
                    break
                stale.append(process)
            else:
                process = self._process
                if process is None or process.poll() is not None:
                    stale += [process] if process is not None else []
                    process = _start_worker(env)
                self._process = _start_worker(env)
        for old in stale:  # ended outside the lock: each may take up to _KILL_GRACE_S
            _end_worker(old)
        return process

    def give_back(self, process: subprocess.Popen) -> None:
        """A worker that solved and waits for another request: kept, or ended where enough wait already."""
        with self._lock:
            keep = self._owner_pid == os.getpid() and len(self._solved) < _WAITING_WORKERS and process.poll() is None
            if keep:
                self._solved.append(process)
        if not keep:
            _end_worker(process)

    def _waiting(self) -> list[subprocess.Popen]:
        return [process for process in [self._process, *self._solved] if process is not None]

    @property
    def pid(self) -> int | None:
        """The spare's process id (None before the first solve, and in a forked child)."""
        with self._lock:
            return self._process.pid if self._process is not None and self._owner_pid == os.getpid() else None

    def pids(self) -> list[int]:
        """The process ids of every worker waiting for a request (the spare's, and those that solved before)."""
        with self._lock:
            return [process.pid for process in self._waiting()] if self._owner_pid == os.getpid() else []

    def stop(self) -> None:
        """End the waiting workers and wait for them (at exit)."""
        with self._lock:
            processes = self._waiting() if self._owner_pid == os.getpid() else []
            self._process, self._solved = None, []
        for process in processes:
            _end_worker(process)


_SPARE = _SpareWorker()
atexit.register(_SPARE.stop)


def spare_worker_pid() -> int | None:
    """The process id of the worker started ahead for the next solve, if one is."""
    return _SPARE.pid


def waiting_worker_pids() -> list[int]:
    """The process ids of every worker waiting for a solve: the spare, and those kept after a small solve."""
    return _SPARE.pids()


# Frames between the solver and its worker: 8 bytes of length, then a pickle (both ends are this package).
_LENGTH = struct.Struct("<Q")


def send_frame(fd: int, message: object) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def receive_frame(fd: int) -> object | None:
    """The next message, or None at the end of the stream (a partial frame is an end too)."""
    header = _read_exactly(fd, _LENGTH.size)
    if header is None:
        return None
    payload = _read_exactly(fd, _LENGTH.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)  # noqa: S301 - written by this package's worker


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def prepared_highs(problem: MilpProblem, *, mip_gap, threads, start, presolve, extra_options=None) -> highspy.Highs:
    highs = _new_highs()
    highs.setOptionValue("output_flag", False)
    if not presolve:
        highs.setOptionValue("presolve", "off")
    highs.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads is not None:
        highs.setOptionValue("threads", int(threads))
    for option, value in (_EXTRA_OPTIONS if extra_options is None else extra_options).items():
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


def highs_result(highs: highspy.Highs, interrupted: bool, solve_s: float) -> MilpResult:
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
