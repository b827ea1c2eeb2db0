"""Fit a profile's compute rates and paging costs to executor telemetry.

Compute: for every op class, FLOP/s = the FLOPs of the forward computes of that class divided by their
measured seconds. Only forward computes are used: they are what a schedule can add (recomputations),
and backward nodes run once in every schedule. Per-node fixed costs (dispatch, the executor's own
bookkeeping) are folded into the rate, so the fitted rates price nodes as the executor runs them.

Paging: each direction's latency and 1/throughput are scaled by one factor, measured seconds over the
seconds the profile predicts for the same page-ins (or page-outs) and bytes.

The first ``skip_steps`` steps are left out (allocator and cache warm-up).
"""

from __future__ import annotations

import dataclasses
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
) -> PlatformProfile:
    """``profile`` with compute rates (per op class) and paging costs fitted to ``events`` of ``graph``."""
    flops: dict[str, float] = {}
    seconds: dict[str, float] = {}
    paging = {"page_in": [0.0, 0.0], "page_out": [0.0, 0.0]}  # measured s, predicted s
    steps: set[int] = set()
    used = 0
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
            flops[node.op_class] = flops.get(node.op_class, 0.0) + node.flops
            seconds[node.op_class] = seconds.get(node.op_class, 0.0) + event.duration_s
            used += 1
        elif event.kind in paging:
            latency, throughput = (
                (profile.page_in_latency_s, profile.page_in_throughput_bytes_per_s)
                if event.kind == "page_in"
                else (profile.page_out_latency_s, profile.page_out_throughput_bytes_per_s)
            )
            paging[event.kind][0] += event.duration_s
            paging[event.kind][1] += latency + event.bytes_moved / throughput
            used += 1
    if not used:
        raise CalibrationError(
            f"no measured computes or page transfers after the first {skip_steps} step(s): train more steps"
        )
    note = f"calibrated from executor telemetry ({len(steps)} step(s) of {graph.name})"
    rates = dict(profile.flops_per_s)
    sources = dict(profile.sources)
    for op_class, total in flops.items():
        if seconds[op_class] > 0:
            rates[op_class] = total / seconds[op_class]
            sources[f"compute.flops_per_s.{op_class}"] = f"{note}: forward FLOPs / measured seconds"
    if DEFAULT_OP_CLASS not in flops and "elementwise" in flops:
        rates[DEFAULT_OP_CLASS] = rates["elementwise"]
        sources[f"compute.flops_per_s.{DEFAULT_OP_CLASS}"] = f"{note}: = the elementwise rate"
    changes: dict = {"flops_per_s": rates, "sources": sources, "path": None}
    for kind, (measured_s, predicted_s) in paging.items():
        if measured_s > 0 and predicted_s > 0:
            factor = measured_s / predicted_s
            prefix = "page_in" if kind == "page_in" else "page_out"
            changes[f"{prefix}_latency_s"] = getattr(profile, f"{prefix}_latency_s") * factor
            changes[f"{prefix}_throughput_bytes_per_s"] = getattr(profile, f"{prefix}_throughput_bytes_per_s") / factor
            for field in ("latency_s", "throughput_bytes_per_s"):
                sources[f"{prefix}.{field}"] = f"{note}: scaled by measured/predicted = {factor:.3g}"
    changes["description"] = f"{profile.description}; {note}"
    return dataclasses.replace(profile, **changes)
