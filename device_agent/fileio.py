"""Atomic file writes: a reader, or the next boot after a power cut, sees the old file or the new one, never half.

The data goes to a temporary file in the target's directory (a rename is atomic only within one file system),
which is fsynced before ``os.replace`` (else the rename can reach the disk before the data, and a crash leaves
an empty file under the final name); then the directory is fsynced so the rename itself survives a crash. On
any error, KeyboardInterrupt included, the temporary file is removed and an existing target is left untouched.
Boards are switched off by pulling the plug, and SD cards reorder writes, so every step matters there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably; the file gets permissions ``mode``.

    The parent directory must exist. ``mode`` is set explicitly because ``mkstemp`` creates files rw-------.
    """
    target = Path(path)
    directory = target.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(directory)


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
