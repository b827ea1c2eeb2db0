"""A small sparse MILP container: formulations fill it, backends solve it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

INF = math.inf


@dataclass
class SolverProgress:
    """One live progress report from a backend: elapsed time, incumbent, bound and gap."""

    elapsed_s: float
    incumbent_j: float | None
    bound_j: float | None
    gap: float | None
    phase: str = "solving"  # what the solver is doing: building model | warm start | solving | ...


ProgressCallback = Callable[[SolverProgress], None]


class MilpProblem:
    """Minimise ``cost·x`` subject to ``row_lb <= A x <= row_ub`` and column bounds; rows stored sparse."""

    def __init__(self, name: str):
        self.name = name
        self.col_cost: list[float] = []
        self.col_lb: list[float] = []
        self.col_ub: list[float] = []
        self.col_integer: list[bool] = []
        self.row_lb: list[float] = []
        self.row_ub: list[float] = []
        self.row_start: list[int] = [0]
        self.row_index: list[int] = []
        self.row_value: list[float] = []
        self.objective_offset = 0.0

    @property
    def num_cols(self) -> int:
        return len(self.col_cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lb)

    @property
    def num_nonzeros(self) -> int:
        return len(self.row_index)

    @property
    def num_integer(self) -> int:
        return sum(self.col_integer)

    def add_var(self, lb: float = 0.0, ub: float = 1.0, integer: bool = True, cost: float = 0.0) -> int:
        self.col_cost.append(float(cost))
        self.col_lb.append(float(lb))
        self.col_ub.append(float(ub))
        self.col_integer.append(integer)
        return len(self.col_cost) - 1

    def add_row(self, terms: Sequence[tuple[int, float]], lb: float = -INF, ub: float = INF) -> None:
        """Add ``lb <= Σ coef·x[col] <= ub``; repeated columns are merged."""
        merged: dict[int, float] = {}
        for col, coef in terms:
            merged[col] = merged.get(col, 0.0) + coef
        for col, coef in merged.items():
            if coef != 0.0:
                self.row_index.append(col)
                self.row_value.append(coef)
        self.row_start.append(len(self.row_index))
        self.row_lb.append(float(lb))
        self.row_ub.append(float(ub))

    def add_row_unit_scaled(self, terms: Sequence[tuple[int, float]], lb: float = -INF, ub: float = INF) -> None:
        """``add_row`` divided by the row's smallest nonzero |coefficient|.

        Solvers check rows against an absolute tolerance (1e-7 in HiGHS). A row in seconds whose
        terms are 1e-7 s each would let a whole term through; scaled, a term counts at least 1.
        """
        smallest = min((abs(c) for _, c in terms if c != 0.0), default=1.0)
        self.add_row([(col, c / smallest) for col, c in terms], lb / smallest, ub / smallest)

    def objective(self, x: np.ndarray) -> float:
        return float(np.dot(self.col_cost, x) + self.objective_offset)

    def max_violation(self, x: np.ndarray) -> float:
        """Largest violation of a row or bound by ``x`` (0 when feasible), for warm-start checks."""
        worst = 0.0
        x = np.asarray(x, dtype=float)
        worst = max(worst, float(np.max(np.asarray(self.col_lb) - x, initial=0.0)))
        worst = max(worst, float(np.max(x - np.asarray(self.col_ub), initial=0.0)))
        index = np.asarray(self.row_index, dtype=np.int64)
        value = np.asarray(self.row_value)
        row_of_entry = np.repeat(np.arange(self.num_rows), np.diff(np.asarray(self.row_start)))
        activity = np.bincount(row_of_entry, weights=value * x[index], minlength=self.num_rows)
        worst = max(worst, float(np.max(np.asarray(self.row_lb) - activity, initial=0.0)))
        worst = max(worst, float(np.max(activity - np.asarray(self.row_ub), initial=0.0)))
        return worst


@dataclass
class MilpResult:
    """What a backend found. ``status``: optimal | feasible | infeasible | timeout | error."""

    status: str
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    gap: float | None
    solve_s: float
    message: str = ""
    interrupted: bool = False  # the user stopped the solve (Ctrl-C); x is the incumbent, if any
