"""Validate a Schedule against its priced graph, independently of any solver.

The rules are replayed by device_agent.replay (shared with the executor's pre-flight check);
this module adds the prices: it recomputes peak RAM, energy and runtime from the instructions
alone and checks both budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from device_agent.replay import RELATIVE_SLACK, ReplayError, check_schedule_matches, replay
from device_agent.schedule import Schedule
from host.costs.priced_graph import PricedGraph


class ScheduleValidationError(ReplayError):
    """A schedule that cannot run on its graph, or that breaks its budget."""


@dataclass
class ValidationReport:
    peak_ram_bytes: int
    energy_j: float
    compute_j: float
    paging_j: float
    compute_s: float
    paging_s: float
    runtime_s: float  # compute time; with paging counted, computes and transfers overlapped as the executor runs them
    computes: int
    recomputes: int
    page_ins: int
    page_outs: int
    ram_timeline_bytes: list[int] = field(default_factory=list)  # controlled RAM after each instruction


def check_schedule_matches_graph(schedule: Schedule, priced: PricedGraph) -> None:
    graph = priced.graph
    try:
        check_schedule_matches(schedule, graph.fingerprint(), [n.name for n in graph.nodes], graph.name)
    except ReplayError as error:
        raise ScheduleValidationError(str(error)) from None


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
    try:
        trace = replay(graph.nodes, schedule.instructions, graph_label=graph.name, ram_budget_bytes=ram_budget_bytes)
    except ReplayError as error:
        raise ScheduleValidationError(str(error)) from None

    size = graph.size
    computes = np.zeros(size)
    for node, count in trace.compute_counts.items():
        computes[node] = count
    page_ins = np.zeros(size)
    page_outs = np.zeros(size)
    for ins in schedule.instructions:
        if ins.kind == "page_in":
            page_ins[ins.node] += 1
        elif ins.kind == "page_out":
            page_outs[ins.node] += 1
    compute_j = float(computes @ priced.compute_j)
    compute_s = float(computes @ priced.compute_s)
    paging_j = float(page_ins @ priced.page_in_j + page_outs @ priced.page_out_j)
    paging_s = float(page_ins @ priced.page_in_s + page_outs @ priced.page_out_s)
    # With paging in the runtime, transfers run behind compute as the executor runs them: the step takes the
    # longer of its computes and the transfers they wait for (never more than compute_s + paging_s, which the
    # MILP's runtime row bounds, so a schedule the MILP finds within the budget stays within it here).
    runtime_s = compute_s
    if paging_in_runtime:
        runtime_s = priced.overlapped_runtime_s(schedule.instructions, trace.ram_timeline_bytes, ram_budget_bytes)
    if runtime_budget_s is not None and runtime_s > runtime_budget_s * (1 + RELATIVE_SLACK):
        raise ScheduleValidationError(
            f"predicted runtime {runtime_s:.6g} s exceeds the runtime budget of {runtime_budget_s:.6g} s"
        )
    return ValidationReport(
        peak_ram_bytes=trace.peak_ram_bytes,
        energy_j=compute_j + paging_j,
        compute_j=compute_j,
        paging_j=paging_j,
        compute_s=compute_s,
        paging_s=paging_s,
        runtime_s=runtime_s,
        computes=trace.computes,
        recomputes=trace.recomputes,
        page_ins=trace.page_ins,
        page_outs=trace.page_outs,
        ram_timeline_bytes=trace.ram_timeline_bytes,
    )
