"""A fast heuristic schedule: one policy per tensor (keep, page, or recompute), chosen greedily.

It seeds the MILP with a good incumbent (a warm start), so the solver spends its time proving
rather than searching. Each tensor's policy applies to every gap between two consecutive stages
that need it: keep it in RAM, page it out and back in, or drop it and recompute it where needed,
except in the gaps the plan keeps it anyway (``kept_gaps``: a start may say where, e.g. the
eviction bound's cover, and the local search keeps a tensor across single gaps where that fits).
Tensors are evicted greedily from the stage that exceeds the budget most, choosing the move that
frees the most byte-stages per joule, until every stage fits the MILP's memory model. The candidates
are the tensors held across that stage and those it recomputes: where a recomputation chain is what
peaks there, keeping or paging one of its tensors instead relieves it (the traced hf_bert at 30% of
its peak on m4: the greedy from the eviction cover got stuck, and now reaches 0.09688 J, 5.5% above
the bound, where the plain greedy's 0.10271 J was the answer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.solver.deadline import Deadline
from host.solver.poet_milp import stage_memory
from host.solver.stage_plan import StagePlan

KEEP, PAGE, RECOMPUTE, RECOMPUTE_ONCE = "keep", "page", "recompute", "recompute-once"

# (tensor, stage): the tensor is kept in RAM across its gap that ends at that stage, which needs it,
# whatever its policy.
KeptGaps = frozenset[tuple[int, int]]


@dataclass(frozen=True)
class GreedyStart:
    """Where the greedy starts: one policy per node, and the gaps in which an evicted tensor is kept anyway."""

    policy: list[str]
    kept_gaps: KeptGaps = frozenset()


def plan_from_policies(priced: PricedGraph, policy: list[str], kept_gaps: KeptGaps = frozenset()) -> StagePlan:
    """The stage plan that realises one policy per node and the kept gaps (see module docstring)."""
    graph = priced.graph
    size = graph.size
    deps = [n.deps for n in graph.nodes]
    plan = StagePlan.empty(size)
    # needed_at[i]: stages whose computations read node i (directly or through a recompute)
    needed_at: list[set[int]] = [set() for _ in range(size)]
    recomputed_at: list[set[int]] = [set() for _ in range(size)]
    # Stages are visited in order, so the last stage that needed d before this one is the last recorded.
    last_needed = list(range(size))
    for stage in range(size):
        stack = list(deps[stage])
        while stack:
            d = stack.pop()
            if stage in needed_at[d]:
                continue
            needed_at[d].add(stage)
            last_before = last_needed[d]
            last_needed[d] = stage
            recompute_here = policy[d] == RECOMPUTE or (policy[d] == RECOMPUTE_ONCE and not recomputed_at[d])
            if recompute_here and stage - last_before > 1 and (d, stage) not in kept_gaps:
                recomputed_at[d].add(stage)
                stack.extend(deps[d])
    # Recomputed nodes are computed in their stage; their uses in that stage need no carry-over.
    for i in range(size):
        for stage in recomputed_at[i]:
            plan.recompute[stage, i] = True
        uses = sorted(needed_at[i])
        previous = i
        paged_out = False
        for stage in uses:
            if stage in recomputed_at[i]:
                previous = stage
                continue
            if policy[i] == PAGE and stage > previous + 1 and (i, stage) not in kept_gaps:
                if not paged_out:
                    plan.page_out[previous, i] = True
                    paged_out = True
                plan.keep_flash[previous + 1 : stage, i] = True
                plan.page_in[stage - 1, i] = True
                plan.keep_ram[stage, i] = True
            else:  # kept across the gap (recomputed gaps were handled above)
                plan.keep_ram[previous + 1 : stage + 1, i] = True
            previous = stage
    # A flash copy lives from its page-out to its last page-in.
    for i in range(size):
        if policy[i] != PAGE or not plan.page_out[:, i].any():
            continue
        first = int(np.flatnonzero(plan.page_out[:, i])[0])
        last_in = int(np.flatnonzero(plan.page_in[:, i])[-1]) if plan.page_in[:, i].any() else first
        plan.keep_flash[first + 1 : last_in + 1, i] = True
    return plan


def model_stage_peaks(plan: StagePlan, priced: PricedGraph) -> np.ndarray:
    """Peak RAM per stage under the MILP's memory model (host.solver.poet_milp, constraint 5).

    A stage that computes only its own node peaks at what it keeps plus that node's output; only
    stages with recomputations replay the memory model step by step.
    """
    graph = priced.graph
    output_bytes = np.array([n.output_bytes for n in graph.nodes], dtype=float)
    workspace_bytes = np.array([n.workspace_bytes for n in graph.nodes], dtype=float)
    peaks = np.tril(plan.keep_ram, -1) @ output_bytes + output_bytes + workspace_bytes
    for t in np.flatnonzero(plan.recompute.sum(axis=1) > 1):
        start_bytes, events = stage_memory(plan, graph, int(t))
        peaks[t] = max([start_bytes] + [after + graph.nodes[k].workspace_bytes for k, after, _ in events])
    return peaks


def plan_energy_j(plan: StagePlan, priced: PricedGraph) -> float:
    return float(
        (plan.recompute.sum(axis=0) * priced.compute_j).sum()
        + (plan.page_in.sum(axis=0) * priced.page_in_j).sum()
        + (plan.page_out.sum(axis=0) * priced.page_out_j).sum()
    )


def plan_runtime_s(plan: StagePlan, priced: PricedGraph, paging_in_runtime: bool) -> float:
    runtime = float((plan.recompute.sum(axis=0) * priced.compute_s).sum())
    if paging_in_runtime:
        runtime += float((plan.page_in.sum(axis=0) * priced.page_in_s).sum())
        runtime += float((plan.page_out.sum(axis=0) * priced.page_out_s).sum())
    return runtime


def greedy_policy_plan(priced: PricedGraph, ram_budget_bytes: float, runtime_budget_s: float | None,
                       **options) -> StagePlan | None:
    """:func:`greedy_policy_search`'s plan alone (``options`` are its keyword arguments)."""
    found = greedy_policy_search(priced, ram_budget_bytes, runtime_budget_s, **options)
    return None if found is None else found[0]


