"""Fetch a model archive by digest into STATE_DIR/models/<digest>.pt2, resumably, never holding it in RAM.

Chunks are appended to ``<digest>.pt2.part`` as they arrive, each checked against its
``chunk_sha256``; a broken connection resumes from the part's size. At the end the whole file's
sha256 must equal the digest, then it is fsynced and renamed (so ``<digest>.pt2`` is always a whole,
verified archive) and the directory fsynced. A corrupted chunk or archive deletes the part and starts
over, at most ``max_corrupt_attempts`` times. A full flash (checked before fetching, and ENOSPC
while writing) fails with :class:`DiskFullError` and leaves no partial file behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from device_agent.fileio import _fsync_directory  # the atomic helper's directory fsync, one copy

__all__ = ["DiskFullError", "FetchCancelled", "ModelFetchError", "ModelStore", "TRANSIENT_CODES"]

MODELS_DIR = "models"
SUFFIX = ".pt2"
PART_SUFFIX = ".pt2.part"
DEFAULT_MARGIN_BYTES = 16 * 1024 * 1024  # room kept free beside the archive (checkpoints, pages, SQLite)
DEFAULT_MAX_CORRUPT_ATTEMPTS = 3
_DIGEST = re.compile(r"[0-9a-f]{64}")
_READ_BYTES = 1 << 20

# Errors worth retrying after a pause: the coordinator or the network will be back.
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
                             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})


class ModelFetchError(RuntimeError):
    """The model cannot be had; the message is the one-line error the job's FAILED result carries."""


class DiskFullError(ModelFetchError):
    """Not enough free space on the file system holding the state dir."""


class FetchCancelled(Exception):
    """The job was cancelled (or the agent is stopping) while the model was being fetched."""


class _Corrupt(Exception):
    pass


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


