"""atomic_write_bytes/atomic_write_text: right content, no temporary left behind, old file kept on failure."""

from __future__ import annotations

import os
import stat

import pytest

from device_agent import fileio
from device_agent.fileio import atomic_write_bytes, atomic_write_text


def test_writes_bytes_memoryview_and_text(tmp_path):
    atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01\x02")
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01\x02"
    atomic_write_bytes(tmp_path / "b.bin", memoryview(bytearray(range(256)) * 40))
    assert (tmp_path / "b.bin").read_bytes() == bytes(range(256)) * 40
    atomic_write_text(str(tmp_path / "c.json"), "π = 3.14\n")
    assert (tmp_path / "c.json").read_text(encoding="utf-8") == "π = 3.14\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin", "c.json"]


def test_a_multibyte_memoryview_is_written_as_its_bytes(tmp_path):
    values = memoryview(bytearray(b"\x01\x00\x02\x00")).cast("H")  # two uint16 items, four bytes
    atomic_write_bytes(tmp_path / "h.bin", values)
    assert (tmp_path / "h.bin").read_bytes() == b"\x01\x00\x02\x00"


def test_replaces_an_existing_file_and_sets_the_mode(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    atomic_write_text(target, "new", mode=0o600)
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    atomic_write_bytes(target, b"newer")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not mkstemp's rw-------
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), KeyboardInterrupt()])
def test_a_failure_mid_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch, error):
    target = tmp_path / "f.txt"
    target.write_text("old")
    real_fsync = os.fsync
    calls = []

    def failing_fsync(fd):  # fault injection: the file's fsync fails (a full or dying SD card)
        calls.append(fd)
        raise error

    monkeypatch.setattr(fileio.os, "fsync", failing_fsync)
    with pytest.raises(type(error)):
        atomic_write_text(target, "new")
    monkeypatch.setattr(fileio.os, "fsync", real_fsync)
    assert calls, "the fault was never injected"
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_failure_in_the_rename_removes_the_temporary(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()  # os.replace cannot put a file over a directory
    (target / "inside").write_text("keep")
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert (target / "inside").read_text() == "keep"


def test_text_that_cannot_be_encoded_leaves_nothing(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(target, "lone surrogate \udcff")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_parent_that_is_a_file_fails_without_side_effects(tmp_path):
    parent = tmp_path / "not-a-dir"
    parent.write_text("a file")
    with pytest.raises(OSError):
        atomic_write_bytes(parent / "f.bin", b"data")
    assert parent.read_text() == "a file"
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-dir"]


def resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore on a private mapping of it)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        buffer = (ctypes.c_char * size).from_buffer(mapping)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(buffer)), ctypes.c_size_t(size), vector) == 0
            return sum(v & 1 for v in vector)
        finally:
            del buffer


def dirty_then_dropped(path, data: bytes, sync) -> int:
    """Write ``data`` to ``path``, ``sync`` it (or not), ask the kernel to drop its cached pages; pages left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        if sync is not None:
            sync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_pages(path)


@pytest.mark.skipif(not (hasattr(os, "posix_fadvise") and os.uname().sysname == "Linux"), reason="Linux only")
@pytest.mark.parametrize("sync_file_range", [True, False], ids=["sync_file_range", "fdatasync"])
def test_written_back_data_leaves_the_page_cache_when_dropped(tmp_path, monkeypatch, sync_file_range):
    """The page store's page-outs rely on it: data written back (not fsynced) is clean, so POSIX_FADV_DONTNEED
    drops it and the page-in really reads the device; also where the C library has no sync_file_range."""
    if not sync_file_range:
        monkeypatch.setattr(fileio, "_SYNC_FILE_RANGE", None)
    elif fileio._SYNC_FILE_RANGE is None:
        pytest.skip("this C library has no sync_file_range")
    data = os.urandom(64 * 4096)
    if dirty_then_dropped(tmp_path / "control", data, None) == 0:
        pytest.skip("this file system drops dirty pages at once (or keeps none): nothing to tell apart")
    if dirty_then_dropped(tmp_path / "fsynced", data, os.fsync) != 0:
        pytest.skip("this file system keeps pages in memory (tmpfs?) even when clean")
    assert dirty_then_dropped(tmp_path / "written-back", data, fileio.write_back_data) == 0
