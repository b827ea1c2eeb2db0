"""The durable telemetry buffer: every event is numbered and stored on the board before it is sent.

One SQLite file in the agent's state dir (``telemetry-buffer.sqlite3``) holds one stream: a random
hex ``stream_id`` made when the file is created, and events numbered 1, 2, 3, ... in the order they
were appended. The agent sends :meth:`TelemetryBuffer.unacked` events, the coordinator acknowledges
the highest contiguous sequence it has stored, and :meth:`TelemetryBuffer.ack` deletes everything up
to it; after a reconnect the agent resends from the first unacknowledged event, and the coordinator
drops what it already has.

Invariants (each append and each ack is one SQLite transaction, so a process killed mid-write
leaves the state before or after it, never between):

- the stored events are exactly ``acked_through + 1 .. next_seq - 1``, contiguous, each once;
- ``next_seq`` never goes back, even when every event has been acknowledged and deleted, so a
  sequence number is never reused within a stream;
- acknowledgements only move forward: an older one (a late or reordered reply) is ignored.

``synchronous=FULL`` makes a commit durable before ``append`` returns. With less, a power cut could
roll back events that were already sent and acknowledged, and the board would then reuse their
sequence numbers for new events that the coordinator would drop as duplicates: silent loss. Use
:meth:`TelemetryBuffer.append_many` to pay one fsync for a batch.

The buffer is bounded: with ``max_events`` unacknowledged events held, appending raises
:class:`BufferFullError`, the agent's signal to apply back-pressure. Nothing is ever dropped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["DEFAULT_FILE_NAME", "DEFAULT_MAX_EVENTS", "BufferFullError", "TelemetryBuffer", "TelemetryBufferError"]

DEFAULT_FILE_NAME = "telemetry-buffer.sqlite3"
DEFAULT_MAX_EVENTS = 100_000
FORMAT = "poet-edge telemetry buffer 1"

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, payload BLOB NOT NULL)",
)


class TelemetryBufferError(RuntimeError):
    """The buffer file cannot be used; the message names it. The file is never deleted for you."""


class BufferFullError(TelemetryBufferError):
    """Back-pressure: ``max_events`` events wait for acknowledgement, so no more are taken for now."""

    def __init__(self, path: Path, pending: int, max_events: int) -> None:
        self.pending = pending
        self.max_events = max_events
        super().__init__(
            f"telemetry buffer {path} is full: {pending} events are waiting for the coordinator's "
            f"acknowledgement (max_events={max_events}); back-pressure: pause producing events until "
            f"acknowledgements free space (nothing was dropped)"
        )


class TelemetryBuffer:
    """A bounded, crash-safe, sequenced event buffer in one SQLite file; safe to share between threads."""

    def __init__(self, path: str | os.PathLike, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        self.path = Path(path)
        self.max_events = int(max_events)
        self._lock = threading.Lock()
        if not self.path.parent.is_dir():
            raise TelemetryBufferError(
                f"cannot open telemetry buffer {self.path}: directory {self.path.parent} does not exist"
            )
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        except sqlite3.Error as exc:
            raise TelemetryBufferError(f"cannot open telemetry buffer {self.path}: {exc}") from None
        try:
            self._open()
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def in_state_dir(cls, state_dir: str | os.PathLike, max_events: int = DEFAULT_MAX_EVENTS) -> TelemetryBuffer:
        """The buffer file of an agent's state dir, created with the dir if missing."""
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        return cls(Path(state_dir) / DEFAULT_FILE_NAME, max_events)

    def _unusable(self, why: str) -> TelemetryBufferError:
        return TelemetryBufferError(
            f"telemetry buffer {self.path} is unusable: {why}. It was left as it is; move it aside (its "
            f"unacknowledged events are lost to the coordinator) and restart the agent to begin a new stream"
        )

    def _open(self) -> None:
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if tables and "meta" not in tables:
                    names = ", ".join(sorted(tables))
                    raise self._unusable(f"it is an SQLite database of something else (tables: {names})")
                for statement in _SCHEMA:
                    self._db.execute(statement)
                meta = dict(self._db.execute("SELECT key, value FROM meta"))
                if not meta:
                    meta = {"format": FORMAT, "stream_id": secrets.token_hex(16), "next_seq": "1", "acked_through": "0"}
                    self._db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
                elif meta.get("format") != FORMAT:
                    raise self._unusable(f"its format is {meta.get('format')!r}, expected {FORMAT!r}")
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self._stream_id = meta["stream_id"]
            self._next_seq = int(meta["next_seq"])
            self._acked_through = int(meta["acked_through"])
            stored = self._db.execute("SELECT COUNT(*), MIN(seq), MAX(seq) FROM events").fetchone()
        except sqlite3.OperationalError as exc:  # locked, unreadable, read-only: the file itself may be fine
            raise TelemetryBufferError(f"cannot open telemetry buffer {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            raise self._unusable(str(exc)) from None
        expected = self._next_seq - 1 - self._acked_through
        span = (self._acked_through + 1, self._next_seq - 1)
        if stored[0] != expected or (expected and (stored[1], stored[2]) != span):
            raise self._unusable(
                f"it holds {stored[0]} events (seq {stored[1]}..{stored[2]}) but its counters say "
                f"{self._acked_through + 1}..{self._next_seq - 1}"
            )

    @property
    def stream_id(self) -> str:
        """Random hex made with the file; the coordinator keys sequence numbers by it."""
        return self._stream_id

    @property
    def next_seq(self) -> int:
        """The sequence number the next appended event will get."""
        return self._next_seq

    @property
    def acked_through(self) -> int:
        """The highest acknowledged sequence number (0 before the first acknowledgement)."""
        return self._acked_through

    @property
    def pending_count(self) -> int:
        """Events stored and not yet acknowledged."""
        return self._next_seq - 1 - self._acked_through

    def append(self, payload: bytes) -> int:
        """Store one event durably and return its sequence number; :class:`BufferFullError` when full."""
        return self.append_many([payload])[0]

    def append_many(self, payloads: Iterable[bytes]) -> list[int]:
        """Store events in one transaction (one fsync): all of them or, on error or when full, none."""
        batch = [bytes(p) for p in payloads]
        with self._lock, self._transaction():
            self._reload_counters()  # under the write lock: right even if another process appended
            if self.pending_count + len(batch) > self.max_events:
                raise BufferFullError(self.path, self.pending_count, self.max_events)
            first = self._next_seq
            seqs = list(range(first, first + len(batch)))
            self._db.executemany("INSERT INTO events (seq, payload) VALUES (?, ?)", zip(seqs, batch, strict=True))
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'next_seq'", (str(first + len(batch)),))
        self._next_seq = first + len(batch)
        return seqs

    def unacked(self, limit: int = 1000) -> list[tuple[int, bytes]]:
        """Up to ``limit`` unacknowledged events ``(seq, payload)``, from the first, in order."""
        with self._lock:
            rows = self._db.execute("SELECT seq, payload FROM events ORDER BY seq LIMIT ?", (int(limit),)).fetchall()
        return [(int(seq), bytes(payload)) for seq, payload in rows]

    def ack(self, through_seq: int) -> int:
        """Delete every event up to ``through_seq``; returns how many. An older acknowledgement is ignored."""
        through_seq = int(through_seq)
        with self._lock, self._transaction():
            self._reload_counters()
            if through_seq <= self._acked_through:
                return 0
            if through_seq >= self._next_seq:
                raise ValueError(
                    f"acknowledgement of seq {through_seq} for stream {self._stream_id}, but the last event "
                    f"appended is {self._next_seq - 1}"
                )
            self._db.execute("DELETE FROM events WHERE seq <= ?", (through_seq,))
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'acked_through'", (str(through_seq),))
            deleted = through_seq - self._acked_through
        self._acked_through = through_seq
        return deleted

    def _reload_counters(self) -> None:
        meta = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN ('next_seq', 'acked_through')"))
        self._next_seq, self._acked_through = int(meta["next_seq"]), int(meta["acked_through"])

    @contextlib.contextmanager
    def _transaction(self):
        """One IMMEDIATE transaction: all or nothing, durable at COMMIT; SQLite errors name the file."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise TelemetryBufferError(
                f"telemetry buffer {self.path}: write failed ({exc}); nothing was stored"
            ) from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> TelemetryBuffer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