class ModelStore:
    """The agent's cache of model archives, filled through the Fleet service's FetchModel."""

    def __init__(self, state_dir: str | os.PathLike, *, log: Callable[[str], None] = lambda _m: None,
                 max_corrupt_attempts: int = DEFAULT_MAX_CORRUPT_ATTEMPTS,
                 margin_bytes: int = DEFAULT_MARGIN_BYTES) -> None:
        self.directory = Path(state_dir) / MODELS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.max_corrupt_attempts = max_corrupt_attempts
        self.margin_bytes = margin_bytes

    def path_for(self, digest: str) -> Path:
        return self.directory / f"{_check_digest(digest)}{SUFFIX}"

    def part_path(self, digest: str) -> Path:
        return self.directory / f"{_check_digest(digest)}{PART_SUFFIX}"

    def cached(self, digest: str) -> Path | None:
        """The cached archive when its content still hashes to ``digest``; a damaged one is deleted."""
        path = self.path_for(digest)
        if not path.is_file():
            return None
        if sha256_file(path) == digest:
            return path
        self.log(f"cached model {digest[:12]} does not match its digest; deleting it and fetching again")
        path.unlink(missing_ok=True)
        return None

    def fetch(self, stub, digest: str, size_bytes: int, *, cancel: threading.Event | None = None,
              wait_retry: Callable[[grpc.RpcError], None] | None = None) -> Path:
        """The verified archive's path, from the cache or fetched through ``stub.FetchModel``.

        Transient gRPC errors (see :data:`TRANSIENT_CODES`) call ``wait_retry(error)`` (which sleeps,
        or raises to give up) and resume from the part's size; without it they propagate. Other gRPC
        errors become :class:`ModelFetchError`.
        """
        cancel = cancel or threading.Event()
        found = self.cached(digest)
        if found is not None:
            self.log(f"model {digest[:12]} found in the cache")
            return found
        part = self.part_path(digest)
        corrupt = 0
        while True:
            if cancel.is_set():
                raise FetchCancelled(f"fetching model {digest[:12]} was cancelled")
            have = part.stat().st_size if part.exists() else 0
            self._check_space(digest, size_bytes, have)
            try:
                self._stream(stub, digest, part, have, cancel)
            except _Corrupt as why:
                corrupt += 1
                part.unlink(missing_ok=True)
                if corrupt >= self.max_corrupt_attempts:
                    raise ModelFetchError(f"model {digest} arrived corrupted {corrupt} times (last: {why})") from None
                self.log(f"model {digest[:12]} arrived corrupted ({why}); fetching it again "
                         f"(attempt {corrupt + 1} of {self.max_corrupt_attempts})")
                continue
            except OSError as exc:
                part.unlink(missing_ok=True)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(f"flash full while writing model {digest[:12]} to {self.directory}: "
                                        f"{exc.strerror}; free space or give the agent a larger state dir") from None
                raise ModelFetchError(f"cannot write model {digest[:12]} to {self.directory}: {exc}") from None
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if cancel.is_set():
                    raise FetchCancelled(f"fetching model {digest[:12]} was cancelled") from None
                if code == grpc.StatusCode.OUT_OF_RANGE and have:  # the part is longer than the archive
                    corrupt += 1
                    part.unlink(missing_ok=True)
                    if corrupt >= self.max_corrupt_attempts:
                        raise ModelFetchError(f"model {digest} arrived corrupted {corrupt} times (last: the partial "
                                              f"file ran past the archive's end)") from None
                    self.log(f"partial model {digest[:12]} is longer than the archive; fetching it from the start")
                    continue
                if code not in TRANSIENT_CODES or wait_retry is None:
                    if code in TRANSIENT_CODES:
                        raise
                    part.unlink(missing_ok=True)
                    details = exc.details() if hasattr(exc, "details") else str(exc)
                    raise ModelFetchError(f"coordinator refused model {digest[:12]}: "
                                          f"{getattr(code, 'name', code)}: {details}") from None
                size_now = part.stat().st_size if part.exists() else 0
                self.log(f"model {digest[:12]} transfer broke at {size_now} of {size_bytes} bytes "
                         f"({code.name}); resuming")
                wait_retry(exc)
                continue
            final = self.path_for(digest)
            os.replace(part, final)
            _fsync_directory(self.directory)
            return final

    def _check_space(self, digest: str, size_bytes: int, have: int) -> None:
        free = shutil.disk_usage(self.directory).free
        needed = max(0, int(size_bytes) - have) + self.margin_bytes
        if free < needed:
            Path(self.part_path(digest)).unlink(missing_ok=True)
            raise DiskFullError(f"not enough free space for model {digest[:12]} ({int(size_bytes)} bytes) in "
                                f"{self.directory}: {free} bytes free, {needed} needed with the "
                                f"{self.margin_bytes}-byte margin")

    def _stream(self, stub, digest: str, part: Path, have: int, cancel: threading.Event) -> None:
        """Append the archive from ``have`` to ``part``; returns once the whole file verifies."""
        whole = hashlib.sha256()
        if have:
            with open(part, "rb") as handle:
                while block := handle.read(_READ_BYTES):
                    whole.update(block)
        fleet_pb2 = _fleet_pb2()
        call = stub.FetchModel(fleet_pb2.FetchModelRequest(digest=digest, offset_bytes=have))
        offset, total = have, None
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for chunk in call:
                if cancel.is_set():
                    raise FetchCancelled(f"fetching model {digest[:12]} was cancelled")
                if chunk.offset_bytes != offset:
                    raise _Corrupt(f"chunk at offset {chunk.offset_bytes}, expected {offset}")
                if hashlib.sha256(chunk.data).hexdigest() != chunk.chunk_sha256:
                    raise _Corrupt(f"chunk at offset {offset} does not match its chunk_sha256")
                total = chunk.total_size_bytes
                if offset + len(chunk.data) > total:
                    raise _Corrupt(f"chunk at offset {offset} runs past the archive's {total} bytes")
                view = memoryview(chunk.data)
                while view:
                    view = view[os.write(fd, view):]
                whole.update(chunk.data)
                offset += len(chunk.data)
            if total is None and have and whole.hexdigest() == digest:
                pass  # the part was already whole (the stream broke after its last chunk): nothing was left to send
            elif total is None or offset < total:
                raise _ShortStream(offset, total)
            os.fsync(fd)
        except BaseException:
            call.cancel()  # stop the server sending the rest; harmless on a finished call
            raise
        finally:
            os.close(fd)
        if whole.hexdigest() != digest:
            raise _Corrupt(f"the whole archive hashes to {whole.hexdigest()[:12]}, not {digest[:12]}")


class _ShortStream(grpc.RpcError):
    """The stream ended before the archive did: treated like a broken connection (resume)."""

    def __init__(self, offset: int, total: int | None) -> None:
        super().__init__(f"stream ended at byte {offset} of {total}")
        self._details = f"stream ended at byte {offset} of {total if total is not None else '?'}"

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._details


def _check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ModelFetchError(f"model digest {str(digest)[:80]!r} is not 64 lowercase hex digits (sha256)")
    return digest


def _fleet_pb2():
    from device_agent.protos import load

    return load("poet.v1.fleet_pb2")

