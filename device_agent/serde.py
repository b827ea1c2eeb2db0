"""The one boundary between poet.v1 protobuf messages and the Python mirror types."""

from __future__ import annotations

import os
from pathlib import Path

from google.protobuf import json_format

from device_agent import protos
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


class ScheduleFormatError(ValueError):
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
        message.nodes.add(name=node.name, kind=node.kind, output_bytes=node.output_bytes, deps=list(node.deps))
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
        nodes=[ScheduleNode(n.name, n.kind, n.output_bytes, tuple(n.deps)) for n in message.nodes],
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
