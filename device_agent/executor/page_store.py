"""The flash page store: one file per paged node, written atomically and checked on the way back.

A page-out writes a temporary file, fsyncs it, renames it into place and drops it from the OS page
cache (``posix_fadvise(DONTNEED)``), so the page-in that follows really reads the device. The file
carries a CRC-32 of its header and payload; a page-in verifies it. Files live in a private
subdirectory of the flash directory, created at the first page-out and removed with the last page
(and on :meth:`FlashPageStore.clear` after a failure), so nothing stays behind between steps.

File format (little endian): magic ``POETPG\\0\\1``, node u32, storage count u32, payload bytes u64,
one u64 size per storage, the storages' bytes, then CRC-32 u32 and ``END\\0``.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import tempfile
import zlib
from dataclasses import dataclass

import torch

from device_agent.executor.ram_store import Entry, EntryLayout, storage_bytes

_MAGIC = b"POETPG\x00\x01"
_HEADER = struct.Struct("<8sIIQ")
_SIZE = struct.Struct("<Q")
_TRAILER = struct.Struct("<I4s")
_TRAILER_MAGIC = b"END\x00"
_DIR_PREFIX = ".poet-pages-"


class PageStoreError(RuntimeError):
    """A page file that cannot be written or read back."""


class FlashDirError(PageStoreError):
    """The flash directory is missing, not a directory, or not writable."""


class FlashFullError(PageStoreError):
    """The flash device ran out of space during a page-out."""


class PageCorruptError(PageStoreError):
    """A page file whose checksum, size or header does not match what was written."""


def check_flash_dir(flash_dir: str | os.PathLike) -> None:
    """Raise FlashDirError (naming the directory and the fix) unless it is a writable directory."""
    path = os.fspath(flash_dir)
    if not os.path.exists(path):
        raise FlashDirError(f"flash dir {path!r} does not exist: create it (mkdir -p {path}) or pass another --flash-dir")
    if not os.path.isdir(path):
        raise FlashDirError(f"flash dir {path!r} is not a directory: pass --flash-dir an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise FlashDirError(f"flash dir {path!r} is not writable by this user: fix its permissions or pass another --flash-dir")


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _drop_cache(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True


@dataclass
class _Page:
    path: str
    name: str
    layout: EntryLayout
    file_bytes: int


class FlashPageStore:
    """Page files for node entries, in a private subdirectory of ``flash_dir``."""

    def __init__(self, flash_dir: str | os.PathLike, *, drop_cache: bool = True):
        check_flash_dir(flash_dir)
        self.flash_dir = os.fspath(flash_dir)
        self.directory: str | None = None  # created at the first page-out, removed when the last page goes
        self.drop_cache = drop_cache
        self.cache_dropped = True  # False once posix_fadvise was unavailable
        self._pages: dict[int, _Page] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.closed = False

    def _ensure_directory(self) -> str:
        if self.directory is None:
            try:
                self.directory = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=self.flash_dir)
            except OSError as error:
                raise FlashDirError(
                    f"cannot create files in flash dir {self.flash_dir!r} ({error.strerror}): "
                    "fix its permissions or pass another --flash-dir"
                ) from None
        return self.directory

    # ------------------------------------------------------------------ paging
    def __contains__(self, node: int) -> bool:
        return node in self._pages

    def nodes(self) -> list[int]:
        return list(self._pages)

    def write(self, node: int, name: str, entry: Entry) -> int:
        """Page ``entry`` out to flash; returns the file's size in bytes."""
        if node in self._pages:
            raise PageStoreError(f"node {name!r} is already on flash")
        layout = entry.layout()
        directory = self._ensure_directory()
        final = os.path.join(directory, f"node-{node:06d}.page")
        temporary = os.path.join(directory, f".node-{node:06d}.tmp")
        header = _HEADER.pack(_MAGIC, node, len(entry.storages), layout.nbytes) + b"".join(
            _SIZE.pack(n) for n in layout.storage_nbytes
        )
        crc = zlib.crc32(header)
        fd = -1
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            _write_all(fd, memoryview(header))
            for storage in entry.storages:
                if storage.nbytes() == 0:
                    continue
                payload = memoryview(storage_bytes(storage).numpy())
                crc = zlib.crc32(payload, crc)
                _write_all(fd, payload)
            _write_all(fd, memoryview(_TRAILER.pack(crc, _TRAILER_MAGIC)))
            os.fsync(fd)
            if self.drop_cache:
                self.cache_dropped = _drop_cache(fd) and self.cache_dropped
            os.close(fd)
            fd = -1
            os.replace(temporary, final)
        except OSError as error:
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(temporary)
            if not self._pages:
                self._remove_directory()
            size = len(header) + layout.nbytes + _TRAILER.size
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise FlashFullError(
                    f"flash dir {self.flash_dir!r} is full: paging out {name!r} needs {size} bytes "
                    f"({os.strerror(error.errno)}); free space there or pass a --flash-dir on a larger device"
                ) from None
            raise PageStoreError(f"paging out {name!r} to {self.flash_dir!r} failed: {error}") from None
        file_bytes = len(header) + layout.nbytes + _TRAILER.size
        self._pages[node] = _Page(final, name, layout, file_bytes)
        self.bytes_written += file_bytes
        return file_bytes

    def read(self, node: int) -> tuple[Entry, int]:
        """Page node back in: a new entry with fresh storages, and the bytes read. Verifies the checksum."""
        page = self._pages.get(node)
        if page is None:
            raise PageStoreError(f"node {node} has no page on flash")
        layout = page.layout
        storages: list[torch.UntypedStorage] = []
        try:
            with open(page.path, "rb", buffering=0) as handle:
                header = _read_exact(handle, _HEADER.size + _SIZE.size * len(layout.storage_nbytes), page)
                magic, stored_node, count, total = _HEADER.unpack_from(header)
                sizes = tuple(_SIZE.unpack_from(header, _HEADER.size + _SIZE.size * i)[0] for i in range(count))
                if magic != _MAGIC or stored_node != node or sizes != layout.storage_nbytes or total != layout.nbytes:
                    raise PageCorruptError(
                        f"page file of {page.name!r} ({page.path}) has a damaged header: it does not describe "
                        "the tensor that was paged out"
                    )
                crc = zlib.crc32(header)
                for nbytes in sizes:
                    data = torch.empty(nbytes, dtype=torch.uint8)
                    if nbytes:
                        view = memoryview(data.numpy())
                        _readinto_exact(handle, view, page)
                        crc = zlib.crc32(view, crc)
                    storages.append(data.untyped_storage())
                trailer = _read_exact(handle, _TRAILER.size, page)
                if handle.read(1):
                    raise PageCorruptError(f"page file of {page.name!r} ({page.path}) is longer than written")
                if self.drop_cache:  # the data now lives in RAM: do not keep a second copy in the page cache
                    _drop_cache(handle.fileno())
        except OSError as error:
            raise PageStoreError(f"paging in {page.name!r} from {page.path} failed: {error}") from None
        stored_crc, end = _TRAILER.unpack(trailer)
        if end != _TRAILER_MAGIC or stored_crc != crc:
            raise PageCorruptError(
                f"page file of {page.name!r} ({page.path}) is corrupted: CRC-32 {crc:#010x} does not match the "
                f"{stored_crc:#010x} written at page-out; the flash device returned different bytes"
            )
        self.bytes_read += page.file_bytes
        return Entry(node, storages, dict(layout.views)), page.file_bytes

    def delete(self, node: int) -> int:
        """Delete node's page file (and the private directory with the last one); returns its size."""
        page = self._pages.pop(node, None)
        if page is None:
            raise PageStoreError(f"node {node} has no page on flash")
        _unlink_quietly(page.path)
        if not self._pages:
            self._remove_directory()
        return page.file_bytes

    def path_of(self, node: int) -> str:
        return self._pages[node].path

    def clear(self) -> None:
        """Delete every page file and temporary file, and the private directory."""
        self._pages.clear()
        self._remove_directory()

    def close(self) -> None:
        self.clear()
        self.closed = True

    def _remove_directory(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> FlashPageStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_exact(handle, size: int, page: _Page) -> bytes:
    data = handle.read(size)
    if data is None or len(data) != size:
        raise PageCorruptError(f"page file of {page.name!r} ({page.path}) is truncated")
    return data


def _readinto_exact(handle, view: memoryview, page: _Page) -> None:
    done = 0
    while done < len(view):
        got = handle.readinto(view[done:])
        if not got:
            raise PageCorruptError(f"page file of {page.name!r} ({page.path}) is truncated")
        done += got
