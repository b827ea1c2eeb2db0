"""Baseline schedules as stage plans: what a user would pick instead of POET.

Plain PyTorch, torch's checkpoint_sequential for every number of segments, per-block checkpointing,
Chen et al.'s √n checkpointing and paging what does not fit. `poet solve` prices them on the same
profile, offers the cheapest that fits as the MILP's start and never answers with a costlier schedule;
`poet pareto` draws them beside POET.
"""

from __future__ import annotations

import math

from host.graph.training_graph import TrainingGraph
from host.solver.stage_plan import StagePlan


class BaselineDoesNotFitError(ValueError):
    """The baseline cannot meet the RAM budget."""


def keep_all_plan(graph: TrainingGraph) -> StagePlan:
    """Plain PyTorch: compute every node once and keep it until its last consumer has run."""
    plan = StagePlan.empty(graph.size)
    for i, last in enumerate(graph.last_use):
        plan.keep_ram[i + 1 : last + 1, i] = True
    return plan


def checkpoint_sqrt_n_plan(graph: TrainingGraph, segment_count: int | None = None) -> StagePlan:
    """Chen et al. (2016): keep every ⌈√n⌉-th forward node; recompute a segment once for its backward."""
    forward = forward_order(graph)
    stride = max(1, math.ceil(len(forward) / segment_count) if segment_count else math.ceil(math.sqrt(len(forward))))
    return checkpoint_plan(graph, set(forward[::stride]))


def forward_order(graph: TrainingGraph) -> list[int]:
    """The forward nodes (and the loss) in execution order: the functions of a sequential model."""
    return [n.index for n in graph.nodes if n.kind != "bwd"]


def checkpoint_sequential_plan(graph: TrainingGraph, segments: int) -> StagePlan:
    """torch.utils.checkpoint.checkpoint_sequential(functions, segments) over the forward nodes in order.

    As in torch: segments of ``len(forward) // segments`` functions; each segment but the last keeps only
    its input (the previous function's output) and recomputes the rest for its backward; the last segment
    runs normally, keeping its activations. ``segments=1`` is plain training.
    """
    forward = forward_order(graph)
    segments = max(1, min(segments, len(forward)))
    size = len(forward) // segments
    last_start = size * (segments - 1)
    checkpoints = {forward[start - 1] for start in range(size, last_start + 1, size) if start > 0}
    checkpoints |= set(forward[last_start:]) | {forward[0]}
    return checkpoint_plan(graph, checkpoints)


def block_boundaries(graph: TrainingGraph) -> list[int]:
    """Forward nodes whose output is the only tensor crossing from them to the rest of the forward pass.

    Residual blocks and transformer layers are joined by such single tensors (0-byte tensors, such as
    the batch, which the caller holds, do not count as crossing).
    """
    forward = forward_order(graph)
    position = {node: p for p, node in enumerate(forward)}
    last_forward_use = [max((position[j] for j in graph.successors[i] if j in position), default=-1) for i in forward]
    boundaries = []
    reach = -1  # the furthest forward position read by a tensor produced before the current one
    for p, node in enumerate(forward):
        if reach <= p and p + 1 < len(forward):
            boundaries.append(node)
        if graph.nodes[node].output_bytes > 0:
            reach = max(reach, last_forward_use[p])
    return boundaries


def block_checkpoint_plan(graph: TrainingGraph) -> StagePlan:
    """Per-block checkpointing (as a user wraps each residual block or transformer layer in checkpoint):
    keep the tensor between two blocks, recompute each block once for its backward."""
    return checkpoint_plan(graph, set(block_boundaries(graph)))


def checkpoint_plan(graph: TrainingGraph, checkpoints: set[int]) -> StagePlan:
    """Keep the forward outputs in ``checkpoints`` (and the loss); recompute the others once for the backward.

    During the forward pass a non-checkpoint tensor lives until its last forward consumer. In a
    backward stage, missing saved tensors are recomputed from the nearest tensors in RAM and then
    kept until their last use, so each segment is recomputed once.
    """
    size = graph.size
    checkpoints = set(checkpoints) | {n.index for n in graph.nodes if n.kind == "loss"}
    last_use = graph.last_use
    last_forward_use = [
        max((j for j in graph.successors[i] if graph.nodes[j].kind != "bwd"), default=-1) for i in range(size)
    ]
    plan = StagePlan.empty(size)
    in_ram: set[int] = set()
    for t in range(size):
        computed = {t}
        missing = [d for d in graph.nodes[t].deps if d not in in_ram]
        while missing:
            node = missing.pop()
            if node in computed:
                continue
            computed.add(node)
            missing.extend(d for d in graph.nodes[node].deps if d not in in_ram and d not in computed)
        for i in computed:
            plan.recompute[t, i] = True
        if t + 1 == size:
            break
        backward_phase = graph.nodes[t].kind == "bwd"
        carried = set()
        for i in in_ram | computed:
            if last_use[i] <= t:
                continue
            node_is_forward = graph.nodes[i].kind != "bwd"
            if not node_is_forward or i in checkpoints or backward_phase or last_forward_use[i] > t:
                carried.add(i)
        for i in carried:
            plan.keep_ram[t + 1, i] = True
        in_ram = carried
    return plan


def paging_plan(graph: TrainingGraph, ram_budget_bytes: float) -> StagePlan:
    """Page everything that does not fit: no recomputation; evict the tensor used furthest in future.

    Raises BaselineDoesNotFitError when a node's inputs, output and workspace alone exceed the budget.
    """
    size = graph.size
    out_bytes = [n.output_bytes for n in graph.nodes]
    last_use = graph.last_use
    users = graph.successors
    plan = StagePlan.empty(size)
    in_ram: set[int] = set()
    on_flash: set[int] = set()

    def next_use(i: int, after: int) -> int:
        return min((j for j in users[i] if j > after), default=size)

    for t in range(size - 1):
        nxt = t + 1
        need = set(graph.nodes[nxt].deps)
        workspace = graph.nodes[nxt].workspace_bytes
        capacity = ram_budget_bytes - out_bytes[nxt] - workspace
        live = {i for i in in_ram | {t} | on_flash if last_use[i] > t}
        required = sum(out_bytes[i] for i in need)
        if required > capacity:
            raise BaselineDoesNotFitError(
                f"node {graph.nodes[nxt].name!r} needs {required + out_bytes[nxt] + workspace} bytes at once "
                f"(inputs, output and workspace), more than the budget of {ram_budget_bytes:.0f} bytes"
            )
        keep = set(need)
        used = required
        resident = sorted((i for i in live - need if i in in_ram or i == t), key=lambda i: next_use(i, t))
        for i in resident:
            if used + out_bytes[i] <= capacity:
                keep.add(i)
                used += out_bytes[i]
        for i in sorted(live - keep):
            if i not in on_flash:
                plan.page_out[t, i] = True
                on_flash.add(i)
        for i in keep:
            if i not in in_ram and i != t:
                plan.page_in[t, i] = True
            plan.keep_ram[nxt, i] = True
        on_flash = {i for i in on_flash if last_use[i] > t and (i not in keep or i in on_flash)}
        on_flash = {i for i in on_flash if last_use[i] > t}
        for i in on_flash:
            plan.keep_flash[nxt, i] = True
        in_ram = keep
    return plan
