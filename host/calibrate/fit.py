"""Fit a profile's compute rates and paging costs to executor telemetry.

Compute: for every op class, FLOP/s = the FLOPs of its forward nodes divided by their measured seconds
(each node's median over its computes, so a step disturbed by another process does not skew the fit).
Only forward computes are used: they are what a schedule can add (recomputations), and backward nodes
run once in every schedule. Per-node fixed costs (dispatch, the executor's own bookkeeping) are folded
into the rate, so the fitted rates price nodes as the executor runs them.

Paging time: each direction's latency and 1/throughput are scaled by one factor, the measured seconds
over the seconds the profile predicts for the same transfers and bytes.

Paging energy: where the CPU works during a transfer (copying, checksumming), an energy meter that
charges CPU time (``modelled:cpu-time×power``) charges paging for it too. Given the CPU's watts per
busy thread, ``memory_power_w`` becomes the effective power while paging: the profile's storage power
plus the CPU time the transfers took per second of transfer, at that power.

The first ``skip_steps`` steps of each executor run are left out (allocator and cache warm-up).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

from device_agent.executor.telemetry import InstructionEvent
from host.costs.profile import DEFAULT_OP_CLASS, PlatformProfile
from host.graph.training_graph import TrainingGraph


class CalibrationError(ValueError):
    """The telemetry cannot calibrate this profile (wrong graph, or nothing measured)."""


def calibrate_profile(
    profile: PlatformProfile,
    graph: TrainingGraph,
    events: Iterable[InstructionEvent],
    *,
    skip_steps: int = 1,
    cpu_power_w_per_thread: float | None = None,
) -> PlatformProfile:
    """``profile`` with compute rates (per op class) and paging costs fitted to ``events`` of ``graph``.

    ``cpu_power_w_per_thread``: watts one busy CPU thread draws; when given, the CPU time of page
    transfers is priced into ``memory_power_w`` (see the module docstring).
    """
    node_seconds: dict[int, list[float]] = {}
    paging = {"page_in": [0.0, 0.0], "page_out": [0.0, 0.0]}  # measured s, predicted s
    paging_cpu_s = 0.0
    steps: set[int] = set()
    for event in events:
        if event.step < skip_steps:
            continue
        if not 0 <= event.node < graph.size or graph.nodes[event.node].name != event.node_name:
            raise CalibrationError(
                f"event for node {event.node} ({event.node_name!r}) does not match graph {graph.name!r}: "
                "calibrate with the graph the schedule was solved for"
            )
        node = graph.nodes[event.node]
        steps.add(event.step)
        if event.kind == "compute" and node.kind != "bwd" and node.flops > 0:
            node_seconds.setdefault(event.node, []).append(event.duration_s)
        elif event.kind in paging:
            latency, throughput = (
                (profile.page_in_latency_s, profile.page_in_throughput_bytes_per_s)
                if event.kind == "page_in"
                else (profile.page_out_latency_s, profile.page_out_throughput_bytes_per_s)
            )
            paging[event.kind][0] += event.duration_s
            paging[event.kind][1] += latency + event.bytes_moved / throughput
            paging_cpu_s += event.cpu_s
    if not node_seconds and not any(measured for measured, _ in paging.values()):
        raise CalibrationError(
            f"no measured computes or page transfers after the first {skip_steps} step(s): train more steps"
        )
    note = f"calibrated from executor telemetry ({len(steps)} step(s) of {graph.name})"
    flops: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for index, durations in node_seconds.items():
        op_class = graph.nodes[index].op_class
        flops[op_class] = flops.get(op_class, 0.0) + graph.nodes[index].flops
        seconds[op_class] = seconds.get(op_class, 0.0) + statistics.median(durations)
    rates = dict(profile.flops_per_s)
    sources = dict(profile.sources)
    for op_class, total in flops.items():
        if seconds[op_class] > 0:
            rates[op_class] = total / seconds[op_class]
            sources[f"compute.flops_per_s.{op_class}"] = f"{note}: forward FLOPs / median measured seconds"
    if DEFAULT_OP_CLASS not in flops and "elementwise" in flops:
        rates[DEFAULT_OP_CLASS] = rates["elementwise"]
        sources[f"compute.flops_per_s.{DEFAULT_OP_CLASS}"] = f"{note}: = the elementwise rate"
    changes: dict = {"flops_per_s": rates, "sources": sources, "path": None}
    for prefix, (measured_s, predicted_s) in paging.items():
        if measured_s > 0 and predicted_s > 0:
            factor = measured_s / predicted_s
            changes[f"{prefix}_latency_s"] = getattr(profile, f"{prefix}_latency_s") * factor
            changes[f"{prefix}_throughput_bytes_per_s"] = getattr(profile, f"{prefix}_throughput_bytes_per_s") / factor
            for field in ("latency_s", "throughput_bytes_per_s"):
                sources[f"{prefix}.{field}"] = f"{note}: scaled by measured/predicted = {factor:.3g}"
    paging_s = sum(measured for measured, _ in paging.values())
    if cpu_power_w_per_thread is not None and paging_s > 0:
        cpu_w = paging_cpu_s / paging_s * cpu_power_w_per_thread
        changes["memory_power_w"] = profile.memory_power_w + cpu_w
        sources["memory_power_w"] = (
            f"{note}: storage {profile.memory_power_w:.3g} W + CPU busy {paging_cpu_s / paging_s:.2f} thread(s) "
            f"while paging x {cpu_power_w_per_thread:.3g} W"
        )
    changes["description"] = f"{profile.description}; {note}"
    return dataclasses.replace(profile, **changes)
