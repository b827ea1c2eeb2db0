"""MILP neighbourhood search: the POET MILP solved again and again with most of a schedule fixed.

The full MILP of a traced model seldom improves on its warm start within a solve's time (its LP relaxation spreads
evictions thinly, and its tree is large), and the greedy and its ejection moves stop at local optima. Between the
two: fix every column of the best schedule except those of a window of consecutive tensors (every stage's decision
to keep, page or recompute them, and to free them), and let HiGHS solve that much smaller problem exactly. Any answer
is a schedule of the whole MILP, at most as costly as the start (the start is feasible there and is given to HiGHS);
a cheaper one becomes the start of the next window. Windows overlap by half, the costliest first (where the start
spends the most restoring its tensors), and passes repeat until one takes no move.

Measured on hf_bert at 30% on m4 (windows of 12 tensors, 15 s each in the windows' order, from the 120 s solve's
answer): 0.0956399 J -> 0.0949855 J in one pass of 68 s (the window of the second layer's attention, after 50 s); a
second pass took nothing. With 5 s a window, the costliest first, that move came at 12.7 s. On jetsontx2 0.0222218 ->
0.0222022 J in a pass. Windows of 16 stages instead of tensors gave less (0.0222046 J in two passes): a tensor's
decisions span its forward and backward stages, which a window of stages cuts apart.

Each window is its own problem: the fixed columns are substituted into the rows and the objective, so HiGHS gets only
the window's columns. Sending the whole model with fixed bounds cost resnet50 at 30% on m4 (447k columns, 2.2M
nonzeros) 8.4 s a window under a 5 s window limit; its own problem (84k columns, most of them RAM columns, which stay
free) 5.2 s, 6 windows in the phase's 34 s against 4. On hf_bert at 30% on m4 (24k
columns, 8k a window) the phase found the same answer, 0.0949855 J, either way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from host.solver.backends.highs import solve_highs
from host.solver.deadline import Deadline
from host.solver.milp import MilpProblem
from host.solver.poet_milp import PoetFormulation

# Consecutive tensors whose columns a window leaves free; windows start every half window.
WINDOW_TENSORS = 12
# The most a window's problem gets; one that does not close by then keeps the best schedule HiGHS found in it. Most
# windows of hf_bert close in 0.3-5 s; with 15 s a window the pass reached the one that counts after 50 s.
WINDOW_TIME_LIMIT_S = 5.0
# A window's problem is solved to this relative gap: it is small, and a move is only worth a real saving.
_WINDOW_MIP_GAP = 1e-6
# A window's answer counts as a move when it saves at least this share of the energy.
_MOVE_RTOL = 1e-7


def column_tensors(formulation: PoetFormulation) -> np.ndarray:
    """For each column of the model, the tensor whose decision it is (-1: the continuous RAM columns)."""
    tensor_of = np.full(formulation.problem.num_cols, -1, dtype=np.int64)
    v = formulation.vars
    for family in (v.recompute, v.keep_ram, v.keep_flash, v.page_in, v.page_out):
        for (_, tensor), col in family.items():
            tensor_of[col] = tensor
    for (_, tensor, _), col in v.free.items():
        tensor_of[col] = tensor
    return tensor_of


def windows_costliest_first(formulation: PoetFormulation, x: np.ndarray) -> list[range]:
    """Windows of WINDOW_TENSORS consecutive tensors every half window, the costliest first: by the energy the
    schedule ``x`` spends restoring their tensors (recomputations after the first and page transfers)."""
    size = formulation.graph.size
    plan = formulation.plan_from_solution(x)
    priced = formulation.priced
    restoring_j = ((plan.recompute.sum(axis=0) - np.diag(plan.recompute)) * priced.compute_j
                   + plan.page_in.sum(axis=0) * priced.page_in_j + plan.page_out.sum(axis=0) * priced.page_out_j)
    step = max(1, WINDOW_TENSORS // 2)
    windows = [range(first, min(size, first + WINDOW_TENSORS)) for first in range(0, max(1, size - step), step)]
    return sorted(windows, key=lambda window: -float(restoring_j[window.start:window.stop].sum()))


def neighbourhood_search(formulation: PoetFormulation, start: np.ndarray, deadline: Deadline, *,
                         cancel: threading.Event | None = None) -> Iterator[np.ndarray]:
    """Yield each cheaper full column vector found, from the feasible ``start``, until a pass over the windows takes
    no move or ``deadline`` passes (a window's problem is stopped there, and HiGHS's best schedule in it is kept).
    ``cancel`` set (from another thread) stops it as Ctrl-C does: KeyboardInterrupt."""
    problem = formulation.problem
    tensor_of = column_tensors(formulation)
    whole = _ModelArrays(problem)
    decision = (tensor_of >= 0) & (whole.col_lb < whole.col_ub)  # a column its bounds fix stays out of every window
    best = np.asarray(start, dtype=float)
    best_j = problem.objective(best)
    while True:
        moved = False
        for window in windows_costliest_first(formulation, best):
            if deadline.expired():
                return
            # The decisions outside the window fixed at the start's (integral) values; the RAM columns follow.
            fixed = whole.fixed_outside(decision & (tensor_of >= window.start) & (tensor_of < window.stop))
            x = np.where(fixed & whole.integer, np.round(best), best)
            sub, free_cols = whole.restricted(fixed, x)
            result = solve_highs(sub, time_limit_s=min(WINDOW_TIME_LIMIT_S, deadline.remaining_s()),
                                 mip_gap=_WINDOW_MIP_GAP, threads=1, start=x[free_cols], deadline_at=deadline.at,
                                 cancel=cancel)
            if result.interrupted:
                raise KeyboardInterrupt
            if result.x is None:
                continue
            x[free_cols] = np.asarray(result.x, dtype=float)
            energy_j = problem.objective(x)
            # Checked against the whole model, not the window's word (HiGHS's tolerances, a start handed back); the
            # caller replays each move with the validator.
            if (energy_j < best_j * (1 - _MOVE_RTOL)
                    and problem.max_violation(x) <= 1e-6 * max(1.0, formulation.options.ram_budget_bytes)):
                best, best_j, moved = x, energy_j, True
                yield best
        if not moved:
            return


class _ModelArrays:
    """The whole model's arrays, read once, from which each window's own problem is cut."""

    def __init__(self, problem: MilpProblem) -> None:
        self.name = problem.name
        self.cost = np.asarray(problem.col_cost, dtype=float)
        self.col_lb, self.col_ub = np.asarray(problem.col_lb, dtype=float), np.asarray(problem.col_ub, dtype=float)
        self.integer = np.asarray(problem.col_integer, dtype=bool)
        self.row_lb, self.row_ub = np.asarray(problem.row_lb, dtype=float), np.asarray(problem.row_ub, dtype=float)
        self.index = np.asarray(problem.row_index, dtype=np.int64)
        self.value = np.asarray(problem.row_value, dtype=float)
        self.row_of_entry = np.repeat(np.arange(problem.num_rows), np.diff(np.asarray(problem.row_start)))
        self.offset = problem.objective_offset
        self.continuous = ~self.integer & (self.col_lb < self.col_ub)  # the RAM columns

    def fixed_outside(self, free_decisions: np.ndarray) -> np.ndarray:
        """Columns fixed for a window whose free decision columns are ``free_decisions`` (a mask): every other
        decision and every column its bounds fix. The RAM columns stay free: a window's tensors are live at most
        stages, so nearly all of them follow its decisions (on resnet50 at 30% on m4, fixing those no free decision
        reaches through rows of RAM columns left 83.7k columns of 84.4k, and the window took as long)."""
        return ~(free_decisions | self.continuous)

    def restricted(self, fixed: np.ndarray, x: np.ndarray) -> tuple[MilpProblem, np.ndarray]:
        """The problem over the columns not ``fixed``, the fixed ones at their values in ``x`` moved into the row
        bounds and the objective's offset; a row left with no free column is dropped (``x`` satisfies it). Returns it
        with the whole model's index of each of its columns. Sending the whole model with fixed bounds instead cost
        resnet50 at 30% on m4 (447k columns, 2.2M nonzeros) 3.3 s a window before HiGHS's presolve had removed them."""
        free_cols = np.flatnonzero(~fixed)
        new_col = np.full(len(fixed), -1, dtype=np.int64)
        new_col[free_cols] = np.arange(len(free_cols))
        free_entry = ~fixed[self.index]
        fixed_entry = ~free_entry
        fixed_activity = np.bincount(self.row_of_entry[fixed_entry],
                                     weights=self.value[fixed_entry] * x[self.index[fixed_entry]],
                                     minlength=len(self.row_lb))
        kept_rows = np.bincount(self.row_of_entry[free_entry], minlength=len(self.row_lb)) > 0
        new_row = np.cumsum(kept_rows) - 1
        per_row = np.bincount(new_row[self.row_of_entry[free_entry]], minlength=int(kept_rows.sum()))
        sub = MilpProblem(f"{self.name} (window)")
        sub.col_cost, sub.col_lb, sub.col_ub = self.cost[free_cols], self.col_lb[free_cols], self.col_ub[free_cols]
        sub.col_integer = self.integer[free_cols]
        with np.errstate(invalid="ignore"):  # inf - activity stays inf
            sub.row_lb = (self.row_lb - fixed_activity)[kept_rows]
            sub.row_ub = (self.row_ub - fixed_activity)[kept_rows]
        sub.row_start = np.concatenate([[0], np.cumsum(per_row)])
        sub.row_index = new_col[self.index[free_entry]]
        sub.row_value = self.value[free_entry]
        sub.objective_offset = self.offset + float(np.dot(self.cost[fixed], x[fixed]))
        return sub, free_cols
