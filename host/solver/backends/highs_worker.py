"""The HiGHS solve in a process of its own: ``python -m host.solver.backends.highs_worker``.

Started by :func:`host.solver.backends.highs.solve_highs` (one spare started ahead, waiting for the next solve's
request: see ``_SpareWorker`` there). It reads a request frame on stdin (the
problem and options), solves, and writes frames on stdout: ``("progress", incumbent_j, bound_j, gap)``
at most every :data:`~host.solver.backends.highs._PROGRESS_PERIOD_S`, ``("incumbent", x, objective,
bound, gap)`` for each improving schedule, and ``("result", fields of MilpResult, waits)`` at the end. A
``("cancel", user)`` frame on stdin asks HiGHS to stop (``user``: the result is marked interrupted);
the end of stdin means the solver is gone, and the worker exits at once. ``waits``: HiGHS ended on its own
(optimal or infeasible, no cancel) on a small model (:data:`~host.solver.backends.highs.REUSE_MAX_NONZEROS`),
and the worker waits for another request instead of exiting, so that a run of small solves does not start a
process each. Ctrl-C is left to the solver, which decides when to stop (the terminal sends it to the whole process
group).
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # before the imports: a spare worker imports while Ctrl-C may reach its process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import dataclasses  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import highspy  # noqa: E402
import numpy as np  # noqa: E402

from host.solver.backends.highs import (  # noqa: E402
    _PROGRESS_PERIOD_S,
    _WAIT_PERIOD_S,
    REUSE_MAX_NONZEROS,
    _finite,
    configure_time_limit,
    highs_result,
    prepared_highs,
    receive_frame,
    send_frame,
)

_STDIN, _GONE_EXIT = 0, 3


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.dup(1)  # frames go to the real stdout; anything HiGHS prints goes to stderr
    os.dup2(2, 1)
    threads = None  # the thread count HiGHS's scheduler was started with in this process
    while True:
        request = receive_frame(_STDIN)
        if request is None:
            os._exit(_GONE_EXIT)
        if not isinstance(request, dict):  # a cancel that crossed the last result: that solve is over
            continue
        if threads is not None and request["threads"] != threads:
            highspy.Highs.resetGlobalScheduler(True)  # HiGHS keeps one scheduler per process, sized by its first solve
        threads = request["threads"]
        if not _solve(request, out):
            sys.stderr.flush()
            os._exit(0)  # HiGHS's worker threads may still run (a cancelled analytic-centre task): do not wait for them


def _solve(request: dict, out: int) -> bool:
    """Solve one request and send its frames; whether this process waits for another (see the module docstring)."""
    started = time.perf_counter()
    problem = request["problem"]
    highs = prepared_highs(problem, mip_gap=request["mip_gap"], threads=request["threads"], start=request["start"],
                           presolve=request["presolve"], extra_options=request["extra_options"])
    configure_time_limit(highs, problem, request["time_limit_s"])
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            send_frame(out, message)

    last_report = [0.0]

    def report(event) -> None:
        now = time.perf_counter()
        if now - last_report[0] < _PROGRESS_PERIOD_S:
            return
        last_report[0] = now
        data = event.data_out
        send(("progress", _finite(data.mip_primal_bound), _finite(data.mip_dual_bound), _finite(data.mip_gap)))

    def improved(event) -> None:
        data = event.data_out
        send(("incumbent", np.array(data.mip_solution, dtype=np.float64), float(data.objective_function_value),
              _finite(data.mip_dual_bound), _finite(data.mip_gap)))

    highs.cbMipInterrupt.subscribe(report)
    highs.cbMipImprovingSolution.subscribe(improved)
    highs.HandleUserInterrupt = True  # so that cancelSolve stops the run
    user = cancelled = False
    highs.startSolve()
    while True:
        done, _status = highs.wait(_WAIT_PERIOD_S)
        if done:
            break
        if select.select([_STDIN], [], [], 0)[0]:
            message = receive_frame(_STDIN)
            if message is None:  # the solver is gone: nobody wants the answer
                os._exit(_GONE_EXIT)
            user, cancelled = bool(message[1]), True
            highs.cancelSolve()
    result = highs_result(highs, user, time.perf_counter() - started)
    waits = (not cancelled and result.status in ("optimal", "infeasible")
             and problem.num_nonzeros <= REUSE_MAX_NONZEROS)
    send(("result", dataclasses.asdict(result), waits))
    return waits


if __name__ == "__main__":
    main()