def greedy_policy_search(
    priced: PricedGraph,
    ram_budget_bytes: float,
    runtime_budget_s: float | None,
    *,
    paging: bool = True,
    remat: bool = True,
    paging_in_runtime: bool = False,
    max_moves: int | None = None,
    candidate_limit: int = 20,
    relief_exponent: float = 1.5,
    deadline: Deadline | None = None,
    start: GreedyStart | None = None,
) -> tuple[StagePlan, GreedyStart] | None:
    """Greedy eviction until every stage fits, then the local search: (plan, the policies and kept gaps it realises,
    a start for :func:`ejection_search`), or None if it gets stuck or ``deadline`` passes first.

    The search starts from ``start`` (default: keep everything). Once every stage fits, the local
    search that follows stops at ``deadline`` with the plan it has.
    """
    deadline = deadline or Deadline.none()
    moves = _moves(paging, remat)
    if not moves:
        return None
    policy = list(start.policy) if start is not None else [KEEP] * priced.graph.size
    kept = start.kept_gaps if start is not None else frozenset()
    evicted = _evict_until_fit(priced, policy, kept, ram_budget_bytes, moves, deadline,
                               max_moves=max_moves, candidate_limit=candidate_limit, relief_exponent=relief_exponent)
    if evicted is None:
        return None
    plan, kept = _improve(priced, policy, *evicted, ram_budget_bytes, [KEEP, *moves], deadline, runtime_budget_s,
                          paging_in_runtime)
    if not _within_runtime(plan, priced, runtime_budget_s, paging_in_runtime):
        return None
    return plan, GreedyStart(policy, kept)


