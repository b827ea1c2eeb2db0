"""Solver backends: one file each, registered here by name."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from device_agent.errors import UserError
from host.solver.milp import MilpProblem, MilpResult, ProgressCallback

Backend = Callable[..., MilpResult]


class UnknownSolverError(UserError, ValueError):
    """A --solver name that is not registered."""


def _highs(*args, **kwargs) -> MilpResult:
    from host.solver.backends.highs import solve_highs

    return solve_highs(*args, **kwargs)


def _cbc(*args, **kwargs) -> MilpResult:
    from host.solver.backends.pulp_backend import solve_cbc

    return solve_cbc(*args, **kwargs)


def _gurobi(*args, **kwargs) -> MilpResult:
    from host.solver.backends.pulp_backend import solve_gurobi

    return solve_gurobi(*args, **kwargs)


BACKENDS: dict[str, Backend] = {"highs": _highs, "cbc": _cbc, "gurobi": _gurobi}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownSolverError(f"unknown solver {name!r}; choose one of: {', '.join(BACKENDS)}") from None


def solve_milp(
    problem: MilpProblem,
    solver: str = "highs",
    *,
    time_limit_s: float | None = None,
    mip_gap: float = 1e-3,
    threads: int | None = None,
    start: object | None = None,
    progress: ProgressCallback | None = None,
    presolve: bool = True,
    deadline_at: float | None = None,
    cancel: threading.Event | None = None,
) -> MilpResult:
    """Solve ``problem`` with the named backend. ``presolve=False`` is the retry of an untrusted answer.

    ``deadline_at`` (time.perf_counter()) is when the call must return by: HiGHS cancels its solve
    there; the PuLP backends get the time left as their time limit. ``cancel`` (HiGHS only): set from another
    thread, it stops the solve as Ctrl-C does.
    """
    if cancel is not None and solver != "highs":
        raise ValueError(f"the {solver} backend cannot be stopped from another thread; only highs can")
    if deadline_at is not None and solver != "highs":
        time_left_s = max(0.5, deadline_at - time.perf_counter())
        time_limit_s = time_left_s if time_limit_s is None else min(time_limit_s, time_left_s)
    keywords = dict(time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads, start=start, progress=progress,
                    presolve=presolve)
    if solver == "highs":
        keywords.update(deadline_at=deadline_at, cancel=cancel)
    return get_backend(solver)(problem, **keywords)
