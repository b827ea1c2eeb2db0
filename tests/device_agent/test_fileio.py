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
