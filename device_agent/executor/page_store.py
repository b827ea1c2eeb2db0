"""The flash page store: one file per paged node, written atomically and checked on the way back.

A page-out writes a temporary file, writes its data back to the device (``sync_file_range`` on Linux: the data,
not the metadata a crash would need, since a crashed run's pages are swept anyway), renames it into place and drops
it from the OS page cache (``posix_fadvise(DONTNEED)``), so the page-in that follows really reads the device. The file
carries a CRC-32 of its header and payload; a page-in verifies it. Files live in a private
subdirectory of the flash directory, created at the first page-out and removed by
:meth:`FlashPageStore.clear` and :meth:`FlashPageStore.close` (after a failure, and when the executor closes).
Between steps it stays, empty but for its owner lock: making and removing it every step cost 1.9 ms per step of
a one-page schedule (measured on an ext4-backed container disk), more than the page transfers themselves.

A process killed mid-step (SIGKILL from the OOM killer) cannot clean up, so every page directory is
marked with its owner: an ``owner.lock`` file inside it, held with ``flock(LOCK_EX)`` for as long as
the directory exists. The kernel releases that lock when the process dies however it dies, and a
reused PID cannot fake it. A new store sweeps the flash directory first (:func:`remove_stale_page_dirs`)
and removes the page directories whose lock nobody holds, reporting each one. To never see a live
owner's directory without its lock, a directory is made under a staging name, locked, and only then
renamed to ``.poet-pages-*``; staging directories are left alone for :data:`STAGING_GRACE_S`.
The lock file also records the owner's PID and process start time, for the report only.

File format (little endian): magic ``POETPG\\0\\1``, node u32, storage count u32, payload bytes u64,
one u64 size per storage, the storages' bytes, then CRC-32 u32 and ``END\\0``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import torch

from device_agent.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX: no owner locks, so no sweeping either
    fcntl = None

from device_agent.executor.ram_store import Entry, EntryLayout, storage_bytes
from device_agent.fileio import atomic_write_chunks, write_back_data

_MAGIC = b"POETPG\x00\x01"
_HEADER = struct.Struct("<8sIIQ")
_SIZE = struct.Struct("<Q")
_TRAILER = struct.Struct("<I4s")
_TRAILER_MAGIC = b"END\x00"
_DIR_PREFIX = ".poet-pages-"
_STAGING_PREFIX = ".poet-staging-"  # a page directory before its owner lock is held
_OWNER_FILE = "owner.lock"
# A staging directory younger than this may be one another process is creating right now (between
# mkdtemp and flock); it becomes a page directory or is gone within microseconds.
STAGING_GRACE_S = 60.0
# What a page file adds to its payload: header and trailer (32 bytes), one u64 per storage (allowance
# for 64 storages), and the rounding of its last block (added per page from the file system's block size).
PAGE_OVERHEAD_BYTES = _HEADER.size + _TRAILER.size + 64 * _SIZE.size


class PageStoreError(UserError, RuntimeError):
    """A page file that cannot be written or read back."""


class FlashDirError(PageStoreError):
    """The flash directory is missing, not a directory, or not writable."""


class FlashFullError(PageStoreError):
    """The flash device ran out of space during a page-out."""


class FlashSpaceError(FlashFullError):
    """Before training: the flash device has less free space than the schedule's peak of page files."""


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


@dataclass(frozen=True)
class StalePageDir:
    """A page directory left by a process that is gone, as removed by :func:`remove_stale_page_dirs`."""

    path: str
    owner_pid: int | None  # None: no owner recorded (made before owner marks, or killed while being made)
    owner_start_time_s: float | None  # the owner's process start time (Unix time)
    files: int  # page files (and temporary files) it held
    bytes: int  # their total size

    def describe(self) -> str:
        owner = "an unknown process"
        if self.owner_pid is not None:
            owner = f"pid {self.owner_pid}"
            if self.owner_start_time_s is not None:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.owner_start_time_s))
                owner += f" started {started}"
        return (f"removed page directory {self.path!r} left by {owner}, which is gone "
                f"({self.files} file(s), {self.bytes} bytes)")


def _owner_record() -> bytes:
    try:
        start_time_s = psutil.Process().create_time()
    except psutil.Error:
        start_time_s = None
    return json.dumps({"pid": os.getpid(), "start_time_s": start_time_s}).encode() + b"\n"


def _read_owner(fd: int) -> tuple[int | None, float | None]:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return record.get("pid"), record.get("start_time_s")
    except (OSError, ValueError, AttributeError):
        return None, None


def _contents(path: str) -> tuple[int, int]:
    """(files other than the owner lock, their bytes) under ``path``."""
    files = total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            if root == path and name == _OWNER_FILE:
                continue
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
            files += 1
    return files, total


