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
from collections.abc import Iterable, Sequence

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


# ------------------------------------------------------------------------------------------ fleet calibration
# fit_profile fits what the paper's model lacks, from a board's telemetry of real runs (any schedules):
#
#   node compute s  = ops x overhead[direction] + flops / rate[op_class, direction]   (direction: fwd | bwd)
#   page transfer s = latency[direction] + bytes / throughput[direction]
#   step s          = computes + transfers + param_bytes / optimizer_bytes_per_s
#                     + instructions x instruction_overhead_s
#
# Node and transfer terms are non-negative least squares on relative errors (each row divided by its
# measured seconds: the targets are percentage errors). Where a meter measured the steps, the powers
# per activity (compute, paging, the rest) are fitted the same way to the steps' energy.

FLOP_RATE_CAP_PER_S = 1e14  # a class whose time the fit puts wholly in the overhead gets this rate
WARMUP_STEPS = 1  # a run's first steps are left out (allocator and cache warm-up)


@dataclasses.dataclass
class CalibrationRun:
    """One run's telemetry on one graph under one schedule (events as dicts, the stored field names)."""

    graph: TrainingGraph
    schedule: object  # device_agent.schedule.Schedule
    instructions: list[dict]  # step, position, kind, node, node_name, duration_s, bytes_moved, cpu_s
    steps: list[dict]  # step, duration_s, optimizer_s, energy_j (absent when unknown), energy_source


def _kind(event: dict) -> str:
    return str(event.get("kind", "")).lower().removeprefix("instruction_kind_")


def _check_graph(run: CalibrationRun) -> None:
    graph = run.graph
    for event in run.instructions:
        node = int(event.get("node", -1))
        if not 0 <= node < graph.size or graph.nodes[node].name != event.get("node_name", graph.nodes[node].name):
            raise CalibrationError(
                f"an event for node {node} ({event.get('node_name')!r}) does not match graph {graph.name!r}: "
                "calibrate with the graph the schedule was solved for"
            )


