"""Atomic file writes: a reader, or the next boot after a power cut, sees the old file or the new one, never half.

The data goes to a temporary file in the target's directory (a rename is atomic only within one file system),
which is fsynced before ``os.replace`` (else the rename can reach the disk before the data, and a crash leaves
an empty file under the final name); then the directory is fsynced so the rename itself survives a crash. On
any error, KeyboardInterrupt included, the temporary file is removed and an existing target is left untouched.
Boards are switched off by pulling the plug, and SD cards reorder writes, so every step matters there.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_chunks", "atomic_write_text", "write_back_data"]

# sync_file_range(2) flags: wait for write-back already under way, start it for every dirty page, wait for it all
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
_SYNC_FILE_RANGE_ALL = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER


def _sync_file_range():
    """Linux's sync_file_range from the C library, or None (another system, or a libc without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()


def write_back_data(fd: int) -> None:
    """Write the file's data pages to the device and wait for them, without the metadata a crash would need
    (sync_file_range on Linux; fdatasync elsewhere). Afterwards the pages are clean, so POSIX_FADV_DONTNEED
    drops them from the page cache. For scratch files only: after a power cut the file may be empty or torn.
    Cheaper than fsync, which also commits the file system's journal (docs/benchmarks.md, "Page-outs without
    fsync")."""
    if _SYNC_FILE_RANGE is None:
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)
    elif _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_ALL) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def atomic_write_chunks(
    path: str | os.PathLike,
    chunks: Iterable[bytes | bytearray | memoryview],
    *,
    mode: int = 0o644,
    before_close: Callable[[int], object] | None = None,
    durable_rename: bool = True,
    sync: Callable[[int], object] | None = None,
) -> int:
    """Replace ``path`` with the concatenated ``chunks`` atomically; returns the bytes written.

    ``chunks`` is consumed in order while writing, so a generator can stream large buffers (and
    compute a checksum for its last chunk) without joining them in memory. ``before_close(fd)`` runs
    after the fsync (the page store drops the file from the page cache there). ``durable_rename=False``
    skips the directory fsync, for scratch files that a crash may lose (pages of a running step); ``sync`` is how
    the data reaches the device before the rename: ``os.fsync`` (data and metadata; the default), or
    :func:`write_back_data` (data only) for such scratch files.
    The parent directory must exist. ``mode`` is set explicitly because ``mkstemp`` creates files rw-------.
    """
    target = Path(path)
    directory = target.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    written = 0
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                written += len(view)
                while view:
                    view = view[os.write(fd, view) :]
            (os.fsync if sync is None else sync)(fd)
            if before_close is not None:
                before_close(fd)
        finally:
            os.close(fd)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    if durable_rename:
        _fsync_directory(directory)
    return written


def atomic_write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably; the file gets permissions ``mode``."""
    atomic_write_chunks(path, (data,), mode=mode)


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int = 0o644) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; skipped where a directory cannot be opened (Windows)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
