"""The one boundary between poet.v1 protobuf messages and the Python mirror types."""

from __future__ import annotations

import os
from pathlib import Path

from google.protobuf import json_format

from device_agent import protos
from device_agent.errors import UserError
from device_agent.fileio import atomic_write_text
from device_agent.schedule import (
    SCHEDULE_FORMAT_VERSION,
    Instruction,
    Prediction,
    Schedule,
    ScheduleNode,
    SolveInfo,
)

_pb = protos.load("poet.v1.schedule_pb2")

_KIND_TO_PB = {
    "compute": _pb.INSTRUCTION_KIND_COMPUTE,
    "page_out": _pb.INSTRUCTION_KIND_PAGE_OUT,
    "page_in": _pb.INSTRUCTION_KIND_PAGE_IN,
    "free": _pb.INSTRUCTION_KIND_FREE,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_LOCATION_TO_PB = {"ram": _pb.LOCATION_RAM, "flash": _pb.LOCATION_FLASH}
_LOCATION_FROM_PB = {v: k for k, v in _LOCATION_TO_PB.items()}
_PREDICTION_FIELDS = tuple(Prediction.__dataclass_fields__)
_SOLVE_FIELDS = tuple(SolveInfo.__dataclass_fields__)


class ScheduleFormatError(UserError, ValueError):
    """A schedule message or file that cannot be decoded."""


def schedule_to_proto(schedule: Schedule):
    message = _pb.Schedule(
        format_version=schedule.format_version,
        graph_name=schedule.graph_name,
        graph_fingerprint=schedule.graph_fingerprint,
        platform=schedule.platform,
        ram_budget_bytes=schedule.ram_budget_bytes,
        runtime_budget_s=schedule.runtime_budget_s,
        fixed_bytes=schedule.fixed_bytes,
        paging_in_runtime=schedule.paging_in_runtime,
        prediction=_pb.Prediction(**{f: getattr(schedule.prediction, f) for f in _PREDICTION_FIELDS}),
        solve=_pb.SolveInfo(**{f: getattr(schedule.solve, f) for f in _SOLVE_FIELDS}),
    )
    for node in schedule.nodes:
        message.nodes.add(name=node.name, kind=node.kind, output_bytes=node.output_bytes, deps=list(node.deps),
                          workspace_bytes=node.workspace_bytes)
    for ins in schedule.instructions:
        message.instructions.add(kind=_KIND_TO_PB[ins.kind], node=ins.node, location=_LOCATION_TO_PB[ins.location])
    return message


def schedule_from_proto(message) -> Schedule:
    instructions = []
    for position, ins in enumerate(message.instructions):
        if ins.kind not in _KIND_FROM_PB:
            raise ScheduleFormatError(f"instruction {position} has an unknown kind ({ins.kind})")
        if ins.location not in _LOCATION_FROM_PB:
            raise ScheduleFormatError(f"instruction {position} has an unknown location ({ins.location})")
        instructions.append(Instruction(_KIND_FROM_PB[ins.kind], ins.node, _LOCATION_FROM_PB[ins.location]))
    return Schedule(
        format_version=message.format_version,
        graph_name=message.graph_name,
        graph_fingerprint=message.graph_fingerprint,
        nodes=[ScheduleNode(n.name, n.kind, n.output_bytes, tuple(n.deps), n.workspace_bytes) for n in message.nodes],
        instructions=instructions,
        platform=message.platform,
        ram_budget_bytes=message.ram_budget_bytes,
        runtime_budget_s=message.runtime_budget_s,
        fixed_bytes=message.fixed_bytes,
        paging_in_runtime=message.paging_in_runtime,
        prediction=Prediction(**{f: getattr(message.prediction, f) for f in _PREDICTION_FIELDS}),
        solve=SolveInfo(**{f: getattr(message.solve, f) for f in _SOLVE_FIELDS}),
    )


def schedule_to_json(schedule: Schedule) -> str:
    return json_format.MessageToJson(schedule_to_proto(schedule), preserving_proto_field_name=True)


def schedule_from_json(text: str, source: str = "<schedule>") -> Schedule:
    try:
        message = json_format.Parse(text, _pb.Schedule())
    except json_format.ParseError as error:
        raise ScheduleFormatError(f"{source}: not a valid poet.v1.Schedule JSON document: {error}") from None
    return schedule_from_proto(message)


def write_schedule_file(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write atomically (see device_agent.fileio): a reader never sees half a schedule."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, schedule_to_json(schedule))


def read_schedule_file(path: str | os.PathLike) -> Schedule:
    """Read a schedule file written by :func:`write_schedule_file`; refuse what this version cannot check or run."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as error:
        raise ScheduleFormatError(f"cannot read schedule file {source}: {error.strerror}") from None
    schedule = schedule_from_json(text, source=str(source))
    check_schedule_file(schedule, str(source))
    return schedule


def check_schedule_file(schedule: Schedule, source: str) -> None:
    """A schedule file must be one (not `{}`), of a format version this code reads, with a graph fingerprint."""
    if not schedule.format_version and not schedule.nodes and not schedule.instructions:
        raise ScheduleFormatError(
            f"{source} is not a schedule: it has no format_version, nodes or instructions "
            "(write one with `poet solve --out FILE`)"
        )
    if schedule.format_version != SCHEDULE_FORMAT_VERSION:
        found = f"format_version {schedule.format_version}" if schedule.format_version else "no format_version"
        raise ScheduleFormatError(
            f"{source} has {found}; this poet-edge reads format_version {SCHEDULE_FORMAT_VERSION}: "
            "solve the schedule again with this version"
        )
    if not schedule.graph_fingerprint:
        raise ScheduleFormatError(
            f"{source} has no graph_fingerprint, so it cannot be checked against the model it is run on: "
            "solve the schedule again with `poet solve --out`"
        )


# ------------------------------------------------------------------------------------------ fleet
_fleet = protos.load("poet.v1.fleet_pb2")


def grouping_to_proto(spec, *, batch_shape: tuple[int, ...], batch_dtype: str, num_classes: int,
                      class_index_shape: tuple[int, ...] = ()):
    """A :class:`~device_agent.executor.split.PartitionSpec` as the job's NodeGrouping."""
    message = _fleet.NodeGrouping(
        batch_placeholders=list(spec.batch_placeholders),
        reference_placeholder=spec.reference_placeholder,
        loss_value=spec.loss_value,
        node_flops=[int(f) for f in spec.node_flops],
        granularity=spec.granularity,
        batch_shape=[int(d) for d in batch_shape],
        batch_dtype=batch_dtype,
        num_classes=int(num_classes),
        class_index_shape=[int(d) for d in class_index_shape],
    )
    for group in spec.groups:
        message.groups.add(
            name=group.name, kind=group.kind, ops=list(group.ops), reads=list(group.reads),
            produces=list(group.produces), param_names=list(group.param_names),
            buffer_names=list(group.buffer_names), bwd_index=-1 if group.bwd_index is None else group.bwd_index,
            grad_reads=list(group.grad_reads), pinned_internals=group.pinned_internals,
        )
    return message


def partition_spec_from_proto(grouping, schedule: Schedule):
    """The PartitionSpec a job describes: its grouping plus the schedule's graph nodes (ScheduleFormatError)."""
    from device_agent.executor.partition import PartitionNode
    from device_agent.executor.split import GroupSpec, PartitionSpec

    size = len(schedule.nodes)
    if len(grouping.node_flops) != size:
        raise ScheduleFormatError(
            f"the job's grouping gives FLOPs for {len(grouping.node_flops)} nodes but its schedule has {size}")
    groups = []
    forward_of: dict[int, int] = {}
    for index, group in enumerate(grouping.groups):
        if index >= size or schedule.nodes[index].kind not in ("fwd", "loss") or schedule.nodes[index].name != group.name:
            raise ScheduleFormatError(
                f"the job's grouping names node {index} {group.name!r}, which is not fwd/loss node {index} of its "
                "schedule: grouping and schedule come from different traces")
        bwd_index = None if group.bwd_index < 0 else int(group.bwd_index)
        if bwd_index is not None:
            if not index < bwd_index < size or schedule.nodes[bwd_index].kind != "bwd":
                raise ScheduleFormatError(f"node {index} ({group.name}) names backward node {bwd_index}, which the "
                                          "schedule does not have")
            forward_of[bwd_index] = index
        groups.append(GroupSpec(
            index=index, name=group.name, kind=group.kind, ops=tuple(group.ops), reads=tuple(group.reads),
            produces=tuple(group.produces), param_names=tuple(group.param_names),
            buffer_names=tuple(group.buffer_names), bwd_index=bwd_index, grad_reads=tuple(group.grad_reads),
            pinned_internals=group.pinned_internals,
        ))
    nodes = tuple(
        PartitionNode(i, n.name, n.kind, tuple(n.deps), n.output_bytes, forward_of.get(i), n.workspace_bytes)
        for i, n in enumerate(schedule.nodes)
    )
    missing = [n.name for n in nodes if n.kind == "bwd" and n.forward_index is None]
    if missing:
        raise ScheduleFormatError(f"backward node {missing[0]!r} differentiates no node of the job's grouping")
    return PartitionSpec(
        graph_name=schedule.graph_name, groups=tuple(groups), nodes=nodes,
        node_flops=tuple(int(f) for f in grouping.node_flops), batch_placeholders=tuple(grouping.batch_placeholders),
        reference_placeholder=grouping.reference_placeholder, loss_value=grouping.loss_value,
        granularity=grouping.granularity or "layer",
    )


_INSTRUCTION_FIELDS = ("step", "position", "node", "node_name", "node_kind", "duration_s", "bytes_moved",
                       "ram_in_use_bytes", "rss_bytes", "recompute", "cpu_s", "energy_source", "compute_thread_s")
_STEP_FIELDS = ("step", "duration_s", "loss", "peak_tracked_bytes", "peak_pinned_bytes", "ram_budget_bytes",
                "fixed_bytes", "computes", "recomputes", "page_ins", "page_outs", "frees", "bytes_paged_out",
                "bytes_paged_in", "compute_s", "paging_s", "optimizer_s", "cpu_s", "energy_source", "rss_peak_bytes",
                "program_runs", "backward_runs", "saved_tensor_reads")


def telemetry_event_to_proto(event, *, job_id: str, unix_time_s: float):
    """An executor event (InstructionEvent or StepSummary) as a TelemetryEvent without its sequence number."""
    message = _fleet.TelemetryEvent(job_id=job_id, unix_time_s=unix_time_s)
    if event.type == "instruction":
        instruction = _fleet.InstructionTelemetry(
            kind=_KIND_TO_PB[event.kind], location=_LOCATION_TO_PB[event.location],
            **{f: value for f in _INSTRUCTION_FIELDS if (value := getattr(event, f)) is not None},
        )
        if event.energy_j is not None:
            instruction.energy_j = event.energy_j
        message.instruction.CopyFrom(instruction)
    else:
        step = _fleet.StepTelemetry(**{f: getattr(event, f) for f in _STEP_FIELDS})
        if event.energy_j is not None:
            step.energy_j = event.energy_j
        message.step.CopyFrom(step)
    return message


def rss_event_to_proto(rss_bytes: int, *, job_id: str, unix_time_s: float):
    return _fleet.TelemetryEvent(job_id=job_id, unix_time_s=unix_time_s, rss=_fleet.RssSample(rss_bytes=rss_bytes))
