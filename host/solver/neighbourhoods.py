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
"""

from __future__ import annotations

import copy
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
    decision = tensor_of >= 0
    col_lb, col_ub = np.asarray(problem.col_lb, dtype=float), np.asarray(problem.col_ub, dtype=float)
    best = np.asarray(start, dtype=float)
    best_j = problem.objective(best)
    while True:
        moved = False
        for window in windows_costliest_first(formulation, best):
            if deadline.expired():
                return
            fixed = decision & ((tensor_of < window.start) | (tensor_of >= window.stop))
            # The decisions fixed at the start's (integral) values; the RAM columns follow from them.
            sub = _with_bounds(problem, np.where(fixed, np.round(best), col_lb), np.where(fixed, np.round(best), col_ub))
            result = solve_highs(sub, time_limit_s=min(WINDOW_TIME_LIMIT_S, deadline.remaining_s()),
                                 mip_gap=_WINDOW_MIP_GAP, threads=1, start=best, deadline_at=deadline.at,
                                 cancel=cancel)
            if result.interrupted:
                raise KeyboardInterrupt
            if result.x is None:
                continue
            x = np.asarray(result.x, dtype=float)
            energy_j = problem.objective(x)
            # Checked against the whole model, not the window's word (HiGHS's tolerances, a start handed back); the
            # caller replays each move with the validator.
            if (energy_j < best_j * (1 - _MOVE_RTOL)
                    and problem.max_violation(x) <= 1e-6 * max(1.0, formulation.options.ram_budget_bytes)):
                best, best_j, moved = x, energy_j, True
                yield best
        if not moved:
            return


def _with_bounds(problem: MilpProblem, col_lb: np.ndarray, col_ub: np.ndarray) -> MilpProblem:
    """The same problem with other column bounds (rows and costs shared, not copied)."""
    sub = copy.copy(problem)
    sub.col_lb, sub.col_ub = col_lb.tolist(), col_ub.tolist()
    return sub
