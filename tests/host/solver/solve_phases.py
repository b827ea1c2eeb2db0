"""Test helpers that steer a solve's phases (host.solver.solve) through pytest's monkeypatch."""

import dataclasses

from host.solver import solve


def first_cover_left_open(monkeypatch) -> None:
    """The first covering problem reported as not closed (as if cut short), and no time left to solve it again: no
    other covering problem runs, so the ejection moves from the greedy run beside the MILP (HiGHS) or before it."""
    real_cover = solve.eviction_cover
    monkeypatch.setattr(solve, "eviction_cover",
                        lambda *args, **kwargs: dataclasses.replace(real_cover(*args, **kwargs), closed=False))
    monkeypatch.setattr(solve, "_stronger_bound_time_s", lambda *args, **kwargs: 0.0)
