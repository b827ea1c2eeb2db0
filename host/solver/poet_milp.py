"""poet-edge's POET MILP: the paper's stage model with variables only where they can be nonzero.

Same decisions and the same memory model as the paper (Patil et al., 2022, eqs. 1-9): stage t
computes node t plus recomputations; checkpoints live in RAM (S_RAM) or on flash (S_SD);
M_in/M_out page between them; U[t, k] is RAM after computing node k in stage t. Differences:

- A variable exists only if it can be useful. Node i is useful at stage t when it is an input of
  the stage's target, or is still needed after stage t, or is an ancestor of such a node (any
  node may be recomputed, backward nodes included, as in the paper). Keeping or paging a node
  that nothing can use any more only costs RAM or energy, so dropping those variables loses no
  schedule that matters: every optimum of the paper's formulation maps to one here. A tensor of
  0 bytes (the batch, which the caller holds) is never recomputed: keeping it costs nothing.
- U[t, ·] is tracked only at positions where stage t may allocate; elsewhere it cannot rise.
- The free indicator of edge (i, k) gets disaggregated upper bounds (tighter LP relaxation)
  instead of the big-M pair; freeing only lowers memory, so the solver sets it whenever allowed.
- Symmetry cuts: never recompute what is already in RAM, never page in what is not kept,
  never page out what is already on flash.
- A node may be paged out in the stage that computes it (the paper waits one stage): a superset
  of the paper's schedules, so the optimum is never worse on the same graph.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.graph.training_graph import TrainingGraph
from host.solver.deadline import Deadline
from host.solver.milp import MilpProblem
from host.solver.stage_plan import StagePlan


@dataclass
class FormulationOptions:
    ram_budget_bytes: float
    runtime_budget_s: float | None
    paging: bool = True
    remat: bool = True
    paging_in_runtime: bool = False


def useful_mask(graph: TrainingGraph) -> np.ndarray:
    """useful[t, i]: node i can contribute to stage t's target or to a tensor live after stage t."""
    size = graph.size
    last_use = graph.last_use
    recomputable = [True] * size
    useful = np.zeros((size, size), dtype=bool)
    for stage in range(size):
        seen = useful[stage]
        seen[stage] = True
        stack: list[int] = []
        candidates = list(graph.nodes[stage].deps) + [m for m in range(stage) if last_use[m] > stage]
        while candidates or stack:
            node = candidates.pop() if candidates else None
            if node is None:
                candidates.extend(graph.nodes[stack.pop()].deps)
                continue
            if not seen[node]:
                seen[node] = True
                if recomputable[node]:
                    stack.append(node)
    return useful


def stage_memory(plan: StagePlan, graph: TrainingGraph, stage: int) -> tuple[float, list[tuple[int, float, list[int]]]]:
    """The memory model of constraint (5) replayed on a plan for one stage.

    Returns the RAM at the stage's start and, for each node k computed in it (in order), the RAM
    just after computing k and the inputs of k freed right after (last use in the stage, not kept).
    While k runs the RAM is that plus k's workspace.
    """
    size = graph.size
    nodes = graph.nodes
    ram_bytes = float(sum(nodes[i].output_bytes for i in np.flatnonzero(plan.keep_ram[stage, :stage])))
    computed = [int(k) for k in np.flatnonzero(plan.recompute[stage, : stage + 1])]
    computed_set = set(computed)
    start_bytes = ram_bytes
    events = []
    for k in computed:
        ram_bytes += nodes[k].output_bytes
        freed = [
            i
            for i in nodes[k].deps
            if not (stage + 1 < size and plan.keep_ram[stage + 1, i])
            and not any(j in computed_set for j in graph.successors[i] if k < j <= stage)
        ]
        events.append((k, ram_bytes, freed))
        ram_bytes -= sum(nodes[i].output_bytes for i in freed)
    return start_bytes, events