def _allowed(priced: PricedGraph, i: int, move: str) -> bool:
    """Whether tensor ``i`` may take policy ``move``: the policies never recompute a backward node."""
    return not (move in (RECOMPUTE, RECOMPUTE_ONCE) and priced.graph.nodes[i].kind == "bwd")


def _within_runtime(plan: StagePlan, priced: PricedGraph, runtime_budget_s: float | None,
                    paging_in_runtime: bool) -> bool:
    return runtime_budget_s is None or plan_runtime_s(plan, priced, paging_in_runtime) <= runtime_budget_s


def _moves(paging: bool, remat: bool) -> list[str]:
    return ([PAGE] if paging else []) + ([RECOMPUTE, RECOMPUTE_ONCE] if remat else [])


def _evict_until_fit(priced: PricedGraph, policy: list[str], kept: KeptGaps, ram_budget_bytes: float,
                     moves: list[str], deadline: Deadline, *, held_in_ram: frozenset[int] = frozenset(),
                     max_moves: int | None = None, candidate_limit: int = 20,
                     relief_exponent: float = 1.5) -> tuple[KeptGaps, StagePlan] | None:
    """Evict tensors greedily (``policy`` updated in place) until every stage fits: (kept gaps, plan), or None if
    it gets stuck or ``deadline`` passes. The tensors in ``held_in_ram`` are never evicted."""
    graph = priced.graph
    tabu: set[tuple[int, str]] = set()
    plan = plan_from_policies(priced, policy, kept)
    peaks = model_stage_peaks(plan, priced)
    energy = plan_energy_j(plan, priced)
    for _ in range(max_moves or 4 * graph.size):
        excess = np.maximum(peaks - ram_budget_bytes, 0.0)
        if excess.max() <= 0:
            return kept, plan
        worst = int(np.argmax(excess))
        # Candidates: tensors held across the worst stage, largest byte-stages held first.
        held = [i for i in range(worst) if plan.keep_ram[worst, i] and graph.nodes[i].output_bytes > 0
                and i not in held_in_ram]
        held.sort(key=lambda i: -graph.nodes[i].output_bytes * int(plan.keep_ram[:, i].sum()))
        present = held[:candidate_limit]
        # Tensors recomputed in the worst stage: their recomputation chain can be what peaks there, which keeping
        # or paging them (instead of recomputing) relieves.
        present += [int(i) for i in np.flatnonzero(plan.recompute[worst, :worst])
                     if int(i) not in held_in_ram and int(i) not in present]
        best = None
        for i in present:
            if deadline.expired():
                return None
            for move in [KEEP, *moves] if plan.recompute[worst, i] else moves:
                if (move == policy[i] and not _kept_anywhere(kept, i)) or (i, move) in tabu:
                    continue
                if not _allowed(priced, i, move):
                    continue
                trial_policy = list(policy)
                trial_policy[i] = move
                trial_kept = _evicted_in_every_gap(kept, i)
                trial = plan_from_policies(priced, trial_policy, trial_kept)
                trial_peaks = model_stage_peaks(trial, priced)
                relief = float(excess.sum() - np.maximum(trial_peaks - ram_budget_bytes, 0.0).sum())
                if relief <= 0:
                    continue
                cost = plan_energy_j(trial, priced) - energy
                score = relief**relief_exponent / max(cost, 1e-12)
                if best is None or score > best[0]:
                    best = (score, i, move, trial_kept, trial, trial_peaks)
        if best is None:
            return None
        _, i, move, kept, plan, peaks = best
        policy[i] = move
        tabu.add((i, move))
        energy = plan_energy_j(plan, priced)
    return None


