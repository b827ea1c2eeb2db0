"""A proven lower bound on a schedule's energy from the evictions the RAM budget forces at each stage.

When stage t computes its node, the RAM holds at least that node's inputs, its output and its workspace,
plus every tensor computed earlier and read after stage t that has not been evicted (host.solver.poet_milp,
constraint 5, at the stage's own position). Where keeping them all exceeds the budget, the stage must
evict tensors holding the excess. A tensor evicted between two of its uses must be back in RAM by the
next use: recomputed (its compute energy) or paged in (its page-in energy, and a page-out once per
tensor) somewhere in that gap. Gaps between uses are disjoint, so each gap with an eviction costs one
restoration.

A recomputation reads its node's inputs. Take a stage t where a tensor is absent and its next
restoration is a recomputation (so it comes after t), and an input of it whose last reader ran before
t (a ReLU's input, once the ReLU is done: "dead" at t). When the recomputation runs, that input is in
RAM. So it is kept in RAM from t on (there it holds its bytes, which the freed tensors' bytes must
cover as well), or paged in after its last use, or absent at t and recomputed after t: that
recomputation reads the input's own dead inputs in turn (a ResNet's ReLU reads an add's output, which
reads a BatchNorm's), down the chain until an input is live or kept. A restoration after the last use
is paid once per tensor, however many recomputations read it; a page-in's credit needs no input.

A recomputation's input that is still live at t (read again later, a ResNet block's input read by its
shortcut) is in RAM when the recomputation runs, at some stage in (t, w], w being the stage whose use
the recomputation serves. If that input is absent at t and again at a binding stage in [w, its next
use), it was restored before the recomputation and must be restored again after that stage: twice in
one gap (``second_restorations``; per stage, "absent here" is then a binary of its own for these
tensors, since a schedule may hold a tensor at one stage of a gap and not at another). A schedule
maps onto these columns with a page-in column set wherever its gap has a page-in (its credit then
needs no input), so the "absent, next restored by recomputation" columns are 1 only where every
restoration of the gap is a recomputation. On resnet18_cifar at 40% on jetsontx2 it lifts the bound
from 17.2 to 24.7 mJ above compute-once. One level deeper: when such a live input x, absent at t, is restored only
by recomputation, that recomputation runs by w and reads x's own live inputs, which are then restored twice in the
same way (MobileNetV2's expand convolution: its BatchNorm's output is recomputed for the ReLU6 and padding that the
depthwise backward reads, and its BatchNorm's backward reads it again). On MobileNetV2 at 30% on jetsontx2 the
second problem then proves +7.87 mJ above compute-once, the first +6.85 mJ. x's recomputation also reads x's dead
inputs, and where those are absent at t and recomputed, their recomputations read their own inputs: the live ones
among them are restored twice in the same way (a ResNet block's output recomputed from its add and BatchNorm, which
read a convolution output its backward reads later). On three residual blocks at 40% of their peak (the tests) this
lifts the bound from 1.50273 to 1.60263 J, the optimum being 1.60293 J.

Deeper still, the same holds down any chain: a tensor recomputed by w reads its inputs, and an input absent at t and
restored only by recomputation is recomputed by w too, live or dead, and reads its own inputs in turn; a live tensor
met on the way, absent at t and again in [w, its next use), is restored twice. hf_bert's head LayerNorm output,
recomputed, reaches the attention product through a dozen live tensors. Columns "x absent at t and recomputed in
(t, w]" for every chain 12 deep make hf_bert's second problem at 30% on m4 too large to close within a solve's time
(15k columns and 27k rows, against 3.3k and 4.9k; it closes after 380 s, at 0.0940497 J, without them in 4.5 s at
0.0915204 J), so they are added where a solved cover needs them: the chains its restorations imply that end in a tensor it
restores once where the chain restores it twice, at stages without room to break the chain for nothing, a few hundred
columns at a time, the problem solved again (with its objective at least the last one's optimum) until its cover
needs none or its time runs out (each round gets all the time left). On hf_bert with one encoder layer at 40% on m4 the
bound rises from 0.0594725 J to 0.0610590 J (the MILP finds 0.0611650 J and proves 0.0610885 J in 120 s), and the
greedy from its cover finds a schedule within 0.2% of it. On the two-layer hf_bert at 30% the second round closes, alone,
in 84 s on jetsontx2 (0.0207913 -> 0.0213892 J) and in 235 s on m4 (0.0915204 -> 0.0940426 J). Each closed round's
evictions start a greedy (:meth:`EvictionCover.starts`), and so does the best cover of a round cut short by the
deadline.

Choosing the cheapest evictions that cover every stage's excess (binaries per tensor and gap, the
recomputation time within the runtime budget) is a small covering problem whose every schedule's
energy is at least its optimum: a relaxation of the MILP. It ignores the RAM a recomputation needs at
its own stage and a stage's other positions, so it is weaker than the MILP's optimum, but it is
integral: where the MILP's LP spreads a large tensor's eviction thinly over many stages, this bound
pays for it whole. Measured: 0.2-0.3 s on traced hf_bert and resnet18_cifar (81 and 105 nodes); on
resnet50 (351) and MobileNetV2 (410) at 30% on m4 it runs to its time limit (given 5 s it returned in
6.3 s, the worker stopped at the deadline), and the bound proven by then is used. It lifts the proven gap where the MILP's own
bound stays near the compute-once energy, and its evictions, realised gap by gap, start the greedy.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.solver.milp import MilpProblem, MilpResult
from host.solver.policy_search import KEEP, PAGE, RECOMPUTE, GreedyStart, KeptGaps

# The covering problem gets at most this long; its best proven bound is used if it is not closed by then. Its
# evictions start the greedy: on resnet50 at 30% on m4 a 15 s cover led to 45.83 J, a 5 s one to 47.30 J; it closes
# in 17.8 s.
EVICTION_BOUND_TIME_LIMIT_S = 20.0
# The dead tensors followed below a recomputed live input, looking for the live inputs its recomputation reads.
_DEAD_PATH_DEPTH = 6
# How deep chains of recomputations (through live and dead tensors) are followed from a live tensor.
_CHAIN_DEPTH = 12
# At most about this many chain columns are added to the covering problem between two solves.
_CHAIN_COLUMNS_PER_ROUND = 400
# HiGHS proves bounds to its tolerances: the extra energy it proves is trusted to this relative margin.
_BOUND_SAFETY_RTOL = 1e-6
# A covering problem whose best cover costs at most this much more than its bound counts as closed.
CLOSED_RTOL = 1e-4


def stage_excess_bytes(priced: PricedGraph, ram_budget_bytes: float) -> tuple[np.ndarray, list[list[int]]]:
    """Per stage: the bytes by which keeping every live tensor exceeds the budget, and those tensors.

    A live tensor of stage t was computed before t, is read by a later stage, is not an input of t, and
    has bytes; the stage's inputs, output and workspace are held whatever the schedule.
    """
    graph = priced.graph
    out_bytes = np.array([node.output_bytes for node in graph.nodes], dtype=float)
    last_use = graph.last_use
    excess = np.zeros(graph.size)
    live: list[list[int]] = []
    for stage, node in enumerate(graph.nodes):
        inputs = set(node.deps)
        held = float(sum(out_bytes[d] for d in inputs) + out_bytes[stage] + node.workspace_bytes)
        candidates = [i for i in range(stage) if i not in inputs and out_bytes[i] > 0 and last_use[i] > stage]
        excess[stage] = held + float(out_bytes[candidates].sum()) - ram_budget_bytes
        live.append(candidates)
    return excess, live


@dataclass
class EvictionCover:
    """The covering problem's answer: its proven bound (J, compute-once energy included) and its evictions."""

    bound_j: float
    # The covering problem was solved: its bound is within CLOSED_RTOL of its best cover's cost (HiGHS may stop at its
    # time limit that close without proving the last digits: MobileNetV2 at 30% on jetsontx2, 0.0045% apart).
    closed: bool = True
    recomputed: set[int] = field(default_factory=set)  # tensors its best cover restores by recomputation
    paged: set[int] = field(default_factory=set)  # tensors its best cover restores by paging
    # (tensor, use stage) for each gap between uses in which the cover does not restore a tensor it evicts elsewhere
    kept_gaps: KeptGaps = frozenset()
    # The covers of the earlier closed rounds (chains of recomputations added between them), latest first
    earlier_rounds: tuple[EvictionCover, ...] = ()
    # The best cover of a later round that did not close by the deadline: a start for the greedy only (its cost is no
    # bound; ``bound_j`` takes only the bound that round proved by then). hf_bert at 30% on jetsontx2, its second
    # round cut at 75 s: the greedy from it 0.0229046 J, the ejection search 0.0222054 J, where the closed round's
    # led to 0.0225106 J.
    unclosed_round: EvictionCover | None = None
    # The first round's columns as HiGHS returned them, where it did not close: a start for solving the same problem
    # again with more time (eviction_cover's ``resume``).
    solution: np.ndarray | None = field(default=None, compare=False, repr=False)

    def start(self, size: int) -> GreedyStart:
        """The evictions as a start for the greedy (host.solver.policy_search): one policy per node (paging
        where the cover pages a tensor at all), applied in the gaps where the cover restores the tensor."""
        policy = [KEEP] * size
        for i in self.recomputed:
            policy[i] = RECOMPUTE
        for i in self.paged:
            policy[i] = PAGE
        return GreedyStart(policy, self.kept_gaps)

    def starts(self, size: int) -> list[GreedyStart]:
        """Every distinct start with evictions: this cover's, the earlier rounds', then the unclosed round's. A later
        round's cover costs more and is nearer a schedule, yet the greedy from it can land higher: hf_bert at 30% on m4
        given 600 s, 0.0977507 J from the second round's cover, 0.0968821 J from the first's."""
        found: list[GreedyStart] = []
        unclosed = () if self.unclosed_round is None else (self.unclosed_round,)
        for cover in (self, *self.earlier_rounds, *unclosed):
            start = cover.start(size)
            if (cover.recomputed or cover.paged) and start not in found:
                found.append(start)
        return found


