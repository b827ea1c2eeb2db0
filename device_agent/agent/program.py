"""A received model on the board: check the torch.export archive, load it, and split it as the host did.

Nothing from the network is unpickled. ``torch.export.load`` unpickles in three places: weights or
constants flagged ``use_pickle``, custom-object constants, and sample inputs that fail to load with
``weights_only=True`` (it then retries without). :func:`check_archive` refuses the first two and loads
the sample inputs itself with ``weights_only=True`` first, so the loader never takes the fallback.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule

from device_agent.executor.partition import Partition
from device_agent.executor.split import PartitionSpec, SplitError, check_split, make_schedulable, partition_from_program
from device_agent.schedule import Schedule
from device_agent.serde import ScheduleFormatError, partition_spec_from_proto

__all__ = ["LoadedProgram", "ModelArchiveError", "check_archive", "load_program", "save_archive"]

MAX_ARCHIVE_ENTRY_BYTES = 16 * 1024**3  # refuses a zip bomb before anything is inflated
_ALLOWED_ENTRY = re.compile(
    r"^[^/]+/("
    r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/[A-Za-z0-9_.-]+\.json"
    r"|data/weights/[A-Za-z0-9_.-]+_config\.json|data/weights/weight_\d+"
    r"|data/constants/[A-Za-z0-9_.-]+_config\.json|data/constants/tensor_\d+"
    r"|data/sample_inputs/[A-Za-z0-9_.-]+\.pt"
    r")$"
)


class ModelArchiveError(ValueError):
    """A model archive the board refuses to load, or a job whose grouping does not fit it."""


def save_archive(exported: torch.export.ExportedProgram, path: str | Path) -> None:
    """Write ``exported`` as a torch.export archive (the host side; the caller makes it atomic)."""
    torch.export.save(exported, path)


def check_archive(path: str | Path) -> None:
    """Refuse an archive that would make ``torch.export.load`` unpickle anything (ModelArchiveError)."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise ModelArchiveError(f"model archive {path.name} is not a torch.export archive ({error})") from None
    with archive:
        for info in archive.infolist():
            if not _ALLOWED_ENTRY.match(info.filename):
                raise ModelArchiveError(
                    f"model archive {path.name} holds {info.filename!r}, which is not part of a plain torch.export "
                    "archive (pickled objects are refused): export the model again with torch.export.save"
                )
            if info.file_size > MAX_ARCHIVE_ENTRY_BYTES:
                raise ModelArchiveError(f"model archive {path.name}: entry {info.filename!r} inflates to "
                                        f"{info.file_size} bytes, over the limit of {MAX_ARCHIVE_ENTRY_BYTES}")
            name = info.filename.split("/", 1)[1]
            if name.endswith("_config.json"):
                _check_payload_config(path.name, info.filename, archive.read(info))
            elif name.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(archive.read(info)), weights_only=True)
                except Exception as error:
                    raise ModelArchiveError(
                        f"model archive {path.name}: its sample inputs do not load without unpickling ({error})"
                    ) from None


def _check_payload_config(archive_name: str, entry: str, raw: bytes) -> None:
    try:
        config = json.loads(raw)["config"]
        items = list(config.items())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ModelArchiveError(f"model archive {archive_name}: {entry} is not a payload config") from None
    for fqn, meta in items:
        if not isinstance(meta, dict) or meta.get("use_pickle") or not re.fullmatch(
            r"(weight|tensor)_\d+", str(meta.get("path_name", ""))
        ):
            raise ModelArchiveError(
                f"model archive {archive_name}: {fqn!r} in {entry} is stored as a pickled object, which the board "
                "refuses to load; only plain tensors may travel"
            )


@dataclass
class LoadedProgram:
    """A received model, split into node programs for its schedule."""

    module: GraphModule  # ``module(*batch, labels=labels)`` returns the loss
    partition: Partition
    spec: PartitionSpec


def load_program(archive_path: str | Path, grouping, schedule: Schedule) -> LoadedProgram:
    """Load an archive (checked first), split it by the job's grouping, and check the schedule's fingerprint."""
    try:
        spec = partition_spec_from_proto(grouping, schedule)
    except ScheduleFormatError as error:
        raise ModelArchiveError(f"the job cannot run: {error}") from None
    fingerprint = spec.fingerprint()
    if fingerprint != schedule.graph_fingerprint:
        raise ModelArchiveError(
            f"the job's graph has fingerprint {fingerprint} but its schedule was solved for "
            f"{schedule.graph_fingerprint}: the schedule belongs to another model or trace; solve it again"
        )
    module = load_module(archive_path)
    try:
        check_split(module, spec)
    except SplitError as error:
        raise ModelArchiveError(str(error)) from None
    return LoadedProgram(module, partition_from_program(module, spec), spec)


def load_module(archive_path: str | Path) -> GraphModule:
    """The archive's training program, made schedulable as the host made it (checked first)."""
    check_archive(archive_path)
    try:
        exported = torch.export.load(str(archive_path))
    except Exception as error:
        raise ModelArchiveError(f"model archive {Path(archive_path).name} does not load: {error}") from None
    return make_schedulable(exported.module())