def ejection_search(priced: PricedGraph, found: tuple[StagePlan, GreedyStart], ram_budget_bytes: float,
                    runtime_budget_s: float | None, *, paging: bool = True, remat: bool = True,
                    paging_in_runtime: bool = False,
                    deadline: Deadline | None = None) -> Iterator[tuple[StagePlan, GreedyStart]]:
    """Improve a greedy plan by ejection moves; yields each cheaper plan (every one fits both budgets) with its
    policies and kept gaps, as ``found`` is given: a search stopped early resumes from the last one it yielded.

    A move switches one evicted tensor's policy in every gap (keeps it in RAM, or pages or recomputes it
    instead) and lets the greedy evict until every stage fits again (a kept tensor is held; a switched one may
    be switched again by the greedy), then runs the local search; it is taken when the plan costs less. The
    local search alone cannot find these: keeping one tensor overflows several stages at once, which no single
    or paired change repairs, and recomputing a paged tensor moves the RAM its recomputation needs to other
    stages. Tensors are tried from the costliest restoration down, in passes, in three rounds, each until a pass
    takes no move: keeping a tensor, then switching it to another eviction, each skipped where the greedy's repair
    alone saves nothing (fast), then every move with the local search run after every repair (it can turn a
    dearer repair into a cheaper plan).
    ``deadline`` stops it with the plans yielded so far. Traced MobileNetV2 at 30% on m4: the greedy's 0.48194 J
    to 0.47775 J in three keeping moves and 30 s; traced hf_bert at 30% on jetsontx2, from a 120 s solve's cheapest
    greedy: 0.0229130 J to 0.0225106 J in 4.6 s, where keeping moves alone left it (from the greedy of a covering
    problem given 200 s, 0.0229046 J to 0.0224250 J in 0.9 s by recomputing the first layer's attention product
    where the greedy paged it, and 0.0222054 J after 15 s).
    """
    deadline = deadline or Deadline.none()
    moves = _moves(paging, remat)
    plan, start = found
    policy, kept = list(start.policy), start.kept_gaps
    energy = plan_energy_j(plan, priced)
    rounds = [([KEEP], True), (moves, True), ([KEEP, *moves], False)]
    for tried, repair_must_save in rounds:
        improved = True
        while improved and not deadline.expired():
            improved = False
            for i in sorted((i for i, p in enumerate(policy) if p != KEEP),
                            key=lambda i: -_restoration_j(plan, priced, i)):
                if policy[i] == KEEP:  # kept by an earlier move of this pass
                    continue
                for move in tried:
                    if deadline.expired():
                        return
                    if move == policy[i] or not _allowed(priced, i, move):
                        continue
                    trial_policy = list(policy)
                    trial_policy[i] = move
                    held = frozenset({i}) if move == KEEP else frozenset()
                    evicted = _evict_until_fit(priced, trial_policy, _evicted_in_every_gap(kept, i), ram_budget_bytes,
                                               moves, deadline, held_in_ram=held)
                    if evicted is None or (repair_must_save and plan_energy_j(evicted[1], priced) >= energy - 1e-15):
                        continue
                    trial, trial_kept = _improve(priced, trial_policy, *evicted, ram_budget_bytes, [KEEP, *moves],
                                                 deadline, runtime_budget_s, paging_in_runtime)
                    trial_energy = plan_energy_j(trial, priced)
                    if (trial_energy >= energy - 1e-15
                            or not _within_runtime(trial, priced, runtime_budget_s, paging_in_runtime)):
                        continue
                    policy, kept, plan, energy = trial_policy, trial_kept, trial, trial_energy
                    improved = True
                    yield plan, GreedyStart(list(policy), kept)
                    break


def _restoration_j(plan: StagePlan, priced: PricedGraph, i: int) -> float:
    """Joules ``plan`` spends restoring tensor ``i``: its recomputations beyond the first compute, and its paging."""
    return float((plan.recompute[:, i].sum() - 1) * priced.compute_j[i] + plan.page_in[:, i].sum() * priced.page_in_j[i]
                 + plan.page_out[:, i].sum() * priced.page_out_j[i])


def _kept_anywhere(kept: KeptGaps, i: int) -> bool:
    return any(tensor == i for tensor, _ in kept)


def _evicted_in_every_gap(kept: KeptGaps, i: int) -> KeptGaps:
    """The kept gaps without tensor ``i``'s: a move of ``i`` applies its policy to every gap."""
    return frozenset(gap for gap in kept if gap[0] != i) if _kept_anywhere(kept, i) else kept