@dataclass
class PoetVariables:
    """Column indices of each decision family, keyed (stage, node); absent keys are fixed to 0."""

    recompute: dict[tuple[int, int], int] = field(default_factory=dict)
    keep_ram: dict[tuple[int, int], int] = field(default_factory=dict)
    keep_flash: dict[tuple[int, int], int] = field(default_factory=dict)
    page_in: dict[tuple[int, int], int] = field(default_factory=dict)
    page_out: dict[tuple[int, int], int] = field(default_factory=dict)
    free: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (stage, producer, consumer)
    ram: dict[tuple[int, int], int] = field(default_factory=dict)  # U[stage, position]


class PoetFormulation:
    """Builds the MILP for one priced graph and options; converts solutions and plans both ways."""

    name = "poet-edge"

    def __init__(self, priced: PricedGraph, options: FormulationOptions, deadline: Deadline | None = None):
        """Build the model; raises DeadlineExpired when ``deadline`` passes first."""
        self.priced = priced
        self.graph = priced.graph
        self.options = options
        self.deadline = deadline or Deadline.none()
        self.problem = MilpProblem("poet")
        self.vars = PoetVariables()
        # Millions of small objects and no cycles: the cyclic collector's full passes only add pauses
        # (of a second and more on large models), during which no deadline is checked.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._build()
        finally:
            if collecting:
                gc.enable()

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        graph, opts, problem, v = self.graph, self.options, self.problem, self.vars
        size = graph.size
        priced = self.priced
        useful = useful_mask(graph)
        last_useful = [max((t for t in range(size) if useful[t, i]), default=i) for i in range(size)]
        out_bytes = [n.output_bytes for n in graph.nodes]
        page_time = opts.paging_in_runtime

        # Costs of the always-computed diagonal are a constant.
        problem.objective_offset = float(priced.compute_j.sum())
        building = "building the model"
        for t in range(size):
            self.deadline.check(building)
            for i in range(t):
                if not useful[t, i]:
                    continue
                if opts.remat and out_bytes[i] > 0:  # a 0-byte tensor is kept for free: never recompute it
                    v.recompute[t, i] = problem.add_var(cost=priced.compute_j[i])
                v.keep_ram[t, i] = problem.add_var()
            if opts.paging:
                for i in range(t):  # a 0-byte tensor (the batch, held by the caller) is kept for free: never paged
                    if t <= last_useful[i] and out_bytes[i] > 0:
                        v.keep_flash[t, i] = problem.add_var()
        for t in range(size):
            self.deadline.check(building)
            if opts.paging:
                for i in range(t):
                    if (t, i) in v.keep_flash and t + 1 < size and (t + 1, i) in v.keep_ram:
                        v.page_in[t, i] = problem.add_var(cost=priced.page_in_j[i])
                for i in range(t + 1):
                    in_ram_possible = i == t or (t, i) in v.keep_ram or (t, i) in v.recompute
                    if in_ram_possible and t + 1 < size and (t + 1, i) in v.keep_flash:
                        v.page_out[t, i] = problem.add_var(cost=priced.page_out_j[i])

        def r(t: int, i: int) -> tuple[list[tuple[int, float]], float]:
            """R[t, i] as (terms, constant)."""
            if i == t:
                return [], 1.0
            col = v.recompute.get((t, i))
            return ([(col, 1.0)], 0.0) if col is not None else ([], 0.0)

        def col_terms(family: dict, key, coef: float = 1.0) -> list[tuple[int, float]]:
            col = family.get(key)
            return [(col, coef)] if col is not None else []

        # (1) a computation needs its inputs in RAM: R[t,k] <= R[t,i] + S_RAM[t,i]
        for t in range(size):
            self.deadline.check(building)
            for k in range(t + 1):
                rk_terms, rk_const = r(t, k)
                if not rk_terms and rk_const == 0.0:
                    continue
                for i in graph.nodes[k].deps:
                    ri_terms, ri_const = r(t, i)
                    terms = rk_terms + [(c, -a) for c, a in ri_terms] + col_terms(v.keep_ram, (t, i), -1.0)
                    problem.add_row(terms, ub=ri_const - rk_const)
        # (2) a checkpoint in RAM was there, computed, or paged in during the previous stage
        for (t, i), col in v.keep_ram.items():
            self.deadline.check(building)  # cheap: a clock read
            if t == 0 or i == t - 1:
                continue  # S_RAM[t, t-1] <= R[t-1, t-1] = 1 holds trivially
            prev_terms, prev_const = r(t - 1, i)
            terms = [(col, 1.0)] + [(c, -a) for c, a in prev_terms]
            terms += col_terms(v.keep_ram, (t - 1, i), -1.0) + col_terms(v.page_in, (t - 1, i), -1.0)
            problem.add_row(terms, ub=prev_const)
        # (3) a flash copy was there or was paged out during the previous stage
        for (t, i), col in v.keep_flash.items():
            self.deadline.check(building)  # cheap: a clock read
            terms = [(col, 1.0)] + col_terms(v.keep_flash, (t - 1, i), -1.0) + col_terms(v.page_out, (t - 1, i), -1.0)
            problem.add_row(terms, ub=0.0)
        # (4) paging reads an existing copy; symmetry cuts
        for (t, i), col in v.page_in.items():
            self.deadline.check(building)  # cheap: a clock read
            problem.add_row([(col, 1.0), (v.keep_flash[t, i], -1.0)], ub=0.0)
            problem.add_row([(col, 1.0), (v.keep_ram[t + 1, i], -1.0)], ub=0.0)
        for (t, i), col in v.page_out.items():
            self.deadline.check(building)  # cheap: a clock read
            rt, rc = r(t, i)
            terms = [(col, 1.0)] + [(c, -a) for c, a in rt] + col_terms(v.keep_ram, (t, i), -1.0)
            problem.add_row(terms, ub=rc)
            if (t, i) in v.keep_flash:
                problem.add_row([(col, 1.0), (v.keep_flash[t, i], 1.0)], ub=1.0)
        for (t, i), col in v.recompute.items():
            self.deadline.check(building)  # cheap: a clock read
            if (t, i) in v.keep_ram:
                problem.add_row([(col, 1.0), (v.keep_ram[t, i], 1.0)], ub=1.0)

        # (5) memory: U[t, k] after computing k in stage t, freeing inputs at their last use in the stage
        budget = opts.ram_budget_bytes
        successors = graph.successors
        for t in range(size):
            self.deadline.check(building)
            positions = [k for k in range(t + 1) if k == t or (t, k) in v.recompute]
            base_terms = [(v.keep_ram[t, i], float(out_bytes[i])) for i in range(t) if (t, i) in v.keep_ram]
            previous: int | None = None
            freed_after_previous: list[tuple[int, float]] = []
            for k in positions:
                # U[t,k] = U[t,prev] - (inputs of prev freed after it ran) + R[t,k]·bytes(k)
                u = problem.add_var(lb=0.0, ub=budget, integer=False)
                v.ram[t, k] = u
                rk_terms, rk_const = r(t, k)
                terms = [(u, 1.0)] + [(c, -a * out_bytes[k]) for c, a in rk_terms]
                if previous is None:
                    terms += [(c, -a) for c, a in base_terms]
                else:
                    terms.append((previous, -1.0))
                    terms += freed_after_previous
                problem.add_row(terms, lb=rk_const * out_bytes[k], ub=rk_const * out_bytes[k])
                workspace = graph.nodes[k].workspace_bytes
                if workspace:  # while k runs it also holds its workspace: U[t,k] + R[t,k]·workspace(k) <= budget
                    problem.add_row([(u, 1.0)] + [(c, a * workspace) for c, a in rk_terms],
                                    ub=budget - rk_const * workspace)
                freed_after_previous = []
                for i in graph.nodes[k].deps:
                    free_col = self._free_var(t, i, k, successors[i])
                    if free_col is not None:
                        freed_after_previous.append((free_col, float(out_bytes[i])))
                previous = u

        # (6) runtime budget (the paper counts compute only; optionally paging too, in full: an upper bound of the
        # step the validator replays, where transfers run behind compute; see PricedGraph.overlapped_runtime_s)
        if opts.runtime_budget_s is not None:
            terms = [(col, priced.compute_s[i]) for (t, i), col in v.recompute.items()]
            if page_time:
                terms += [(col, priced.page_in_s[i]) for (t, i), col in v.page_in.items()]
                terms += [(col, priced.page_out_s[i]) for (t, i), col in v.page_out.items()]
            problem.add_row_unit_scaled(terms, ub=opts.runtime_budget_s - priced.base_runtime_s)

    def _free_var(self, t: int, i: int, k: int, successors_of_i: Iterable[int]) -> int | None:
        """Free[t, i, k] = 1 lets node i's bytes go after computing k; upper bounds make it exact."""
        later_users = [j for j in successors_of_i if k < j <= t]
        if t in later_users:
            return None  # the stage's own target still needs i
        v, problem = self.vars, self.problem
        rk = v.recompute.get((t, k)) if k != t else None
        if k != t and rk is None:
            return None
        col = problem.add_var()
        v.free[t, i, k] = col
        if rk is not None:
            problem.add_row([(col, 1.0), (rk, -1.0)], ub=0.0)
        keep_next = v.keep_ram.get((t + 1, i))
        if keep_next is not None:
            problem.add_row([(col, 1.0), (keep_next, 1.0)], ub=1.0)
        for j in later_users:
            rj = v.recompute.get((t, j))
            if rj is not None:
                problem.add_row([(col, 1.0), (rj, 1.0)], ub=1.0)
        return col

    # ------------------------------------------------------------------ conversions
    def plan_from_solution(self, x: np.ndarray) -> StagePlan:
        plan = StagePlan.empty(self.graph.size)
        for family, matrix in (
            (self.vars.recompute, plan.recompute),
            (self.vars.keep_ram, plan.keep_ram),
            (self.vars.keep_flash, plan.keep_flash),
            (self.vars.page_in, plan.page_in),
            (self.vars.page_out, plan.page_out),
        ):
            for (t, i), col in family.items():
                matrix[t, i] = x[col] > 0.5
        return plan

    def start_from_plan(self, plan: StagePlan) -> np.ndarray | None:
        """A full column vector for ``plan``, or None if the plan uses a variable this model lacks."""
        v, graph = self.vars, self.graph
        x = np.zeros(self.problem.num_cols)
        for family, matrix in (
            (v.recompute, plan.recompute),
            (v.keep_ram, plan.keep_ram),
            (v.keep_flash, plan.keep_flash),
            (v.page_in, plan.page_in),
            (v.page_out, plan.page_out),
        ):
            off_diagonal = matrix.copy()
            if family is v.recompute:
                np.fill_diagonal(off_diagonal, False)
            for t, i in zip(*np.nonzero(off_diagonal), strict=True):
                col = family.get((int(t), int(i)))
                if col is None:
                    if family is v.keep_flash:
                        continue  # a flash copy kept where nothing can read it back: dropping it is free
                    return None
                x[col] = 1.0
        for t in range(graph.size):
            self.deadline.check("mapping the warm start onto the model")
            ram_bytes, events = stage_memory(plan, graph, t)
            by_position = {k: (after, freed) for k, after, freed in events}
            for k in range(t + 1):
                if (t, k) not in v.ram:
                    continue
                if k in by_position:
                    after, freed = by_position[k]
                    x[v.ram[t, k]] = after
                    for i in freed:
                        x[v.free[t, i, k]] = 1.0
                        after -= graph.nodes[i].output_bytes
                    ram_bytes = after
                else:
                    x[v.ram[t, k]] = ram_bytes
        if self.problem.max_violation(x) > 1e-6 * max(1.0, self.options.ram_budget_bytes):
            return None
        return x