def _nnls(rows: list[list[float]], targets: list[float]):
    """Non-negative least squares on relative errors: min sum ((row . x) / t - 1)^2, x >= 0."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.asarray(rows, dtype=np.float64) / np.asarray(targets, dtype=np.float64)[:, None]
    solution, _ = nnls(a, np.ones(len(targets)), maxiter=50 * a.shape[1] + 100)
    return solution


def fit_profile(profile: PlatformProfile, runs: Sequence[CalibrationRun], *, note: str = "",
                warmup_steps: int = WARMUP_STEPS) -> PlatformProfile:
    """``profile`` with compute rates per op class and direction, node and instruction overheads, paging
    costs per direction, the optimizer's throughput and (with a meter) powers fitted to ``runs``."""
    note = note or f"fitted to the telemetry of {len(runs)} run(s)"
    samples: list[tuple[str, str, float, float, int]] = []  # (direction, op_class, flops, median s, ops)
    transfers = {"page_in": [], "page_out": []}  # (bytes, seconds)
    optimizer_rates: list[float] = []
    rest_rows: list[list[float]] = []  # per step: [1, instructions] -> seconds outside instructions and optimizer
    rest_targets: list[float] = []
    frees = {"ram": [], "flash": []}
    for run in runs:
        _check_graph(run)
        graph = run.graph
        durations: dict[int, list[float]] = {}
        per_step_s: dict[int, float] = {}
        per_step_count: dict[int, int] = {}
        for event in run.instructions:
            step = int(event.get("step", 0))
            if step <= warmup_steps:
                continue
            kind, seconds = _kind(event), float(event.get("duration_s", 0.0))
            per_step_s[step] = per_step_s.get(step, 0.0) + seconds
            per_step_count[step] = per_step_count.get(step, 0) + 1
            if kind == "compute" and seconds > 0:
                durations.setdefault(int(event["node"]), []).append(seconds)
            elif kind in transfers and seconds > 0:
                transfers[kind].append((float(event.get("bytes_moved", 0)), seconds))
            elif kind == "free":
                location = str(event.get("location", "ram")).lower().removeprefix("location_")
                frees["flash" if location == "flash" else "ram"].append(seconds)
        for index, values in durations.items():
            node = graph.nodes[index]
            direction = "bwd" if node.kind == "bwd" else "fwd"
            samples.append((direction, node.op_class, float(node.flops), statistics.median(values), node.op_count))
        for step_event in run.steps:
            step = int(step_event.get("step", 0))
            if step <= warmup_steps or step not in per_step_s:
                continue
            optimizer_s = float(step_event.get("optimizer_s", 0.0))
            if optimizer_s > 0 and graph.param_bytes > 0:
                optimizer_rates.append(graph.param_bytes / optimizer_s)
            rest = float(step_event.get("duration_s", 0.0)) - per_step_s[step] - optimizer_s
            if rest > 0:
                rest_rows.append([1.0, float(per_step_count[step])])
                rest_targets.append(rest)
    if not samples:
        raise CalibrationError(f"no measured computes after the first {warmup_steps} step(s): train more steps")
    changes: dict = {"path": None}
    sources = dict(profile.sources)

    # compute: columns are the two overheads, then 1/rate per (direction, op_class) with flops
    columns = [("overhead", "fwd"), ("overhead", "bwd")]
    columns += sorted({(d, c) for d, c, flops, _, _ in samples if flops > 0})
    index = {key: i for i, key in enumerate(columns)}
    rows, targets = [], []
    for direction, op_class, flops, seconds, op_count in samples:
        row = [0.0] * len(columns)
        row[index[("overhead", direction)]] = float(op_count)  # a dispatch cost per aten op
        if flops > 0:
            row[index[(direction, op_class)]] = flops
        rows.append(row)
        targets.append(seconds)
    x = _nnls(rows, targets)
    rates = {"fwd": dict(profile.flops_per_s), "bwd": dict(profile.bwd_flops_per_s or {})}
    for (direction, op_class), i in index.items():
        if direction == "overhead":
            continue
        rates[direction][op_class] = 1.0 / x[i] if x[i] > 1.0 / FLOP_RATE_CAP_PER_S else FLOP_RATE_CAP_PER_S
        field = "flops_per_s" if direction == "fwd" else "bwd_flops_per_s"
        sources[f"compute.{field}.{op_class}"] = f"{note}: least squares on relative error"
    for direction in ("fwd", "bwd"):  # classes never measured in a direction take that direction's median rate
        measured = [rates[direction][c] for d, c in index if d == direction]
        if measured:
            rates[direction].setdefault(DEFAULT_OP_CLASS, statistics.median(measured))
    changes["flops_per_s"] = rates["fwd"]
    changes["bwd_flops_per_s"] = rates["bwd"] or None
    changes["fwd_node_overhead_s"] = float(x[index[("overhead", "fwd")]])
    changes["bwd_node_overhead_s"] = float(x[index[("overhead", "bwd")]])
    sources["compute.node_overhead_s"] = f"{note}: least squares on relative error"

    for kind, observed in transfers.items():
        if len(observed) < 2:
            continue
        latency_s, inverse = _nnls([[1.0, b] for b, _ in observed], [s for _, s in observed])
        changes[f"{kind}_latency_s"] = float(latency_s)
        if inverse > 0:
            changes[f"{kind}_throughput_bytes_per_s"] = float(1.0 / inverse)
        for key in ("latency_s", "throughput_bytes_per_s"):
            sources[f"{kind}.{key}"] = f"{note}: least squares over {len(observed)} transfers"
    if optimizer_rates:
        changes["optimizer_bytes_per_s"] = statistics.median(optimizer_rates)
        sources["step.optimizer_bytes_per_s"] = f"{note}: parameter bytes / median optimizer seconds"
    if len(rest_rows) >= 2:
        step_overhead_s, per_instruction_s = _nnls(rest_rows, rest_targets)
        changes["step_overhead_s"] = float(step_overhead_s)
        changes["instruction_overhead_s"] = float(per_instruction_s)
        for key in ("step_overhead_s", "instruction_overhead_s"):
            sources[f"step.{key}"] = f"{note}: step time outside instructions and optimizer, least squares"
    for location, values in frees.items():
        if values:
            changes[f"free_{location}_s"] = statistics.median(values)
            sources[f"step.free_{location}_s"] = f"{note}: median of {len(values)} frees"
    fitted = dataclasses.replace(profile, **changes, sources=sources)
    fitted = _fit_powers(fitted, runs, note, warmup_steps)
    return dataclasses.replace(fitted, description=f"{profile.description}; {note}")


def _measured_steps(run: CalibrationRun, warmup_steps: int) -> list[dict]:
    return [s for s in run.steps if int(s.get("step", 0)) > warmup_steps
            and str(s.get("energy_source", "")).startswith("measured:") and s.get("energy_j") is not None]