@dataclass
class _CoverModel:
    """A covering problem built, with the columns a solved cover is read from."""

    problem: MilpProblem
    restore: dict[tuple[int, int], list[int]]  # (tensor, gap between uses) -> [recompute col, page-in col]
    recompute_cols: dict[int, int]  # column -> tensor
    page_in_cols: dict[int, int]  # column -> tensor
    second: dict[tuple[int, int], list[int]]  # (tensor, gap) -> the columns of a second restoration
    absent_var: dict[tuple[int, int], int]  # (stage, tensor) -> "absent here, next restored by recomputation"
    chained: dict[tuple[int, int, int], int]  # (stage, deadline, tensor) -> "absent here, recomputed by the deadline"
    stage_rows: dict[int, tuple[list[tuple[int, float]], float]]  # stage -> RAM row: terms and excess (budget shares)


def _violated_chains(model: _CoverModel, x: np.ndarray, links: list[tuple[int, int, int, int, int]],
                     chain_roots: set[tuple[int, int, int]], uses: list[list[int]],
                     last_use: list[int], byte_shares: list[float], active: set[tuple[int, int, int]],
                     most: int) -> set[tuple[int, int, int]]:
    """The chain columns a solved cover needs: those on a chain of recomputations, read from the cover's restorations
    (columns the problem lacks are taken as the cover's restorations imply: a tensor it restores in a gap only by
    recomputation is absent and recomputed there), that ends in a tensor it restores once where the chain restores it
    twice. Each chain is traced back to its root: adding its columns makes the next problem pay, or break the chain.
    A chain at a stage whose RAM row has room for one of its tensors (``byte_shares``: bytes as budget shares) is left
    out: the cover breaks it there for nothing."""

    def slack(stage: int) -> float:
        terms, excess_share = model.stage_rows[stage]
        return sum(coef * float(x[col]) for col, coef in terms) - excess_share

    def recomputed_only(stage: int, tensor: int) -> float:
        col = model.absent_var.get((stage, tensor))
        if col is not None:
            return float(x[col])
        gap = len(uses[tensor]) if last_use[tensor] < stage else int(np.searchsorted(uses[tensor], stage))
        cols = model.restore.get((tensor, gap), []) + model.second.get((tensor, gap), [])
        if any(x[col] > 0.5 for col in cols if col not in model.recompute_cols):
            return 0.0
        return float(min(1.0, sum(x[col] for col in cols if col in model.recompute_cols)))

    value = {(stage, by, root): recomputed_only(stage, root) for stage, by, root in chain_roots}
    parent: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    violated: list[tuple[float, list[tuple[int, int, int]]]] = []  # (the stage's room, the chain's columns)
    # ``links`` come readers first, so each tensor's value is final before its inputs are read.
    for stage, by, reader, d, next_use in links:
        if value.get((stage, by, reader), 0.0) < 0.5:
            continue
        if next_use >= 0:
            gap = (d, int(np.searchsorted(uses[d], stage)))
            restored = sum(x[col] for col in model.restore.get(gap, []))
            if restored > 0.5 and sum(x[col] for col in model.second.get(gap, [])) < 0.5:
                path, key = [], (stage, by, reader)
                while key not in chain_roots:
                    path.append(key)
                    key = parent[key]
                room = slack(stage)
                if room < min(byte_shares[tensor] for tensor in (d, key[2], *(k[2] for k in path))):
                    violated.append((room, path))
        elif (stage, by, d) not in chain_roots and value.get((stage, by, d), 0.0) < 0.5:
            if recomputed_only(stage, d) > 0.5:
                value[stage, by, d] = 1.0
                parent[stage, by, d] = (stage, by, reader)
    # The chains at the tightest stages first, up to about ``most`` new columns: all at once, hf_bert's second problem
    # grows from 3.2k to 6k columns and does not close in 120 s.
    needed: set[tuple[int, int, int]] = set()
    for _, path in sorted(violated, key=lambda item: item[0]):
        if len(needed) >= most:
            break
        needed.update(key for key in path if key not in active)
    return needed