def _evicted_gaps(plan: StagePlan) -> list[tuple[int, int]]:
    """(tensor, stage) for each restoration in ``plan``: paged in for that stage, or recomputed in it."""
    paged = [(int(i), int(stage) + 1) for stage, i in np.argwhere(plan.page_in)]
    recomputed = [(int(i), int(stage)) for stage, i in np.argwhere(plan.recompute) if stage != i]
    return paged + recomputed


def _improve(priced: PricedGraph, policy: list[str], kept: KeptGaps, plan: StagePlan, ram_budget_bytes: float,
             options: list[str], deadline: Deadline, runtime_budget_s: float | None = None,
             paging_in_runtime: bool = False) -> tuple[StagePlan, KeptGaps]:
    """Local search after the greedy, until no move helps or ``deadline`` passes (every plan it holds fits the
    RAM budget, and the runtime budget when one is given).

    Returns the plan and its kept gaps; ``policy`` is updated in place.

    Single moves switch one tensor's policy when that saves energy and still fits. Swap moves
    keep an evicted tensor in RAM and evict, in exchange, a tensor held across the stage that
    then overflows most, when the pair saves energy. Gap moves keep a tensor across one gap in
    which the plan restores it, where that still fits.
    """
    graph = priced.graph
    energy = plan_energy_j(plan, priced)

    def attempt(trial_policy: list[str], trial_kept: KeptGaps):
        trial = plan_from_policies(priced, trial_policy, trial_kept)
        trial_energy = plan_energy_j(trial, priced)
        if trial_energy >= energy - 1e-15:
            return None
        if model_stage_peaks(trial, priced).max() > ram_budget_bytes:
            return None
        # Keeping a tensor across a gap can add a restoration (two short gaps merge into one that evicts): no move
        # takes the plan over the runtime budget, or further over it.
        if (runtime_budget_s is not None and plan_runtime_s(trial, priced, paging_in_runtime)
                > max(runtime_budget_s, plan_runtime_s(plan, priced, paging_in_runtime))):
            return None
        return trial, trial_energy

    improved = True
    while improved:
        improved = False
        for i in [i for i, p in enumerate(policy) if p != KEEP]:
            if deadline.expired():
                return plan, kept
            for move in options:
                if move == policy[i] or not _allowed(priced, i, move):
                    continue
                trial_policy = list(policy)
                trial_policy[i] = move
                trial_kept = _evicted_in_every_gap(kept, i)
                found = attempt(trial_policy, trial_kept)
                if found:
                    policy[i] = move
                    kept = trial_kept
                    plan, energy = found
                    improved = True
        for i in [i for i, p in enumerate(policy) if p != KEEP]:
            if deadline.expired():
                return plan, kept
            kept_policy = list(policy)
            kept_policy[i] = KEEP
            kept_plan = plan_from_policies(priced, kept_policy, kept)
            excess = model_stage_peaks(kept_plan, priced) - ram_budget_bytes
            worst = int(np.argmax(excess))
            if excess[worst] <= 0:
                continue
            held = [j for j in range(worst) if kept_plan.keep_ram[worst, j] and policy[j] == KEEP and j != i
                    and graph.nodes[j].output_bytes >= excess[worst]]
            held.sort(key=lambda j: priced.compute_j[j])
            done = False
            for j in held[:8]:
                for move in options[1:]:
                    if not _allowed(priced, j, move):
                        continue
                    trial_policy = list(kept_policy)
                    trial_policy[j] = move
                    trial_kept = _evicted_in_every_gap(kept, j)
                    found = attempt(trial_policy, trial_kept)
                    if found:
                        policy[:] = trial_policy
                        kept = trial_kept
                        plan, energy = found
                        improved = done = True
                        break
                if done:
                    break
        for gap in _evicted_gaps(plan):
            if deadline.expired():
                return plan, kept
            if gap in kept:
                continue
            found = attempt(policy, kept | {gap})
            if found:
                kept = kept | {gap}
                plan, energy = found
                improved = True
    return plan, kept
