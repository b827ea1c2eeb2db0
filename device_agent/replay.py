"""Replay a Schedule's instructions against its nodes without running anything.

The one place the rules of a schedule live: a computation needs its inputs in RAM, a page-in
needs a flash copy, a free needs the copy it frees, every node is computed, every tensor is freed
by the end of the step, and the controlled RAM never exceeds the budget, not even while a node's
computation holds its temporaries (its workspace). The host's validator
prices the result; the device's executor checks a schedule with it before training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from device_agent.errors import UserError
from device_agent.schedule import INSTRUCTION_KINDS, Instruction, Schedule

# Budgets are compared with a small relative slack: byte totals arrive as floats.
RELATIVE_SLACK = 1e-9


class ReplayError(UserError, ValueError):
    """A schedule that breaks a rule; the message names the instruction and the rule."""


class ScheduleMismatchError(ReplayError):
    """A schedule solved for another graph (the model's trace changed)."""


class ReplayNode(Protocol):
    name: str
    output_bytes: int
    deps: tuple[int, ...]
    workspace_bytes: int  # held only while it is computed (0: none)


@dataclass
class ReplayTrace:
    peak_ram_bytes: int
    computes: int
    page_ins: int
    page_outs: int
    recomputes: int
    ram_timeline_bytes: list[int] = field(default_factory=list)  # controlled RAM after each instruction
    compute_counts: dict[int, int] = field(default_factory=dict)  # node -> number of computes
    peak_flash_bytes: int = 0  # most output bytes on flash at once (payload only, no file overhead)
    peak_flash_pages: int = 0  # most pages on flash at once


def check_schedule_matches(schedule: Schedule, fingerprint: str, node_names: Sequence[str], graph_label: str) -> None:
    """The schedule was solved for this graph: same fingerprint and the same node names in order."""
    if schedule.graph_fingerprint and schedule.graph_fingerprint != fingerprint:
        raise ScheduleMismatchError(
            f"schedule was solved for graph {schedule.graph_name!r} with fingerprint {schedule.graph_fingerprint}, "
            f"but this graph ({graph_label!r}) has fingerprint {fingerprint}: the model, its batch size or the "
            "granularity changed; solve the schedule again for this model"
        )
    if schedule.nodes:
        if len(schedule.nodes) != len(node_names):
            raise ScheduleMismatchError(
                f"schedule lists {len(schedule.nodes)} nodes but graph {graph_label!r} has {len(node_names)}"
            )
        for position, (listed, name) in enumerate(zip(schedule.nodes, node_names, strict=True)):
            if listed.name != name:
                raise ScheduleMismatchError(f"schedule node {position} is named {listed.name!r}, graph node is {name!r}")


def instruction_workspace_bytes(nodes: Sequence[ReplayNode], instructions: Sequence[Instruction]) -> list[int]:
    """Per instruction, the bytes it holds only while it runs: a compute's workspace, 0 for the rest."""
    return [nodes[i.node].workspace_bytes if i.kind == "compute" else 0 for i in instructions]


def replay(
    nodes: Sequence[ReplayNode],
    instructions: Sequence[Instruction],
    *,
    graph_label: str,
    ram_budget_bytes: float | None = None,
    on_first_compute: Callable[[int, int], str | None] | None = None,
) -> ReplayTrace:
    """Replay ``instructions``; raise ReplayError at the first broken rule.

    ``on_first_compute(position, node)`` may return an extra rule's complaint (e.g. the executor's
    RNG order), which is raised like the built-in rules.
    """
    in_ram: set[int] = set()
    on_flash: set[int] = set()
    counts: dict[int, int] = {}
    ram_bytes = peak_ram_bytes = 0
    flash_bytes = peak_flash_bytes = peak_flash_pages = 0
    page_ins = page_outs = 0
    timeline: list[int] = []

    def fail(position: int, message: str) -> None:
        raise ReplayError(f"instruction {position} ({instructions[position]}): {message}")

    for position, ins in enumerate(instructions):
        if ins.kind not in INSTRUCTION_KINDS:
            fail(position, f"unknown instruction kind {ins.kind!r}")
        if not 0 <= ins.node < len(nodes):
            fail(position, f"names unknown node {ins.node}; graph {graph_label!r} has nodes 0..{len(nodes) - 1}")
        if ins.location not in ("ram", "flash"):
            fail(position, f"unknown location {ins.location!r}")
        node = nodes[ins.node]
        during_bytes = None
        if ins.kind == "compute":
            missing = [nodes[d].name for d in node.deps if d not in in_ram]
            if missing:
                fail(position, f"node {node.name!r} needs {missing} in RAM")
            if ins.node in in_ram:
                fail(position, f"node {node.name!r} is already in RAM")
            if ins.node not in counts and on_first_compute is not None:
                complaint = on_first_compute(position, ins.node)
                if complaint:
                    fail(position, complaint)
            in_ram.add(ins.node)
            counts[ins.node] = counts.get(ins.node, 0) + 1
            ram_bytes += node.output_bytes
            # While it runs, a computation also holds its temporaries (its workspace), gone when it returns.
            during_bytes = ram_bytes + node.workspace_bytes
            if (node.workspace_bytes and ram_budget_bytes is not None
                    and during_bytes > ram_budget_bytes * (1 + RELATIVE_SLACK)):
                fail(position, f"while {node.name!r} is computed, controlled RAM is {during_bytes} bytes (with its "
                               f"{node.workspace_bytes} bytes of temporaries): it exceeds the budget of "
                               f"{ram_budget_bytes:.0f} bytes")
        elif ins.kind == "page_out":
            if ins.node not in in_ram:
                fail(position, f"cannot page out {node.name!r}: not in RAM")
            if ins.node in on_flash:
                fail(position, f"{node.name!r} is already on flash")
            on_flash.add(ins.node)
            page_outs += 1
            flash_bytes += node.output_bytes
            peak_flash_bytes = max(peak_flash_bytes, flash_bytes)
            peak_flash_pages = max(peak_flash_pages, len(on_flash))
        elif ins.kind == "page_in":
            if ins.node not in on_flash:
                fail(position, f"cannot page in {node.name!r}: no copy on flash")
            if ins.node in in_ram:
                fail(position, f"{node.name!r} is already in RAM")
            in_ram.add(ins.node)
            ram_bytes += node.output_bytes
            page_ins += 1
        else:  # free
            where = in_ram if ins.location == "ram" else on_flash
            if ins.node not in where:
                fail(position, f"cannot free {node.name!r} from {ins.location}: it is not there")
            where.discard(ins.node)
            if ins.location == "ram":
                ram_bytes -= node.output_bytes
            else:
                flash_bytes -= node.output_bytes
        peak_ram_bytes = max(peak_ram_bytes, ram_bytes if during_bytes is None else during_bytes)
        timeline.append(ram_bytes)
        if ram_budget_bytes is not None and ram_bytes > ram_budget_bytes * (1 + RELATIVE_SLACK):
            fail(position, f"controlled RAM {ram_bytes} bytes exceeds the budget of {ram_budget_bytes:.0f} bytes")

    never = [n.name for index, n in enumerate(nodes) if index not in counts]
    if never:
        raise ReplayError(f"schedule never computes {len(never)} node(s): {never[:5]}")
    if in_ram or on_flash:
        left = sorted(in_ram | on_flash)[:5]
        raise ReplayError(
            f"schedule ends with {len(in_ram)} tensor(s) in RAM and {len(on_flash)} on flash (e.g. nodes {left}); "
            "every tensor must be freed by the end of the step"
        )
    computes = sum(counts.values())
    return ReplayTrace(
        peak_ram_bytes=peak_ram_bytes,
        computes=computes,
        page_ins=page_ins,
        page_outs=page_outs,
        recomputes=computes - len(counts),
        ram_timeline_bytes=timeline,
        compute_counts=counts,
        peak_flash_bytes=peak_flash_bytes,
        peak_flash_pages=peak_flash_pages,
    )
