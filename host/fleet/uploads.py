"""Models operators upload: archives they traced on their own side, received and checked as boards check them.

The coordinator never imports an operator's model code (DESIGN.md): `poet run --model module:callable` traces on
the operator's machine and uploads the torch.export archive, content-addressed, then submits its digest with the
grouping and the TrainingGraph. An upload lands in ``STATE_DIR/models/<sha256>.pt2.part``: each chunk must start
where the part ends and match its chunk_sha256, the whole must stay within :data:`MAX_MODEL_BYTES` and the free
space; once whole, the file must hash to its digest and pass :func:`check_archive` (nothing in it would be
unpickled), and only then is it renamed to ``<sha256>.pt2``, which boards fetch. A broken upload resumes from the
part's size (:meth:`UploadedArchives.stat`).

At submit, :meth:`UploadedArchives.package` loads the stored archive as a board does (:func:`load_module`: checked,
then ``torch.export.load``, which runs no operator code) and splits it by the grouping, whose node FLOPs and the
graph's structure must give the graph's fingerprint, so a schedule solved on the graph fits the archive.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from device_agent.agent.transfer import sha256_file
from device_agent.fileio import _fsync_directory
from host.fleet.limits import MAX_MODEL_BYTES, MODEL_CHUNK_BYTES
from host.run.errors import UserError

ARCHIVE_SUFFIX = ".pt2"  # as host.fleet.model_package writes them and boards fetch them
PART_SUFFIX = ARCHIVE_SUFFIX + ".part"
FREE_MARGIN_BYTES = 64 * 1024 * 1024  # room kept free beside an upload (the store, results, other uploads)
_DIGEST = re.compile(r"[0-9a-f]{64}")


class UploadError(UserError, ValueError):
    """An upload or an uploaded model the coordinator refuses; ``kind`` says which status fits."""

    def __init__(self, message: str, kind: str = "invalid"):  # invalid | corrupt | busy | missing | full
        super().__init__(message)
        self.kind = kind


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise UploadError(f"model digest {str(digest)[:80]!r} is not 64 lowercase hex digits (the archive's sha256)")
    return digest


class UploadedArchives:
    """The coordinator's side of UploadModel and StatModel, over its models directory."""

    def __init__(self, models_dir: str | os.PathLike, *, max_size_bytes: int = MAX_MODEL_BYTES,
                 free_margin_bytes: int = FREE_MARGIN_BYTES):
        self.directory = Path(models_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_size_bytes = max_size_bytes
        self.free_margin_bytes = free_margin_bytes
        self._lock = threading.Lock()
        self._receiving: set[str] = set()  # digests an upload is being written to now
        self._checked: dict[tuple[str, str], Any] = {}  # (digest, graph fingerprint) -> package

    def path(self, digest: str) -> Path:
        return self.directory / f"{check_digest(digest)}{ARCHIVE_SUFFIX}"

    def part(self, digest: str) -> Path:
        return self.directory / f"{check_digest(digest)}{PART_SUFFIX}"

    def stat(self, digest: str) -> tuple[bool, int]:
        """(stored, bytes of an unfinished upload held)."""
        if self.path(digest).is_file():
            return True, 0
        part = self.part(digest)
        return False, part.stat().st_size if part.is_file() else 0

    def receive(self, digest: str, chunks) -> tuple[bool, int]:
        """Append ``chunks`` (poet.v1.ModelChunk, in order) to the digest's part; store it once whole and checked.

        Returns what :meth:`stat` returns after. A chunk out of place, damaged, or past the size limit, or a whole
        archive that hashes otherwise or fails :func:`check_archive`, raises UploadError; a damaged upload's part is
        deleted (start again from 0), a chunk out of place leaves it (resume from :meth:`stat`).
        """
        check_digest(digest)
        with self._lock:
            if digest in self._receiving:
                raise UploadError(f"model {digest[:12]} is being uploaded by another call; retry once it ended",
                                  "busy")
            self._receiving.add(digest)
        try:
            if self.path(digest).is_file():
                for _ in chunks:  # already stored: the rest of the stream is not needed
                    break
                return True, 0
            return self._receive(digest, chunks)
        finally:
            with self._lock:
                self._receiving.discard(digest)

    def _receive(self, digest: str, chunks) -> tuple[bool, int]:
        part = self.part(digest)
        offset = part.stat().st_size if part.is_file() else 0
        total = None
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for upload in chunks:
                if upload.digest != digest:
                    raise UploadError(f"a chunk names model {upload.digest[:80]!r} in the upload of {digest}: one "
                                      "upload carries one archive")
                chunk = upload.chunk
                if chunk.offset_bytes != offset:
                    raise UploadError(f"chunk at offset {chunk.offset_bytes} of model {digest[:12]}, but the "
                                      f"coordinator holds {offset} bytes of it: resume from StatModel's received_bytes")
                if total is None:
                    total = int(chunk.total_size_bytes)
                    self._check_size(digest, total, offset)
                elif chunk.total_size_bytes != total:
                    raise self._corrupt(digest, "its chunks give different total sizes")
                if len(chunk.data) > MODEL_CHUNK_BYTES:
                    raise UploadError(f"a chunk of {len(chunk.data)} bytes is over the {MODEL_CHUNK_BYTES}-byte "
                                      "chunk size: send the archive in smaller chunks")
                if hashlib.sha256(chunk.data).hexdigest() != chunk.chunk_sha256:
                    raise self._corrupt(digest, f"the chunk at offset {offset} does not match its chunk_sha256")
                if offset + len(chunk.data) > total:
                    raise self._corrupt(digest, f"the chunk at offset {offset} runs past the {total} bytes announced")
                view = memoryview(chunk.data)
                while view:
                    view = view[os.write(fd, view):]
                offset += len(chunk.data)
            os.fsync(fd)
        except OSError as error:
            part.unlink(missing_ok=True)
            raise UploadError(f"cannot write model {digest[:12]} on the coordinator: {error.strerror}", "full") \
                from None
        finally:
            os.close(fd)
        if total is None or offset < total:
            return False, offset  # the rest comes in another call
        return self._finish(digest, part)

    def _check_size(self, digest: str, total: int, have: int) -> None:
        if total > self.max_size_bytes:
            self.part(digest).unlink(missing_ok=True)
            raise UploadError(f"model {digest[:12]} is {total} bytes, over the coordinator's limit of "
                              f"{self.max_size_bytes} bytes for an archive: train a smaller model")
        free = shutil.disk_usage(self.directory).free
        needed = total - have + self.free_margin_bytes
        if free < needed:
            raise UploadError(f"the coordinator has {free} bytes free for model {digest[:12]} ({total} bytes), "
                              f"{needed} needed with its margin: free space in its state dir", "full")

    def _corrupt(self, digest: str, why: str) -> UploadError:
        self.part(digest).unlink(missing_ok=True)
        return UploadError(f"the upload of model {digest[:12]} arrived damaged ({why}); it was dropped: upload the "
                           "archive again from the start", "corrupt")

    def _finish(self, digest: str, part: Path) -> tuple[bool, int]:
        from device_agent.agent.program import ModelArchiveError, check_archive

        got = sha256_file(part)
        if got != digest:
            raise self._corrupt(digest, f"the whole archive hashes to {got}, not {digest}")
        try:
            check_archive(part)
        except ModelArchiveError as error:
            part.unlink(missing_ok=True)
            raise UploadError(f"{error} (the boards would refuse it too); nothing was stored") from None
        os.replace(part, self.path(digest))
        _fsync_directory(self.directory)
        return True, 0

    def package(self, name: str, uploaded):
        """The stored archive of ``uploaded`` (poet.v1.UploadedModel) as a ModelPackage to solve and send (UploadError)."""
        from device_agent.agent.program import ModelArchiveError, load_module
        from device_agent.executor.split import SplitError, check_split
        from device_agent.serde import ScheduleFormatError, partition_spec_from_proto
        from host.fleet.model_package import ModelPackage
        from host.graph.training_graph import GraphError, TrainingGraph

        digest = check_digest(uploaded.digest)
        path = self.path(digest)
        if not path.is_file():
            raise UploadError(f"no uploaded model {digest[:12]} on this coordinator: upload it first (UploadModel; "
                              "`poet run` does it)", "missing")
        try:
            graph = TrainingGraph.from_dict(json.loads(uploaded.graph_json))
        except (ValueError, KeyError, TypeError, AttributeError, GraphError) as error:
            raise UploadError(f"graph_json of model {digest[:12]} is not a TrainingGraph ({error}); send "
                              "TrainingGraph.to_dict() of the traced model as JSON") from None
        fingerprint = graph.fingerprint()
        key = (digest, fingerprint)
        with self._lock:
            known = self._checked.get(key)
        if known is not None and known.grouping == uploaded.grouping:
            return known
        nodes = [SimpleNamespace(name=n.name, kind=n.kind, deps=n.deps, output_bytes=n.output_bytes,
                                 workspace_bytes=n.workspace_bytes)
                 for n in graph.nodes]
        try:
            spec = partition_spec_from_proto(uploaded.grouping, SimpleNamespace(graph_name=graph.name, nodes=nodes))
        except ScheduleFormatError as error:
            raise UploadError(f"the grouping of model {digest[:12]} does not fit its graph: {error}") from None
        if spec.fingerprint() != fingerprint:
            raise UploadError(f"the grouping of model {digest[:12]} gives graph fingerprint {spec.fingerprint()} but "
                              f"its graph has {fingerprint}: grouping and graph come from different traces; trace "
                              "again and send both")
        try:
            module = load_module(path)  # what a board does: checked, loaded, made schedulable
            check_split(module, spec)
        except (ModelArchiveError, SplitError) as error:
            raise UploadError(f"uploaded model {digest[:12]}: {error}") from None
        del module
        batch_size = int(uploaded.batch_size) or (int(uploaded.grouping.batch_shape[0])
                                                  if uploaded.grouping.batch_shape else 0)
        if batch_size < 1:
            raise UploadError(f"uploaded model {digest[:12]} names no batch size: send the one it was traced with")
        package = ModelPackage(model=name, digest=digest, path=path, size_bytes=path.stat().st_size,
                               grouping=uploaded.grouping, graph=graph, batch_size=batch_size)
        with self._lock:
            self._checked[key] = package
        return package


def upload_chunks(digest: str, path: str | os.PathLike, offset: int, chunk_bytes: int = MODEL_CHUNK_BYTES):
    """The ModelUpload messages that send ``path`` from ``offset`` (the operator's side)."""
    from host.fleet.serde import fleet_pb2

    total = Path(path).stat().st_size
    with open(path, "rb") as handle:
        handle.seek(offset)
        while data := handle.read(chunk_bytes):
            yield fleet_pb2.ModelUpload(digest=digest, chunk=fleet_pb2.ModelChunk(
                offset_bytes=offset, data=data, total_size_bytes=total, chunk_sha256=hashlib.sha256(data).hexdigest()))
            offset += len(data)