def is_closed(result: MilpResult) -> bool:
    """Whether a covering problem's result is solved: optimal, or its best cover within CLOSED_RTOL of its bound."""
    if result.status == "optimal":
        return True
    if result.objective is None or result.bound is None:
        return False
    return result.objective - result.bound <= CLOSED_RTOL * abs(result.objective)


def eviction_bound_j(priced: PricedGraph, ram_budget_bytes: float, runtime_budget_s: float | None, *,
                     remat: bool = True, paging: bool = True, paging_in_runtime: bool = False,
                     time_limit_s: float = EVICTION_BOUND_TIME_LIMIT_S,
                     second_restorations: bool = False) -> float | None:
    """A lower bound on the energy (J) of every schedule within the budgets, compute-once energy included.

    None when the covering problem has no solution (then no schedule fits either; the MILP says why) or
    when HiGHS proves nothing within ``time_limit_s``.
    """
    cover = eviction_cover(priced, ram_budget_bytes, runtime_budget_s, remat=remat, paging=paging,
                           paging_in_runtime=paging_in_runtime, time_limit_s=time_limit_s,
                           second_restorations=second_restorations)
    return None if cover is None else cover.bound_j


def eviction_cover(priced: PricedGraph, ram_budget_bytes: float, runtime_budget_s: float | None, *,
                   remat: bool = True, paging: bool = True, paging_in_runtime: bool = False,
                   time_limit_s: float = EVICTION_BOUND_TIME_LIMIT_S,
                   second_restorations: bool = False, cancel: threading.Event | None = None,
                   resume: EvictionCover | None = None,
                   on_closed_round: Callable[[EvictionCover], None] | None = None) -> EvictionCover | None:
    """The covering problem solved (see the module docstring); None as for :func:`eviction_bound_j`.

    ``resume``: an unclosed cover of the same problem (same graph, budgets and options, no second restorations), whose
    best cover starts HiGHS this time; the bound returned is at least the one it proved.

    ``cancel`` set (the solve stopped it from another thread) stops it as Ctrl-C does: KeyboardInterrupt.

    ``on_closed_round``: called (on this thread) with the cover so far each time a round closes, before the next
    round starts, so that a caller on another thread can use its bound and evictions at once (the later rounds of
    chains of recomputations can take the rest of the time).

    With ``second_restorations``, a tensor that a recomputation reads between two stages where it is absent is
    restored twice there (see the module docstring): a higher bound from a larger problem (resnet18_cifar at 40%
    on jetsontx2: 7.4k columns and 10k rows against 5.3k and 5.8k, solved in 3.5 s against 0.3 s).
    """
    from host.solver.backends.highs import solve_highs  # HiGHS solves in its worker process, as the MILP does

    graph = priced.graph
    compute_once_j = float(priced.compute_j.sum())
    excess, live = stage_excess_bytes(priced, ram_budget_bytes)
    binding = [stage for stage in range(graph.size) if excess[stage] > 0]
    if not binding:
        return EvictionCover(compute_once_j)
    if not (remat or paging):
        return None
    out_bytes = [node.output_bytes for node in graph.nodes]
    last_use = graph.last_use
    uses = [sorted(set(users)) for users in graph.successors]
    costs = np.concatenate([priced.compute_j, priced.page_in_j, priced.page_out_j])
    cost_scale_j = float(costs[costs > 0].max()) if (costs > 0).any() else 1.0

    def dead_inputs(i: int, stage: int) -> list[int]:
        """Inputs of ``i`` with bytes whose last reader ran before ``stage``: none if recomputation is off."""
        return [d for d in dict.fromkeys(graph.nodes[i].deps) if out_bytes[d] > 0 and last_use[d] < stage] if remat else []

    def chain_of(stage: int) -> dict[int, int]:
        """Tensors whose recomputation after ``stage`` the stage's evictions may demand (live roots and, below them,
        their dead inputs), each with the latest stage by which that recomputation has run."""
        reach: dict[int, int] = {}
        for i in live[stage]:
            if not remat:
                break
            use = uses[i][int(np.searchsorted(uses[i], stage))]
            stack = [i]
            while stack:
                x = stack.pop()
                if reach.get(x, -1) >= use:
                    continue
                reach[x] = use
                stack.extend(dead_inputs(x, stage))
        return reach

    # A recomputation of x after stage t (by stage w) that reads a tensor d live at t holds d at some stage in
    # (t, w]. If d is absent at t and again at a binding stage t' in [w, d's next use), d is restored twice in that
    # gap. Rules: (t, x, d, w, d's next use after t).
    binding_set = set(binding)
    live_sets = {stage: set(live[stage]) for stage in binding}
    rules: list[tuple[int, int, int, int, int]] = []  # (t, x, d, w, d's next use after t)
    windows: dict[tuple[int, int, int], list[int]] = {}  # (d, w, next use) -> the binding stages of [w, next use)

    def window_of(d: int, by: int, next_use: int) -> list[int]:
        if (d, by, next_use) not in windows:
            windows[d, by, next_use] = [later for later in range(by, next_use) if later in binding_set]
        return windows[d, by, next_use]

    for stage in binding if second_restorations else []:
        for x, by in chain_of(stage).items():
            for d in dict.fromkeys(graph.nodes[x].deps):
                if d not in live_sets[stage]:
                    continue
                next_use = uses[d][int(np.searchsorted(uses[d], stage))]
                if window_of(d, by, next_use):
                    rules.append((stage, x, d, by, next_use))
    # One level deeper: the recomputation of x (live at t, read by y's recomputation after t, by w) runs by w when x
    # is absent at t and restored only by recomputation, and reads x's own input d (live at t). If d is absent at t
    # and again at a binding stage in [w, d's next use), d is restored twice in that gap: MobileNetV2's expand
    # convolution, read by its BatchNorm's recomputation for the ReLU6 and padding the depthwise backward reads,
    # and again by its BatchNorm's backward. Rules: (t, y, x, d, w, d's next use after t).
    # x's recomputation also reads x's dead inputs, restored by w; where those are recomputed they read their own
    # inputs in turn, so d may be an input of a dead tensor below x: the rule's chain then lists that path.
    deeper: list[tuple[int, tuple[int, ...], int, int, int]] = []  # (t, chain y, x, dead path..., d, w, next use)
    for stage, y, x, by, _ in rules:
        paths = [(x,)]
        while paths:
            path = paths.pop()
            for d in dict.fromkeys(graph.nodes[path[-1]].deps):
                if d in (y, *path) or out_bytes[d] == 0:
                    continue
                if d not in live_sets[stage]:
                    if remat and last_use[d] < stage and len(path) < _DEAD_PATH_DEPTH:
                        paths.append((*path, d))
                    continue
                next_use = uses[d][int(np.searchsorted(uses[d], stage))]
                if window_of(d, by, next_use):
                    deeper.append((stage, (y, *path), d, by, next_use))
    # Deeper: a recomputation of x by w (x absent at t) reads x's inputs. An input d absent at t whose every
    # restoration in its gap is a recomputation is recomputed by w as well, and reads its own inputs in turn, down the
    # graph through live and dead tensors alike. Columns "x is absent at t and recomputed in (t, w]", one per stage,
    # deadline and tensor (a live tensor's own "absent, restored by recomputation" column at its next use). A live
    # input d of such an x, absent at t and again at a binding stage in [w, d's next use), is restored twice in that
    # gap: MobileNetV2's expand convolution, read by its BatchNorm's recomputation for the ReLU6 and padding the
    # depthwise backward reads, and again by its BatchNorm's backward; hf_bert's attention products, read by the
    # recomputations below its head's LayerNorm. Links (t, w, x, d, d's next use after t, or -1 for "d recomputed by w
    # too"), parents before their inputs.
    links: list[tuple[int, int, int, int, int]] = []
    chain_roots: set[tuple[int, int, int]] = set()  # (t, w, x): x live at t and next used at w

    def walk_chains() -> None:
        """Fill ``links`` (readers first: inputs precede their readers) and ``chain_roots``; walked once, after the
        first problem closes (1.6-1.9 s on MobileNetV2 and resnet50)."""
        for stage in binding:
            inputs_here = set(graph.nodes[stage].deps)
            frontier: list[tuple[int, int, int]] = []  # (deadline, tensor, depth)
            for y in live[stage]:
                by = uses[y][int(np.searchsorted(uses[y], stage))]
                chain_roots.add((stage, by, y))
                frontier.append((by, y, 0))
            linked: set[tuple[int, int, int, int, int]] = set()
            reached: set[tuple[int, int, int]] = set()
            while frontier:
                by, x, depth = frontier.pop()
                for d in dict.fromkeys(graph.nodes[x].deps):
                    if out_bytes[d] == 0 or d in inputs_here:
                        continue
                    if d in live_sets[stage]:
                        next_use = uses[d][int(np.searchsorted(uses[d], stage))]
                        if depth > 0 and window_of(d, by, next_use) and (stage, by, x, d, next_use) not in linked:
                            linked.add((stage, by, x, d, next_use))  # depth 0: the first rules above
                            links.append((stage, by, x, d, next_use))
                    elif last_use[d] >= stage:
                        continue
                    if (stage, by, d) in chain_roots or depth + 1 >= _CHAIN_DEPTH:
                        continue
                    if (stage, by, x, d, -1) not in linked:
                        linked.add((stage, by, x, d, -1))
                        links.append((stage, by, x, d, -1))
                    if (stage, by, d) not in reached:
                        reached.add((stage, by, d))
                        frontier.append((by, d, depth + 1))
        links.sort(key=lambda link: (link[0], link[1], -link[2]))

    def build(active: set[tuple[int, int, int]]) -> _CoverModel:
        """The covering problem with the chain columns of ``active`` (see :func:`_violated_chains`)."""
        problem = MilpProblem("eviction bound")
        restore: dict[tuple[int, int], list[int]] = {}  # (tensor, gap between uses) -> [recompute col, page-in col]
        recompute_cols: dict[int, int] = {}  # column -> tensor
        page_in_cols: dict[int, int] = {}
        page_out_col: dict[int, int] = {}
        recompute_time: list[tuple[int, float]] = []
        paging_time: list[tuple[int, float]] = []

        def restoration_cols(i: int) -> list[int]:
            """New columns restoring tensor ``i`` once: recomputed or paged in (a page-in reads the tensor's page-out)."""
            cols = []
            if remat:
                col = problem.add_var(cost=priced.compute_j[i] / cost_scale_j)
                recompute_time.append((col, float(priced.compute_s[i])))
                recompute_cols[col] = i
                cols.append(col)
            if paging:
                col = problem.add_var(cost=priced.page_in_j[i] / cost_scale_j)
                paging_time.append((col, float(priced.page_in_s[i])))
                page_in_cols[col] = i
                if i not in page_out_col:
                    page_out_col[i] = problem.add_var(cost=priced.page_out_j[i] / cost_scale_j)
                    paging_time.append((page_out_col[i], float(priced.page_out_s[i])))
                problem.add_row([(col, 1.0), (page_out_col[i], -1.0)], ub=0.0)
                cols.append(col)
            return cols

        def restoration(i: int, gap: int) -> list[int]:
            """Columns restoring tensor ``i`` once in ``gap``: before its use ``uses[i][gap]``, or after its last
            use when ``gap == len(uses[i])`` (for a recomputation that reads it); recomputed or paged in."""
            if (i, gap) not in restore:
                restore[i, gap] = cols = restoration_cols(i)
                if len(cols) > 1:
                    problem.add_row([(col, 1.0) for col in cols], ub=1.0)
            return restore[i, gap]

        second: dict[tuple[int, int], list[int]] = {}  # (tensor, gap) -> the columns of a second restoration
        doubled = [(stage, d, by, next_use) for stage, _, d, by, next_use in rules]
        # The links in use: the chain columns of ``active`` and the tensors they read.
        chain_links = [(stage, by, x, d, next_use) for stage, by, x, d, next_use in links
                       if ((stage, by, x) in chain_roots or (stage, by, x) in active)
                       and (next_use >= 0 or (stage, by, d) in active)]
        doubled += [(stage, d, by, next_use) for stage, _, d, by, next_use in deeper]
        doubled += [(stage, d, by, next_use) for stage, by, _, d, next_use in chain_links if next_use >= 0]
        credited = {(stage, d) for stage, d, _, _ in doubled} | {(later, d) for _, d, *window in doubled
                                                                for later in windows[(d, *window)]}
        for stage, d, _, _ in doubled:
            key = (d, int(np.searchsorted(uses[d], stage)))
            if key not in second:
                first = restoration(*key)
                second[key] = restoration_cols(d)
                # a second restoration needs a first (and so is one at most)
                problem.add_row([(col, 1.0) for col in second[key]] + [(col, -1.0) for col in first], ub=0.0)
        rule_readers = {(stage, x) for stage, x, *_ in rules} | {(stage, chain[1]) for stage, chain, *_ in deeper}
        rule_readers |= {(stage, x) for stage, _, x, *_ in chain_links}
        credit_var: dict[tuple[int, int], int] = {}  # (stage, tensor) -> "absent here" for the rules' tensors
        stage_rows: dict[int, tuple[list[tuple[int, float]], float]] = {}  # stage -> its RAM row: terms, excess
        absent_var: dict[tuple[int, int], int] = {}  # (stage, tensor) -> "absent here, next restored by recomputation"

        for stage in binding:
            terms: list[tuple[int, float]] = []
            # Dead tensor d -> the columns of which one holds when a recomputation after this stage reads d: "d is in
            # RAM here" (debits d's bytes), d paged in after its last use, "d absent here and recomputed after".
            covering: dict[int, list[tuple[int, float]]] = {}

            # (column, tensor i): "i is absent here and recomputed after this stage"
            pending: list[tuple[int, int]] = []
            for i in live[stage]:
                gap = int(np.searchsorted(uses[i], stage))  # the next use after ``stage`` ends the gap
                cols = restoration(i, gap) + second.get((i, gap), [])
                credit: list[int] = []
                recompute_here = [col for col in cols if col in recompute_cols]
                if recompute_here and (dead_inputs(i, stage) or (stage, i) in rule_readers):
                    # "i absent here, and its next restoration is a recomputation" (a page-in's column credits i
                    # directly, even where i is present: more credit only relaxes the row).
                    absent = problem.add_var(integer=False)
                    problem.add_row([(absent, 1.0)] + [(col, -1.0) for col in recompute_here], ub=0.0)
                    absent_var[stage, i] = absent
                    credit.append(absent)
                    if dead_inputs(i, stage):
                        pending.append((absent, i))
                else:
                    credit += recompute_here
                credit += [col for col in cols if col not in recompute_cols]
                if (stage, i) in credited or (i, gap) in second:
                    var = problem.add_var(integer=True)
                    problem.add_row([(var, 1.0)] + [(col, -1.0) for col in credit], ub=0.0)
                    credit_var[stage, i] = var
                    credit = [var]
                terms += [(col, out_bytes[i] / ram_budget_bytes) for col in credit]
            # A recomputation of i after this stage reads i's dead inputs. Each such d is then in RAM here (kept),
            # paged in after its last use, or absent here and recomputed after this stage too, which reads d's own
            # dead inputs in turn (inputs precede their readers, so the walk ends).
            while pending:
                absent, i = pending.pop()
                for d in dead_inputs(i, stage):
                    if d not in covering:
                        kept = problem.add_var(integer=False)
                        terms.append((kept, -out_bytes[d] / ram_budget_bytes))
                        covering[d] = [(kept, 1.0)]
                        for col in restoration(d, len(uses[d])):
                            if col in recompute_cols:
                                later = problem.add_var(integer=False)
                                problem.add_row([(later, 1.0), (col, -1.0)], ub=0.0)
                                absent_var[stage, d] = later
                                covering[d].append((later, 1.0))
                                pending.append((later, d))
                            else:
                                covering[d].append((col, 1.0))
                    problem.add_row(covering[d] + [(absent, -1.0)], lb=0.0)
            problem.add_row(terms, lb=float(excess[stage]) / ram_budget_bytes)
            stage_rows[stage] = (terms, float(excess[stage]) / ram_budget_bytes)
        # d absent at some binding stage of [w, d's next use): one column per window, shared by the stages t before w.
        absent_later: dict[tuple[int, int, int], int] = {}

        def restored_twice(stage: int, d: int, window: tuple[int, int, int], recomputed_after: list[int]) -> None:
            """d absent at ``stage``, the recomputations ``recomputed_after`` after it, and d absent in ``window``:
            a second restoration of d."""
            if window not in absent_later:
                absent_later[window] = var = problem.add_var(integer=True)
                for later_stage in windows[window]:
                    problem.add_row([(credit_var[later_stage, d], 1.0), (var, -1.0)], ub=0.0)
            key = (d, int(np.searchsorted(uses[d], stage)))
            problem.add_row([(credit_var[stage, d], 1.0), (absent_later[window], 1.0)]
                            + [(col, 1.0) for col in recomputed_after] + [(col, -1.0) for col in second[key]],
                            ub=1.0 + len(recomputed_after))

        for stage, x, d, by, next_use in rules:
            recomputed_after = absent_var.get((stage, x))
            if recomputed_after is None:
                continue  # x is not recomputed after this stage in any cover (it has no recompute column there)
            restored_twice(stage, d, (d, by, next_use), [recomputed_after])
        for stage, chain, d, by, next_use in deeper:
            chain_cols = [absent_var.get((stage, tensor)) for tensor in chain]
            if None not in chain_cols:
                restored_twice(stage, d, (d, by, next_use), chain_cols)
        chained: dict[tuple[int, int, int], int] = {}  # (t, w, x) -> "x absent at t and recomputed in (t, w]"
        for key in chain_roots:
            if (key[0], key[2]) in absent_var:
                chained[key] = absent_var[key[0], key[2]]
        for stage, by, x, d, next_use in chain_links:
            reader = chained.get((stage, by, x))
            if reader is None:
                continue  # x is not recomputed after this stage in any cover
            if next_use >= 0:
                restored_twice(stage, d, (d, by, next_use), [reader])
                continue
            restored_by_recomputation = absent_var.get((stage, d))
            if restored_by_recomputation is None or (stage, by, d) in chain_roots:
                continue
            if (stage, by, d) not in chained:
                chained[stage, by, d] = problem.add_var(integer=False)
            # x recomputed by ``by`` reads d; d absent here and restored only by recomputation: d recomputed by ``by``
            problem.add_row([(chained[stage, by, d], 1.0), (reader, -1.0), (restored_by_recomputation, -1.0)], lb=-1.0)
        if runtime_budget_s is not None:
            timed = recompute_time + (paging_time if paging_in_runtime else [])
            slack_s = runtime_budget_s - priced.base_runtime_s
            if timed and any(seconds > 0 for _, seconds in timed):
                problem.add_row_unit_scaled([(col, s) for col, s in timed if s > 0], ub=slack_s)

        return _CoverModel(problem, restore, recompute_cols, page_in_cols, second, absent_var, chained, stage_rows)

    # Chain columns are added where a solved cover needs them (see :func:`_violated_chains`), and the problem solved
    # again, until its cover needs none (see the module docstring).
    # HiGHS does not check its own time limit inside every root-node phase (with its analytic-centre computation,
    # resnet50 at 30% on m4 ran 12.8 s under a 5 s limit): the deadline stops the worker, keeping the bound and
    # cover it reported.
    deadline_at = time.perf_counter() + max(0.1, time_limit_s)
    active: set[tuple[int, int, int]] = set()
    best: EvictionCover | None = None
    proven = None  # the last problem's proven optimum (scaled): every later problem, with more rows, costs at least it
    while True:
        model = build(active)
        if proven is not None:
            model.problem.add_row([(col, cost) for col, cost in enumerate(model.problem.col_cost) if cost],
                                  lb=proven * (1 - _BOUND_SAFETY_RTOL))
        # A round with chain columns gets all the time left: alone, hf_bert at 30% on jetsontx2 closes its second round
        # in 84 s (9.3 s the first), on m4 in 235 s (4.5 s), each 2.7-2.9% above the first; where it does not close,
        # the bound it proved by the deadline is kept.
        round_s = max(0.1, deadline_at - time.perf_counter())
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt
        start = None if resume is None or active else resume.solution
        if start is not None and len(start) != len(model.problem.col_cost):
            start = None  # not a cover of this problem
        result = solve_highs(model.problem, time_limit_s=round_s, mip_gap=1e-9, threads=1, presolve=True, start=start,
                             deadline_at=time.perf_counter() + round_s, cancel=cancel)
        if result.interrupted:
            raise KeyboardInterrupt  # the user stopped the solve while its bound was proven: stop as in any phase
        if result.status == "infeasible" or result.bound is None:
            return best
        extra_j = max(0.0, float(result.bound)) * cost_scale_j * (1 - _BOUND_SAFETY_RTOL)
        cover = EvictionCover(max(compute_once_j + extra_j, resume.bound_j if resume else 0.0), closed=is_closed(result))
        if not active and not cover.closed:
            cover.solution = result.x
        if result.x is not None:
            cover.recomputed = {i for col, i in model.recompute_cols.items() if result.x[col] > 0.5}
            cover.paged = {i for col, i in model.page_in_cols.items() if result.x[col] > 0.5}
            restored = {key for key, cols in model.restore.items() if any(result.x[col] > 0.5 for col in cols)}
            cover.kept_gaps = frozenset((i, use) for i in cover.recomputed | cover.paged
                                        for gap, use in enumerate(uses[i]) if (i, gap) not in restored)
        # The evictions of the last problem solved (an unsolved one's best cover may be far from its bound; ``closed``
        # stays true), with the highest bound proven; an unsolved round's best cover is kept as a start of its own
        # (its cost is no bound).
        if best is None or cover.closed:
            earlier_rounds = () if best is None else (
                dataclasses.replace(best, earlier_rounds=(), unclosed_round=None), *best.earlier_rounds)
            best = dataclasses.replace(cover, bound_j=max(cover.bound_j, best.bound_j if best else 0.0),
                                       earlier_rounds=earlier_rounds)
        else:
            best = dataclasses.replace(best, bound_j=max(cover.bound_j, best.bound_j), unclosed_round=cover)
        if cover.closed and on_closed_round is not None:
            on_closed_round(best)
        if not (second_restorations and remat and cover.closed and result.x is not None):
            return best
        if not chain_roots:
            walk_chains()
        if not links or time.perf_counter() >= deadline_at:
            return best
        proven = max(proven or 0.0, float(result.bound))
        needed = _violated_chains(model, result.x, links, chain_roots, uses, last_use,
                                  [size / ram_budget_bytes for size in out_bytes], active, _CHAIN_COLUMNS_PER_ROUND)
        if not needed:
            return best
        active |= needed


