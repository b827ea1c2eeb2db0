"""RAM store accounting and the flash page store's file discipline."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from device_agent.executor import (
    EntryBuilder,
    FlashDirError,
    FlashFullError,
    FlashPageStore,
    PageCorruptError,
    RamStore,
    page_store,
)


def _entry(node: int, **tensors: torch.Tensor):
    builder = EntryBuilder(node)
    for name, tensor in tensors.items():
        builder.add_named(name, tensor)
    return builder.build()


# ----------------------------------------------------------------------------- RAM store
def test_shared_storage_is_counted_once():
    base = torch.randn(64, 32)  # 8192 bytes
    store = RamStore()
    assert store.put(_entry(0, x=base, xt=base.t(), row=base[3])) == 8192
    assert store.put(_entry(1, alias=base.view(-1))) == 0  # another entry on the same storage adds nothing
    assert store.put(_entry(2, y=torch.zeros(10))) == 40
    assert store.in_use_bytes == 8232
    assert store.drop(0) == 0  # node 1 still holds the storage
    assert store.drop(1) == 8192
    assert store.in_use_bytes == 40
    assert store.peak_bytes == 8232
    assert store.timeline_bytes == [8192, 8192, 8232, 8232, 40]


def test_entry_views_round_trip_strides_offsets_and_dtypes():
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    entry = _entry(0, t=base.t(), s=base[2:, 3:7], i=torch.arange(5, dtype=torch.int64), b=torch.tensor([True, False]))
    assert len(entry.storages) == 3
    for name, expected in (("t", base.t()), ("s", base[2:, 3:7])):
        got = entry.tensor(name)
        assert torch.equal(got, expected) and got.stride() == expected.stride()
    assert entry.tensor("b").dtype == torch.bool


def test_duplicate_and_missing_entries_are_errors():
    from device_agent.executor.ram_store import RamStoreError

    store = RamStore()
    store.put(_entry(0, x=torch.ones(2)))
    with pytest.raises(RamStoreError):
        store.put(_entry(0, x=torch.ones(2)))
    with pytest.raises(RamStoreError):
        store.drop(5)


# ----------------------------------------------------------------------------- page store
def test_page_round_trip_is_exact_and_files_go_away(tmp_path):
    base = torch.randn(33, 17)
    entry = _entry(4, a=base, at=base.t(), half=torch.randn(5, dtype=torch.float16), n=torch.arange(7))
    with FlashPageStore(tmp_path) as pages:
        written = pages.write(4, "layer.4", entry)
        path = pages.path_of(4)
        assert os.path.getsize(path) == written
        assert os.path.dirname(path) == pages.directory
        assert [f for f in os.listdir(pages.directory) if f.endswith(".tmp")] == []
        assert pages.cache_dropped  # posix_fadvise(DONTNEED) after fsync on Linux
        back, read = pages.read(4)
        assert read == written
        for name in ("a", "at", "half", "n"):
            original, restored = entry.tensor(name), back.tensor(name)
            assert torch.equal(original, restored) and original.stride() == restored.stride()
        assert back.storages[0].data_ptr() != entry.storages[0].data_ptr()  # really a new copy
        pages.delete(4)
        directory = pages.directory  # kept for the next page-out (making it again costs each step), empty
        assert os.listdir(directory) == ["owner.lock"]
        pages.write(5, "layer.5", entry)
        assert pages.directory == directory
        pages.delete(5)
    assert pages.directory is None and os.listdir(tmp_path) == []  # closing takes the directory along


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_a_page_file_leaves_the_page_cache(tmp_path):
    """A page-out's bytes reach the device before the store drops them from the page cache (else the kernel
    keeps the dirty pages, in RAM, and the page-in reads them from there)."""
    from tests.device_agent.test_fileio import dirty_then_dropped, resident_pages

    if dirty_then_dropped(tmp_path / "control", os.urandom(64 * 4096), os.fsync) != 0:
        pytest.skip("this file system keeps pages in memory (tmpfs?) even when clean")
    (tmp_path / "flash").mkdir()
    with FlashPageStore(tmp_path / "flash") as pages:
        pages.write(1, "layer.1", _entry(1, x=torch.randn(64 * 1024)))
        assert pages.cache_dropped and resident_pages(pages.path_of(1)) == 0


def test_corruption_is_detected_and_names_the_tensor(tmp_path):
    with FlashPageStore(tmp_path) as pages:
        pages.write(1, "blocks.3.conv1", _entry(1, x=torch.randn(100)))
        with open(pages.path_of(1), "r+b") as handle:
            handle.seek(-20, os.SEEK_END)
            handle.write(b"\x00\x01")
        with pytest.raises(PageCorruptError, match="'blocks.3.conv1'.*corrupted"):
            pages.read(1)
        pages.write(2, "fc", _entry(2, x=torch.randn(100)))
        with open(pages.path_of(2), "r+b") as handle:
            handle.truncate(50)
        with pytest.raises(PageCorruptError, match="'fc'.*truncated"):
            pages.read(2)
        pages.write(3, "head", _entry(3, x=torch.randn(4)))
        with open(pages.path_of(3), "r+b") as handle:
            handle.write(b"XXXX")
        with pytest.raises(PageCorruptError, match="'head'.*header"):
            pages.read(3)
    assert os.listdir(tmp_path) == []


def test_flash_dir_must_exist_be_a_directory_and_be_writable(tmp_path, monkeypatch):
    with pytest.raises(FlashDirError, match="does not exist"):
        FlashPageStore(tmp_path / "nope")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FlashDirError, match="not a directory"):
        FlashPageStore(a_file)
    monkeypatch.setattr(page_store.os, "access", lambda path, mode: False)  # root ignores permission bits
    with pytest.raises(FlashDirError, match="not writable"):
        FlashPageStore(tmp_path)


def test_disk_full_leaves_no_partial_file(tmp_path, monkeypatch):
    def full(storage):  # the header is written, then the device is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with FlashPageStore(tmp_path) as pages:
        monkeypatch.setattr(page_store, "storage_bytes", full)
        with pytest.raises(FlashFullError, match="is full: paging out 'conv'"):
            pages.write(0, "conv", _entry(0, x=torch.randn(1000)))
        assert os.listdir(tmp_path) == []
        assert 0 not in pages


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_really_full_device(tmp_path):
    """A 64 KiB tmpfs: the second 40 kB page-out hits ENOSPC for real."""
    import subprocess

    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with FlashPageStore(mount_point) as pages:
            pages.write(0, "first", _entry(0, x=torch.randn(10_000)))
            with pytest.raises(FlashFullError, match="'second'"):
                pages.write(1, "second", _entry(1, x=torch.randn(10_000)))
            assert sorted(os.listdir(pages.directory)) == [os.path.basename(pages.path_of(0)), "owner.lock"]
        assert os.listdir(mount_point) == []
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)