def remove_stale_page_dirs(flash_dir: str | os.PathLike, *, log: Callable[[str], None] | None = None
                           ) -> list[StalePageDir]:
    """Remove the page directories under ``flash_dir`` whose owner process is gone; report each on ``log``.

    An owner is gone when nobody holds the ``flock`` on its directory's ``owner.lock``. A directory with a
    held lock is never touched, whichever process holds it (this one included). A ``.poet-pages-*``
    directory without a lock file was made before owner marks existed, and is removed; a staging
    directory is removed only once it is :data:`STAGING_GRACE_S` old. Best effort: a directory that
    cannot be inspected is left alone, and a missing ``flash_dir`` is not an error here.
    """
    if fcntl is None:
        return []
    path = os.fspath(flash_dir)
    try:
        candidates = [e for e in os.scandir(path)
                      if e.name.startswith((_DIR_PREFIX, _STAGING_PREFIX)) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    removed: list[StalePageDir] = []
    for candidate in candidates:
        stale = _remove_if_stale(candidate.path, staging=candidate.name.startswith(_STAGING_PREFIX))
        if stale is not None:
            removed.append(stale)
            if log is not None:
                log(stale.describe())
    return removed


def _remove_if_stale(path: str, *, staging: bool) -> StalePageDir | None:
    if staging:
        try:
            if time.time() - os.lstat(path).st_mtime < STAGING_GRACE_S:
                return None
        except OSError:
            return None
    try:
        fd = os.open(os.path.join(path, _OWNER_FILE), os.O_RDWR)
    except FileNotFoundError:
        fd = -1  # no owner recorded
    except OSError:
        return None
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # EWOULDBLOCK: a live process holds it
                return None
            pid, start_time_s = _read_owner(fd)
        else:
            pid = start_time_s = None
        files, total = _contents(path)
        shutil.rmtree(path, ignore_errors=True)  # while holding the lock: no other sweeper races us
        if os.path.lexists(path):
            return None
        return StalePageDir(path, pid, start_time_s, files, total)
    finally:
        if fd >= 0:
            os.close(fd)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold back Ctrl-C and SIGTERM's Python handlers for the block; re-deliver what arrived right after.

    A signal mask is not enough: the kernel may deliver a process signal to any thread (torch keeps a
    pool) and the interpreter then runs the handler in the main thread between any two bytecodes. So in
    the main thread the handlers themselves are swapped for ones that only record the signal.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only: nothing can land here
        return
    arrived: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, _frame: arrived.append(signum)) for signum in watched}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)  # now handled as it would have been


