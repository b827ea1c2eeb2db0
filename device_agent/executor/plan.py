"""A schedule checked and annotated for the runtime, before any training: what each instruction must do.

The schedule is replayed on the partition (the replay every side shares, plus the executor's own rules:
forward before backward, random nodes first computed in program order), and each compute learns what it
is: a first compute or a recompute, a forward whose autograd graph a later backward reads, a backward that
must retain its graph for another compute of itself, or the first backward that adds parameter gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from device_agent.executor.errors import InvalidScheduleError
from device_agent.executor.partition import Partition
from device_agent.replay import ReplayError, ReplayTrace, check_schedule_matches, replay
from device_agent.schedule import Schedule

__all__ = ["PlannedOp", "check_schedule", "plan_schedule", "planned_counts"]


@dataclass(frozen=True)
class PlannedOp:
    """One instruction as the runtime runs it."""

    kind: str
    node: int
    location: str
    recompute: bool = False  # compute of a node already computed in this step
    graph: bool = False  # fwd/loss compute whose autograd graph a later backward uses
    retain: bool = False  # bwd compute followed by another compute of the same bwd node on this graph
    accumulate: bool = False  # first compute of a bwd node: adds parameter gradients


def planned_counts(schedule: Schedule) -> dict[str, int]:
    """computes / recomputes / page_ins / page_outs the schedule asks for."""
    return schedule.counts()


def check_schedule(partition: Partition, schedule: Schedule, *,
                   ram_budget_bytes: float | None = None) -> list[PlannedOp]:
    """Replay ``schedule`` on ``partition`` without running anything; raise at the first broken rule.

    Returns the annotated instruction list the executor runs.
    """
    return plan_schedule(partition, schedule, ram_budget_bytes=ram_budget_bytes)[0]


def plan_schedule(partition: Partition, schedule: Schedule, *, ram_budget_bytes: float | None = None
                  ) -> tuple[list[PlannedOp], ReplayTrace]:
    """The annotated instructions and the replay's trace (peaks of RAM and flash); ScheduleMismatchError for a
    schedule of another graph, InvalidScheduleError at the first broken rule."""
    check_schedule_matches(schedule, partition.fingerprint, [n.name for n in partition.nodes], partition.name)
    if ram_budget_bytes is None:
        ram_budget_bytes = schedule.ram_budget_bytes or None
    nodes = partition.nodes
    first_computed: set[int] = set()
    last_random_first = [-1]

    def executor_rules(position: int, index: int) -> str | None:
        """Rules of exact execution on top of the schedule's own: forward before backward, RNG order."""
        node = nodes[index]
        first_computed.add(index)
        if node.kind == "bwd" and node.forward_index not in first_computed:
            return f"{node.name!r} runs before its forward node was ever computed"
        if node.kind != "bwd" and partition.programs[index].random:
            if index < last_random_first[0]:
                return (f"random node {node.name!r} is first computed out of program order: its RNG draws would "
                        "differ from plain training")
            last_random_first[0] = index
        return None

    try:
        trace = replay(nodes, schedule.instructions, graph_label=partition.name, ram_budget_bytes=ram_budget_bytes,
                       on_first_compute=executor_rules)
    except ReplayError as error:
        raise InvalidScheduleError(f"schedule {error}") from None
    return _annotate(partition, schedule), trace


def _annotate(partition: Partition, schedule: Schedule) -> list[PlannedOp]:
    instructions = schedule.instructions
    computes_of: dict[int, list[int]] = {}
    for position, ins in enumerate(instructions):
        if ins.kind == "compute":
            computes_of.setdefault(ins.node, []).append(position)

    def next_compute_is(position: int, candidates: tuple[int, ...], wanted: int) -> bool:
        following = [(p, n) for n in candidates for p in computes_of.get(n, ()) if p > position]
        return bool(following) and min(following)[1] == wanted

    ops: list[PlannedOp] = []
    seen: set[int] = set()
    for position, ins in enumerate(instructions):
        if ins.kind != "compute":
            ops.append(PlannedOp(ins.kind, ins.node, ins.location))
            continue
        node = partition.nodes[ins.node]
        recompute = ins.node in seen
        seen.add(ins.node)
        if node.kind == "bwd":
            forward = node.forward_index
            retain = next_compute_is(position, (forward, ins.node), ins.node)
            ops.append(PlannedOp("compute", ins.node, "ram", recompute, retain=retain, accumulate=not recompute))
        else:
            bwd = partition.programs[ins.node].bwd_index
            graph = bwd is not None and next_compute_is(position, (ins.node, bwd), bwd)
            ops.append(PlannedOp("compute", ins.node, "ram", recompute, graph=graph))
    return ops
