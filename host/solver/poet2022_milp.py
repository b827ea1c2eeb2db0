"""A faithful re-implementation of the POET paper code's MILP, kept as the comparison point.

Every family is a dense T×T (or T×E) block of variables and every constraint is stated as the
paper code states it, including the equality rows that zero the upper triangles and the big-M
pair that defines each free indicator. Only the modelling layer differs (our sparse rows feed
the same backends). `bench/solver.py` runs this next to host.solver.poet_milp.
"""

from __future__ import annotations

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.solver.deadline import Deadline
from host.solver.milp import MilpProblem
from host.solver.poet_milp import FormulationOptions
from host.solver.stage_plan import StagePlan


class Poet2022Formulation:
    name = "poet2022"

    def __init__(self, priced: PricedGraph, options: FormulationOptions, deadline: Deadline | None = None):
        self.priced = priced
        self.graph = priced.graph
        self.options = options
        self.deadline = deadline or Deadline.none()
        self.problem = MilpProblem("poet2022")
        self._build()

    def _matrix(self, rows: int, cols: int, integer: bool = True, ub: float = 1.0, cost=None) -> np.ndarray:
        out = np.empty((rows, cols), dtype=np.int64)
        for a in range(rows):
            for b in range(cols):
                out[a, b] = self.problem.add_var(ub=ub, integer=integer, cost=0.0 if cost is None else cost[b])
        return out

    def _build(self) -> None:
        graph, priced, opts, p = self.graph, self.priced, self.options, self.problem
        size = graph.size
        edges = graph.edges
        cost_ram = [float(n.output_bytes) for n in graph.nodes]
        self.R = R = self._matrix(size, size, cost=priced.compute_j)
        self.SRam = SRam = self._matrix(size, size)
        self.SSd = SSd = self._matrix(size, size)
        self.MIn = MIn = self._matrix(size, size, cost=priced.page_in_j)
        self.MOut = MOut = self._matrix(size, size, cost=priced.page_out_j)
        budget = opts.ram_budget_bytes
        self.U = U = self._matrix(size, size, integer=False, ub=budget)
        self.Free = Free = self._matrix(size, len(edges))

        upper = [(t, i) for t in range(size) for i in range(t + 1, size)]
        upper_incl = [(t, i) for t in range(size) for i in range(t, size)]
        p.add_row([(R[t, i], 1.0) for t, i in upper], 0.0, 0.0)
        p.add_row([(SRam[t, i], 1.0) for t, i in upper_incl], 0.0, 0.0)
        p.add_row([(SSd[t, i], 1.0) for t, i in upper_incl], 0.0, 0.0)
        p.add_row([(MIn[t, i], 1.0) for t, i in upper], 0.0, 0.0)
        p.add_row([(MOut[t, i], 1.0) for t, i in upper], 0.0, 0.0)
        p.add_row([(R[t, t], 1.0) for t in range(size)], size, size)

        building = "building the model"
        self.deadline.check(building)
        for u, v in edges:
            for t in range(size):
                p.add_row([(R[t, v], 1.0), (R[t, u], -1.0), (SRam[t, u], -1.0)], ub=0.0)
        for t in range(size - 1):
            for i in range(size):
                p.add_row([(SRam[t + 1, i], 1.0), (SRam[t, i], -1.0), (R[t, i], -1.0), (MIn[t, i], -1.0)], ub=0.0)
                p.add_row([(SSd[t + 1, i], 1.0), (SSd[t, i], -1.0), (MOut[t, i], -1.0)], ub=0.0)
        for t in range(size):
            for i in range(size):
                p.add_row([(MIn[t, i], 1.0), (SSd[t, i], -1.0)], ub=0.0)
                p.add_row([(MOut[t, i], 1.0), (SRam[t, i], -1.0)], ub=0.0)

        successors = graph.successors
        for t in range(size):
            self.deadline.check(building)
            for e, (i, k) in enumerate(edges):
                later = [j for j in successors[i] if j > k]
                # hazards = 1 - R[t,k] + S_RAM[t+1,i] + Σ R[t,j]
                hazard_terms = [(R[t, k], -1.0)] + [(R[t, j], 1.0) for j in later]
                if t + 1 < size:
                    hazard_terms.append((SRam[t + 1, i], 1.0))
                max_hazards = (2 if t + 1 < size else 1) + len(later)
                # 1 - Free <= hazards  →  -Free - hazard_terms <= 0
                p.add_row([(Free[t, e], -1.0)] + [(c, -a) for c, a in hazard_terms], ub=0.0)
                # max*(1 - Free) >= hazards  →  -max*Free - hazard_terms >= -max + 1
                p.add_row([(Free[t, e], -float(max_hazards))] + [(c, -a) for c, a in hazard_terms], lb=1.0 - max_hazards)
        incoming: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        for e, (i, k) in enumerate(edges):
            incoming[k].append((e, i))
        for t in range(size):
            self.deadline.check(building)
            p.add_row(
                [(U[t, 0], 1.0), (R[t, 0], -cost_ram[0])] + [(SRam[t, i], -cost_ram[i]) for i in range(size)], 0.0, 0.0
            )
            for k in range(size - 1):
                terms = [(U[t, k + 1], 1.0), (U[t, k], -1.0), (R[t, k + 1], -cost_ram[k + 1])]
                terms += [(Free[t, e], cost_ram[i]) for e, i in incoming[k]]
                p.add_row(terms, 0.0, 0.0)
            for k, node in enumerate(graph.nodes):  # while k runs it also holds its workspace
                if node.workspace_bytes:
                    p.add_row([(U[t, k], 1.0), (R[t, k], float(node.workspace_bytes))], ub=budget)
        if opts.runtime_budget_s is not None:
            terms = [(R[t, i], priced.compute_s[i]) for t in range(size) for i in range(size)]
            if opts.paging_in_runtime:
                terms += [(MIn[t, i], priced.page_in_s[i]) for t in range(size) for i in range(size)]
                terms += [(MOut[t, i], priced.page_out_s[i]) for t in range(size) for i in range(size)]
            p.add_row_unit_scaled(terms, ub=opts.runtime_budget_s)
        if not opts.paging:
            for t in range(size):
                for i in range(size):
                    for family in (MIn, MOut, SSd):
                        p.add_row([(family[t, i], 1.0)], 0.0, 0.0)
        if not opts.remat:
            for t in range(size):
                for i in range(size):
                    value = 1.0 if t == i else 0.0
                    p.add_row([(R[t, i], 1.0)], value, value)

    def plan_from_solution(self, x: np.ndarray) -> StagePlan:
        def read(matrix: np.ndarray) -> np.ndarray:
            return x[matrix] > 0.5

        return StagePlan(read(self.R), read(self.SRam), read(self.SSd), read(self.MIn), read(self.MOut))

    def start_from_plan(self, plan: StagePlan) -> None:
        return None  # the paper code has no warm start