def _create_owned_directory(flash_dir: str) -> tuple[str, int]:
    """A new ``.poet-pages-*`` directory in ``flash_dir`` whose owner lock this process holds: (path, lock fd).

    Call it with interrupts deferred (:func:`_interrupts_deferred`), and hand the result to its owner
    inside the same block, so a signal handler's exception cannot land between creating and owning it.
    """
    staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=flash_dir)
    fd = -1
    made = staging  # where the directory is now (after the rename: its final name)
    try:
        fd = os.open(os.path.join(staging, _OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        record = memoryview(_owner_record())
        while record:
            record = record[os.write(fd, record):]
        suffix = os.path.basename(staging)[len(_STAGING_PREFIX):]
        for attempt in range(100):
            final = os.path.join(flash_dir, _DIR_PREFIX + (suffix if attempt == 0 else os.urandom(6).hex()))
            if os.path.lexists(final):
                continue
            try:
                os.rename(staging, final)  # atomic: the page directory appears with its lock already held
            except OSError as error:
                if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue
                raise
            made = final
            return final, fd
        raise FileExistsError(errno.EEXIST, "no free page directory name", flash_dir)
    except BaseException:  # including an exception from a signal handler
        shutil.rmtree(made, ignore_errors=True)
        if fd >= 0:
            os.close(fd)
        raise


def _remove_owned_files(path: str) -> None:
    """Remove a page directory this process owns: its files first, the owner lock last.

    So a sweeper finds either the held lock or nothing, never page files without their lock. Safe to
    repeat after an interruption (a missing file or directory is not an error).
    """
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    except OSError:
        names = []
    for name in names:
        if name != _OWNER_FILE:
            full = os.path.join(path, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                _unlink_quietly(full)
    _unlink_quietly(os.path.join(path, _OWNER_FILE))
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _remove_owned_directory(path: str, fd: int) -> None:
    """Remove an owned page directory and release its lock (run by the store's finalizer)."""
    try:
        _remove_owned_files(path)
    finally:
        os.close(fd)


def flash_space_needed_bytes(flash_dir: str | os.PathLike, peak_page_bytes: int, peak_pages: int) -> int:
    """Free bytes ``flash_dir`` needs to hold ``peak_pages`` page files of ``peak_page_bytes`` payload at once.

    Adds each page's header, trailer and last partial block, and two blocks for the directory and its
    owner lock file.
    """
    try:
        block_bytes = os.statvfs(os.fspath(flash_dir)).f_frsize or 4096
    except (OSError, AttributeError):
        block_bytes = 4096
    if peak_pages <= 0:
        return 0
    return int(peak_page_bytes) + peak_pages * (PAGE_OVERHEAD_BYTES + block_bytes) + 2 * block_bytes


def check_flash_space(flash_dir: str | os.PathLike, peak_page_bytes: int, peak_pages: int) -> int:
    """Raise FlashSpaceError unless ``flash_dir`` has room for the schedule's peak of page files; returns the need."""
    path = os.fspath(flash_dir)
    needed = flash_space_needed_bytes(path, peak_page_bytes, peak_pages)
    if needed == 0:
        return 0
    free = shutil.disk_usage(path).free
    if free < needed:
        raise FlashSpaceError(
            f"flash dir {path!r} has {free} bytes free, but the schedule keeps up to {peak_pages} page(s) of "
            f"{peak_page_bytes} bytes on flash at once ({needed} bytes with page headers and block rounding): "
            "free space there, pass a --flash-dir on a larger device, or solve with a larger RAM budget "
            "(or --no-paging) so less is paged"
        )
    return needed


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
    """Page files for node entries, in a private subdirectory of ``flash_dir`` marked with this process as owner.

    On creation it removes the page directories of processes that are gone (see the module docstring),
    reporting each on ``log`` (e.g. a function printing to stderr) and in :attr:`stale_removed`.
    :meth:`close` and :meth:`clear` are idempotent and safe on an exception path; the directory is also
    removed at interpreter exit if neither ran.
    """

    def __init__(self, flash_dir: str | os.PathLike, *, drop_cache: bool = True,
                 log: Callable[[str], None] | None = None):
        check_flash_dir(flash_dir)
        self.flash_dir = os.fspath(flash_dir)
        self.directory: str | None = None  # created at the first page-out, removed by clear() and close()
        self.drop_cache = drop_cache
        self.cache_dropped = True  # False once posix_fadvise was unavailable
        self._pages: dict[int, _Page] = {}
        self._lock_fd = -1  # holds the flock on the directory's owner.lock
        # Removes the directory and releases the lock if the store is dropped or the interpreter exits unclosed.
        self._release: weakref.finalize | None = None
        self.bytes_written = 0
        self.bytes_read = 0
        self.closed = False
        self.stale_removed: list[StalePageDir] = remove_stale_page_dirs(self.flash_dir, log=log)

    @property
    def stale_removed_count(self) -> int:
        """Page directories of dead processes this store removed when it was created."""
        return len(self.stale_removed)

    def _ensure_directory(self) -> str:
        if self.closed:
            raise PageStoreError(f"the page store on {self.flash_dir!r} is closed")
        if self.directory is None:
            try:
                with _interrupts_deferred():  # the directory is owned (and finalized) before Ctrl-C lands
                    directory, lock_fd = _create_owned_directory(self.flash_dir)
                    self.directory, self._lock_fd = directory, lock_fd
                    self._release = weakref.finalize(self, _remove_owned_directory, directory, lock_fd)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise FlashFullError(
                        f"flash dir {self.flash_dir!r} is full: cannot create its page directory "
                        f"({error.strerror}); free space there or pass a --flash-dir on a larger device"
                    ) from None
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
        header = _HEADER.pack(_MAGIC, node, len(entry.storages), layout.nbytes) + b"".join(
            _SIZE.pack(n) for n in layout.storage_nbytes
        )

        def chunks():
            crc = zlib.crc32(header)
            yield header
            for storage in entry.storages:
                if storage.nbytes() == 0:
                    continue
                payload = memoryview(storage_bytes(storage).numpy())
                crc = zlib.crc32(payload, crc)
                yield payload
            yield _TRAILER.pack(crc, _TRAILER_MAGIC)

        def drop_cache(fd: int) -> None:
            if self.drop_cache:
                self.cache_dropped = _drop_cache(fd) and self.cache_dropped

        try:
            # Pages are scratch data of this run: the data is written back (so the page cache can drop it) but
            # neither the file's metadata nor the directory is made durable (a crash leaves them to the stale sweep).
            atomic_write_chunks(final, chunks(), mode=0o600, before_close=drop_cache, durable_rename=False,
                                sync=write_back_data)
        except OSError as error:
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
        """Delete node's page file (the private directory stays for the next page-out); returns its size."""
        page = self._pages.pop(node, None)
        if page is None:
            raise PageStoreError(f"node {node} has no page on flash")
        _unlink_quietly(page.path)
        return page.file_bytes

    def path_of(self, node: int) -> str:
        return self._pages[node].path

    def clear(self) -> None:
        """Delete every page file and temporary file, and the private directory. Idempotent."""
        self._pages.clear()
        self._remove_directory()

    def close(self) -> None:
        """:meth:`clear`, and refuse further page-outs. Idempotent; safe to call from an exception path."""
        self.closed = True
        self.clear()

    def _remove_directory(self) -> None:
        # An exception (a signal handler's) may interrupt this: until the files are gone the state stays, so
        # the next call (the exception path's clear or close) finishes the job; the lock fd is closed once.
        if self.directory is None:
            return
        _remove_owned_files(self.directory)
        if self._release is not None:
            self._release.detach()
        fd, self._lock_fd, self.directory, self._release = self._lock_fd, -1, None, None
        os.close(fd)

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