def _fit_powers(profile: PlatformProfile, runs: Sequence[CalibrationRun], note: str,
                warmup_steps: int) -> PlatformProfile:
    """With metered steps: energy = P_compute x compute s + P_paging x transfer s + P_idle x the rest."""
    rows, targets, label = [], [], ""
    for run in runs:
        by_step: dict[int, list[float]] = {}
        for event in run.instructions:
            kind = _kind(event)
            totals = by_step.setdefault(int(event.get("step", 0)), [0.0, 0.0])
            if kind == "compute":
                totals[0] += float(event.get("duration_s", 0.0))
            elif kind in ("page_in", "page_out"):
                totals[1] += float(event.get("duration_s", 0.0))
        for step in _measured_steps(run, warmup_steps):
            compute_s, paging_s = by_step.get(int(step["step"]), (0.0, 0.0))
            rest_s = max(float(step["duration_s"]) - compute_s - paging_s, 0.0)
            if float(step["energy_j"]) > 0:
                rows.append([compute_s, paging_s, rest_s])
                targets.append(float(step["energy_j"]))
                label = str(step["energy_source"])
    if len(rows) < 3:
        return profile
    compute_w, paging_w, idle_w = _nnls(rows, targets)
    sources = dict(profile.sources)
    for key in ("compute.compute_power_w", "memory_power_w", "idle_power_w"):
        sources[key] = f"{note}: least squares of {len(rows)} metered steps ({label})"
    return dataclasses.replace(
        profile, compute_power_w=max(float(compute_w), 1e-3), memory_power_w=float(paging_w),
        idle_power_w=float(idle_w), energy_per_flop_j=None, energy_source=label.split(" ")[0], sources=sources,
    )


def predict_step(profile: PlatformProfile, graph: TrainingGraph, schedule) -> tuple[float, float]:
    """(seconds, joules) of one training step of ``graph`` under ``schedule``, priced on ``profile``.

    The solver's runtime covers computes and transfers (what a schedule changes); a step also runs the
    optimizer and the executor's bookkeeping, which a calibrated profile prices too.
    """
    from host.costs.pricing import price_graph

    priced = price_graph(graph, profile)
    seconds = joules = other_s = 0.0
    for instruction in schedule.instructions:
        n = instruction.node
        if instruction.kind == "compute":
            seconds += priced.compute_s[n]
            joules += priced.compute_j[n]
        elif instruction.kind == "page_in":
            seconds += priced.page_in_s[n]
            joules += priced.page_in_j[n]
        elif instruction.kind == "page_out":
            seconds += priced.page_out_s[n]
            joules += priced.page_out_j[n]
        elif instruction.kind == "free":
            other_s += profile.free_flash_s if instruction.location == "flash" else profile.free_ram_s
    other_s += len(schedule.instructions) * profile.instruction_overhead_s + profile.step_overhead_s
    if profile.optimizer_bytes_per_s:
        other_s += graph.param_bytes / profile.optimizer_bytes_per_s
    other_w = profile.idle_power_w if profile.idle_power_w is not None else profile.compute_power_w
    return float(seconds + other_s), float(joules + other_s * other_w)


def _median_measured(run: CalibrationRun, key: str, warmup_steps: int, metered: bool = False) -> float | None:
    steps = _measured_steps(run, warmup_steps) if metered else [
        s for s in run.steps if int(s.get("step", 0)) > warmup_steps]
    values = [float(s[key]) for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else None


def step_time_mape(profile: PlatformProfile, runs: Sequence[CalibrationRun],
                   warmup_steps: int = WARMUP_STEPS) -> float:
    """Mean over runs of |predicted - measured median step seconds| / measured, in percent."""
    errors = []
    for run in runs:
        measured = _median_measured(run, "duration_s", warmup_steps)
        if measured:
            predicted, _ = predict_step(profile, run.graph, run.schedule)
            errors.append(abs(predicted - measured) / measured)
    if not errors:
        raise CalibrationError("no measured steps to compare with (after the warm-up steps)")
    return 100.0 * statistics.fmean(errors)


def energy_mape(profile: PlatformProfile, runs: Sequence[CalibrationRun],
                warmup_steps: int = WARMUP_STEPS) -> float | None:
    """As :func:`step_time_mape` for energy, over runs whose steps a meter measured; None when none was."""
    errors = []
    for run in runs:
        measured = _median_measured(run, "energy_j", warmup_steps, metered=True)
        if measured:
            _, predicted = predict_step(profile, run.graph, run.schedule)
            errors.append(abs(predicted - measured) / measured)
    return 100.0 * statistics.fmean(errors) if errors else None
