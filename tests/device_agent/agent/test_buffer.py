"""The durable telemetry buffer: sequence numbers, acknowledgements, back-pressure, restarts and SIGKILL."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from device_agent.agent.buffer import (
    DEFAULT_FILE_NAME,
    BufferFullError,
    TelemetryBuffer,
    TelemetryBufferError,
)

# Appends forever in batches of 1-3 (payload "pid:k", k counting this process's events from 1), acks
# now and then, and prints the last seq of each committed batch; the test SIGKILLs it at some point.
WRITER = textwrap.dedent(
    """
    import os, sys
    from device_agent.agent.buffer import TelemetryBuffer
    buffer = TelemetryBuffer(sys.argv[1], max_events=10**9)
    pid, k = os.getpid(), 0
    while True:
        size = 1 + k % 3
        seqs = buffer.append_many([f"{pid}:{k + i + 1}".encode() + b"." * 2000 for i in range(size)])
        k += size
        if k % 40 < 3 and seqs[-1] > 25:
            buffer.ack(seqs[-1] - 20)
        print(seqs[-1], flush=True)
    """
)


def test_sequence_numbers_unacked_and_monotonic_acks(tmp_path):
    with TelemetryBuffer.in_state_dir(tmp_path / "state") as buffer:
        assert buffer.path == tmp_path / "state" / DEFAULT_FILE_NAME
        assert len(buffer.stream_id) == 32 and int(buffer.stream_id, 16) >= 0
        assert (buffer.next_seq, buffer.pending_count, buffer.unacked()) == (1, 0, [])
        assert [buffer.append(f"e{i}".encode()) for i in range(1, 6)] == [1, 2, 3, 4, 5]
        assert buffer.append_many([b"e6", b"e7"]) == [6, 7]
        assert buffer.unacked(3) == [(1, b"e1"), (2, b"e2"), (3, b"e3")]
        assert buffer.ack(3) == 3
        assert buffer.unacked() == [(4, b"e4"), (5, b"e5"), (6, b"e6"), (7, b"e7")]
        assert buffer.ack(2) == 0 and buffer.ack(3) == 0  # older acks are ignored
        assert buffer.pending_count == 4 and buffer.acked_through == 3
        with pytest.raises(ValueError, match="last event appended is 7"):
            buffer.ack(8)
        assert buffer.ack(7) == 4
        assert (buffer.pending_count, buffer.unacked(), buffer.next_seq) == (0, [], 8)
        assert buffer.append(b"e8") == 8  # a number is never reused after everything was acknowledged
    with sqlite3.connect(buffer.path) as db:  # WAL: a crash mid-commit rolls back, and readers never block the writer
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()
    with TelemetryBuffer(tmp_path / "other.sqlite3") as other:
        assert other.stream_id != buffer.stream_id and other.next_seq == 1


def test_a_reopened_buffer_keeps_its_stream_sequence_and_unacked_events(tmp_path):
    path = tmp_path / DEFAULT_FILE_NAME
    with TelemetryBuffer(path) as buffer:
        stream = buffer.stream_id
        buffer.append_many([b"a", b"b", b"c", b"d"])
        buffer.ack(2)
    with TelemetryBuffer(path) as buffer:
        assert (buffer.stream_id, buffer.next_seq, buffer.acked_through) == (stream, 5, 2)
        assert buffer.unacked() == [(3, b"c"), (4, b"d")]
        buffer.ack(1)  # an ack older than the one stored before the restart: still ignored
        assert buffer.append(b"e") == 5 and buffer.pending_count == 3


def test_back_pressure_at_max_events_drops_nothing(tmp_path):
    path = tmp_path / DEFAULT_FILE_NAME
    with TelemetryBuffer(path, max_events=3) as buffer:
        buffer.append_many([b"1", b"2"])
        with pytest.raises(BufferFullError) as too_many:
            buffer.append_many([b"3", b"4"])  # all or nothing
        assert too_many.value.pending == 2
        assert buffer.append(b"3") == 3
        with pytest.raises(BufferFullError) as full:
            buffer.append(b"4")
        message = str(full.value)
        assert str(path) in message and "3 events are waiting" in message and "back-pressure" in message
        assert (full.value.pending, full.value.max_events) == (3, 3)
        assert buffer.next_seq == 4 and [p for _, p in buffer.unacked()] == [b"1", b"2", b"3"]
        buffer.ack(1)
        assert buffer.append(b"4") == 4
    with TelemetryBuffer(path, max_events=3) as reopened:  # the bound counts events held across restarts
        with pytest.raises(BufferFullError):
            reopened.append(b"5")


def test_sigkill_mid_append_leaves_a_contiguous_prefix_without_gaps_or_duplicates(tmp_path):
    path = tmp_path / DEFAULT_FILE_NAME
    TelemetryBuffer(path).close()
    committed_before_kill = 0
    writers = []
    for round_number, kill_after in enumerate((150, 233, 377, 61, 500, 97, 310, 42)):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
        )
        writers.append(writer.pid)
        last_printed = 0
        for _ in range(kill_after):
            line = writer.stdout.readline()
            assert line, f"writer {round_number} ended early (rc {writer.poll()})"
            last_printed = int(line)
        time.sleep(0.001 * (round_number % 4))  # kill at varying points of an append or an ack
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        writer.stdout.close()
        assert writer.returncode == -signal.SIGKILL

        with TelemetryBuffer(path, max_events=10**9) as buffer:
            events = buffer.unacked(limit=10**6)
            seqs = [seq for seq, _ in events]
            assert buffer.next_seq - 1 >= last_printed >= committed_before_kill  # what was committed survived
            assert seqs == list(range(buffer.acked_through + 1, buffer.next_seq))  # no gaps, no duplicates
            assert buffer.pending_count == len(events)
            # Each writer's own counter k is consecutive along the sequence: nothing lost or repeated.
            by_writer: dict[int, list[int]] = {}
            for _, payload in events:
                pid, k = payload.rstrip(b".").decode().split(":")
                by_writer.setdefault(int(pid), []).append(int(k))
            for ks in by_writer.values():
                assert ks == list(range(ks[0], ks[0] + len(ks)))
            assert set(by_writer) <= set(writers)
            committed_before_kill = buffer.next_seq - 1
            assert buffer.append(b"after") == committed_before_kill + 1  # continues from the right seq
            committed_before_kill += 1
    assert committed_before_kill > 1700


def test_a_file_that_is_not_a_buffer_is_refused_by_name_and_kept(tmp_path):
    garbage = tmp_path / DEFAULT_FILE_NAME
    garbage.write_bytes(b"this is not SQLite, it is someone's notes\n" * 200)
    before = garbage.read_bytes()
    with pytest.raises(TelemetryBufferError) as caught:
        TelemetryBuffer(garbage)
    message = str(caught.value)
    assert str(garbage) in message and "not a database" in message and "move it aside" in message
    assert garbage.read_bytes() == before

    foreign = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY)")
    db.close()
    with pytest.raises(TelemetryBufferError, match=r"foreign.sqlite3 is unusable: .*something else \(tables: photos\)"):
        TelemetryBuffer(foreign)
    with sqlite3.connect(foreign) as db:
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("photos",)]  # nothing added
    db.close()

    tampered = tmp_path / "tampered.sqlite3"
    with TelemetryBuffer(tampered) as buffer:
        buffer.append_many([b"a", b"b", b"c"])
    with sqlite3.connect(tampered) as db:
        db.execute("DELETE FROM events WHERE seq = 2")
    db.close()
    with pytest.raises(TelemetryBufferError, match=r"tampered.sqlite3 is unusable: it holds 2 events"):
        TelemetryBuffer(tampered)

    with pytest.raises(TelemetryBufferError, match="does not exist"):
        TelemetryBuffer(tmp_path / "missing" / DEFAULT_FILE_NAME)


def test_two_handles_on_one_file_never_hand_out_one_seq_twice(tmp_path):
    path = tmp_path / DEFAULT_FILE_NAME
    with TelemetryBuffer(path) as first, TelemetryBuffer(path) as second:
        assert first.stream_id == second.stream_id
        seqs = [first.append(b"a"), second.append(b"b"), first.append(b"c"), second.append(b"d")]
        assert seqs == [1, 2, 3, 4]
        second.ack(3)
        assert first.unacked() == [(4, b"d")] and first.ack(2) == 0 and first.pending_count == 1
