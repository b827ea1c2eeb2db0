"""Replay a Schedule against its priced graph, independently of any solver.

The validator is the referee: it checks every dependency and the controlled RAM after every
instruction, and recomputes peak RAM, energy and runtime from the instructions alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from device_agent.schedule import INSTRUCTION_KINDS, Schedule
from host.costs.priced_graph import PricedGraph

# Budgets are compared with a small relative slack: costs are floats summed in different orders.
_RELATIVE_SLACK = 1e-9


class ScheduleValidationError(ValueError):
    """A schedule that cannot run on its graph, or that breaks its budget."""


@dataclass
class ValidationReport:
    peak_ram_bytes: int
    energy_j: float
    compute_j: float
    paging_j: float
    compute_s: float
    paging_s: float
    runtime_s: float  # compute time, plus paging time when the schedule counts it
    computes: int
    recomputes: int
    page_ins: int
    page_outs: int
    ram_timeline_bytes: list[int] = field(default_factory=list)  # controlled RAM after each instruction


def check_schedule_matches_graph(schedule: Schedule, priced: PricedGraph) -> None:
    graph = priced.graph
    if schedule.graph_fingerprint and schedule.graph_fingerprint != graph.fingerprint():
        raise ScheduleValidationError(
            f"schedule was solved for graph {schedule.graph_name!r} with fingerprint "
            f"{schedule.graph_fingerprint}, but this graph ({graph.name!r}) has fingerprint {graph.fingerprint()}: "
            "the model's trace changed; solve the schedule again for this model"
        )
    if schedule.nodes:
        if len(schedule.nodes) != graph.size:
            raise ScheduleValidationError(
                f"schedule lists {len(schedule.nodes)} nodes but graph {graph.name!r} has {graph.size}"
            )
        for position, (listed, node) in enumerate(zip(schedule.nodes, graph.nodes, strict=True)):
            if listed.name != node.name:
                raise ScheduleValidationError(
                    f"schedule node {position} is named {listed.name!r}, graph node is {node.name!r}"
                )


def validate_schedule(
    schedule: Schedule,
    priced: PricedGraph,
    *,
    ram_budget_bytes: float | None = None,
    runtime_budget_s: float | None = None,
    paging_in_runtime: bool | None = None,
) -> ValidationReport:
    """Replay ``schedule``; raise ScheduleValidationError at the first broken rule.

    Budgets default to the ones recorded in the schedule (0 means unbounded).
    """
    check_schedule_matches_graph(schedule, priced)
    graph = priced.graph
    if ram_budget_bytes is None:
        ram_budget_bytes = schedule.ram_budget_bytes or None
    if runtime_budget_s is None:
        runtime_budget_s = schedule.runtime_budget_s or None
    if paging_in_runtime is None:
        paging_in_runtime = schedule.paging_in_runtime

    in_ram: set[int] = set()
    on_flash: set[int] = set()
    computed_once: set[int] = set()
    ram_bytes = 0
    peak_ram_bytes = 0
    compute_j = paging_j = compute_s = paging_s = 0.0
    computes = page_ins = page_outs = 0
    timeline: list[int] = []

    def fail(position: int, message: str) -> None:
        raise ScheduleValidationError(f"instruction {position} ({schedule.instructions[position]}): {message}")

    for position, ins in enumerate(schedule.instructions):
        if ins.kind not in INSTRUCTION_KINDS:
            fail(position, f"unknown instruction kind {ins.kind!r}")
        if not 0 <= ins.node < graph.size:
            fail(position, f"names node {ins.node}, but graph {graph.name!r} has nodes 0..{graph.size - 1}")
        node = graph.nodes[ins.node]
        if ins.kind == "compute":
            missing = [graph.nodes[d].name for d in node.deps if d not in in_ram]
            if missing:
                fail(position, f"node {node.name!r} needs {missing} in RAM")
            if ins.node in in_ram:
                fail(position, f"node {node.name!r} is already in RAM")
            in_ram.add(ins.node)
            ram_bytes += node.output_bytes
            computed_once.add(ins.node)
            computes += 1
            compute_j += priced.compute_j[ins.node]
            compute_s += priced.compute_s[ins.node]
        elif ins.kind == "page_out":
            if ins.node not in in_ram:
                fail(position, f"cannot page out {node.name!r}: not in RAM")
            if ins.node in on_flash:
                fail(position, f"{node.name!r} is already on flash")
            on_flash.add(ins.node)
            page_outs += 1
            paging_j += priced.page_out_j[ins.node]
            paging_s += priced.page_out_s[ins.node]
        elif ins.kind == "page_in":
            if ins.node not in on_flash:
                fail(position, f"cannot page in {node.name!r}: no copy on flash")
            if ins.node in in_ram:
                fail(position, f"{node.name!r} is already in RAM")
            in_ram.add(ins.node)
            ram_bytes += node.output_bytes
            page_ins += 1
            paging_j += priced.page_in_j[ins.node]
            paging_s += priced.page_in_s[ins.node]
        else:  # free
            where = in_ram if ins.location == "ram" else on_flash
            if ins.node not in where:
                fail(position, f"cannot free {node.name!r} from {ins.location}: it is not there")
            where.discard(ins.node)
            if ins.location == "ram":
                ram_bytes -= node.output_bytes
        peak_ram_bytes = max(peak_ram_bytes, ram_bytes)
        timeline.append(ram_bytes)
        if ram_budget_bytes is not None and ram_bytes > ram_budget_bytes * (1 + _RELATIVE_SLACK):
            fail(position, f"controlled RAM {ram_bytes} bytes exceeds the budget of {ram_budget_bytes:.0f} bytes")

    never = [n.name for n in graph.nodes if n.index not in computed_once]
    if never:
        raise ScheduleValidationError(f"schedule never computes {len(never)} node(s): {never[:5]}")
    if in_ram or on_flash:
        left = sorted(in_ram | on_flash)[:5]
        raise ScheduleValidationError(
            f"schedule ends with {len(in_ram)} tensor(s) in RAM and {len(on_flash)} on flash "
            f"(e.g. nodes {left}); every tensor must be freed by the end of the step"
        )
    runtime_s = compute_s + (paging_s if paging_in_runtime else 0.0)
    if runtime_budget_s is not None and runtime_s > runtime_budget_s * (1 + _RELATIVE_SLACK):
        raise ScheduleValidationError(
            f"predicted runtime {runtime_s:.6g} s exceeds the runtime budget of {runtime_budget_s:.6g} s"
        )
    return ValidationReport(
        peak_ram_bytes=peak_ram_bytes,
        energy_j=compute_j + paging_j,
        compute_j=compute_j,
        paging_j=paging_j,
        compute_s=compute_s,
        paging_s=paging_s,
        runtime_s=runtime_s,
        computes=computes,
        recomputes=computes - len(computed_once),
        page_ins=page_ins,
        page_outs=page_outs,
        ram_timeline_bytes=timeline,
    )
