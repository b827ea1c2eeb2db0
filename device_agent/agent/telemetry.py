"""Telemetry on the board: a durable buffer per run that the job runner writes to, and the sender.

:class:`TelemetrySink` keeps one :class:`~device_agent.agent.buffer.TelemetryBuffer` per run at
``STATE_DIR/runs/<run_id>/telemetry.db``. The runner gets a :class:`RunTelemetry`; every event is
stored (and numbered) before anything is sent. When a run's buffer is full, :meth:`RunTelemetry.emit`
blocks until acknowledgements free space: training pauses, nothing is dropped.

:class:`TelemetrySender` streams every run's unacknowledged events over one bidirectional
``StreamTelemetry`` call, in batches of up to ``batch_events``, and applies the coordinator's
``TelemetryAck`` (highest contiguous sequence stored) to the run's buffer. After a reconnect it
resends from the acknowledged point; the coordinator drops what it already has. It needs only a
channel and a sink (no global state), so a benchmark can run a thousand of them in one process.

A run's buffer is deleted only once the run's result was reported (:meth:`TelemetrySink.retire`, which
leaves a ``telemetry.retire`` marker on disk until it is done), never merely because every event was
acknowledged: an unfinished run resumed after a restart must go on numbering where it stopped, since
the coordinator drops every seq at or below what it already stored for the run.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from device_agent.agent.buffer import DEFAULT_MAX_EVENTS, BufferFullError, TelemetryBuffer
from device_agent.fileio import atomic_write_text
from device_agent.protos import load

__all__ = ["BUFFER_FILE", "DEFAULT_MAX_EVENTS", "RunTelemetry", "TelemetryClosed", "TelemetrySender", "TelemetrySink"]

fleet_pb2 = load("poet.v1.fleet_pb2")
# Stream errors about one run rather than the connection (the coordinator names the run in the details).
REFUSED_RUN_CODES = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND,
                               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT})
fleet_pb2_grpc = load("poet.v1.fleet_pb2_grpc")

RUNS_DIR = "runs"
# A run's events leave in batches at most this often unless a batch is full (TelemetrySender's docstring).
MIN_BATCH_INTERVAL_S = 0.5
# Events in one batch: under the coordinator's cap (host.fleet.limits.MAX_EVENTS_PER_BATCH, 5000), and enough that
# a run whose steps take tens of milliseconds sends a batch per interval rather than one every few steps.
BATCH_EVENTS = 4000
# Payload bytes in one batch: half the coordinator's gRPC message cap (8 MiB), which 4,000 events of the largest
# size it takes (16 KiB each) would pass.
BATCH_BYTES = 4 * 1024 * 1024
BUFFER_FILE = "telemetry.db"
RETIRE_FILE = "telemetry.retire"  # the run's result is reported: delete its buffer once drained
_BUFFER_FILES = (BUFFER_FILE, f"{BUFFER_FILE}-wal", f"{BUFFER_FILE}-shm", f"{BUFFER_FILE}-journal")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TelemetryClosed(RuntimeError):
    """The sink was closed (the agent is stopping) while an emit waited for buffer space."""


class RunTelemetry:
    """One run's durable telemetry: what the job runner writes its events to."""

    def __init__(self, sink: TelemetrySink, run_id: str, buffer: TelemetryBuffer) -> None:
        self.sink = sink
        self.run_id = run_id
        self.buffer = buffer
        self.full = False  # an emit is waiting for space (sent to the coordinator as buffer_full)

    @property
    def emitted(self) -> int:
        """Events sequenced for this run so far, across restarts."""
        return self.buffer.next_seq - 1

    def emit(self, event) -> None:
        """Store one ``TelemetryEvent`` (its seq is left unset; the buffer numbers it)."""
        self.emit_many((event,))

    def emit_many(self, events: Iterable) -> None:
        """Store events in one transaction; blocks while the buffer is full, never drops."""
        payloads = [e.SerializeToString() for e in events]
        if not payloads:
            return
        if len(payloads) > self.buffer.max_events:  # could never fit at once: store in pieces
            for start in range(0, len(payloads), self.buffer.max_events):
                self._append(payloads[start:start + self.buffer.max_events])
            return
        self._append(payloads)

    def _append(self, payloads: list[bytes]) -> None:
        sink = self.sink
        while True:
            if sink.closed:
                raise TelemetryClosed(f"telemetry of run {self.run_id} is closed (the agent is stopping)")
            try:
                self.buffer.append_many(payloads)
            except BufferFullError:
                if sink.interrupted:
                    raise TelemetryClosed(f"telemetry buffer of run {self.run_id} is full and the agent is "
                                          "stopping: the job stops here and resumes from its checkpoint") from None
                if not self.full:
                    self.full = True
                    sink.log(f"telemetry buffer full for run {self.run_id}: pausing training until the "
                             "coordinator acknowledges")
                    sink.notify()  # the sender tells the coordinator buffer_full
                with sink.space:
                    sink.space.wait(0.1)
                continue
            if self.full:
                self.full = False
                sink.log(f"telemetry buffer of run {self.run_id} has room again: training resumes")
            sink.notify()
            return


class TelemetrySink:
    """The agent's per-run telemetry buffers under ``STATE_DIR/runs/``."""

    def __init__(self, state_dir: str | os.PathLike, max_events_per_run: int = DEFAULT_MAX_EVENTS,
                 log: Callable[[str], None] = _stderr) -> None:
        self.runs_dir = Path(state_dir) / RUNS_DIR
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.max_events_per_run = max_events_per_run
        self.log = log
        self.closed = False
        self.interrupted = False  # the agent is stopping: an emit waiting for space gives up
        self._lock = threading.Lock()
        self._runs: dict[str, RunTelemetry] = {}
        self._retiring: set[str] = set()
        self.new_events = threading.Condition()  # notified on every append (the sender waits on it)
        self.space = threading.Condition()  # notified on every acknowledgement (a full emit waits on it)
        self._version = 0  # bumped on every append: lets the sender sleep without missing one
        self.parked: set[str] = set()  # runs whose telemetry the coordinator refused (kept on disk, not sent)

    # --------------------------------------------------------------------------------- runner side
    def for_run(self, run_id: str) -> RunTelemetry:
        """The run's telemetry, its buffer opened or created (a restarted agent continues its numbering)."""
        _check_run_id(run_id)
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                directory = self.runs_dir / run_id
                directory.mkdir(parents=True, exist_ok=True)
                run = RunTelemetry(self, run_id, TelemetryBuffer(directory / BUFFER_FILE, self.max_events_per_run))
                self._runs[run_id] = run
                if (directory / RETIRE_FILE).exists():  # retired by an earlier process that stopped before the end
                    self._retiring.add(run_id)
            return run

    def pending_runs(self) -> list[str]:
        """Runs with unacknowledged events, on disk or open; opens the ones found on disk."""
        on_disk = sorted(p.parent.name for p in self.runs_dir.glob(f"*/{BUFFER_FILE}"))
        for run_id in on_disk:
            if run_id not in self._runs:
                try:
                    self.for_run(run_id)
                except Exception as exc:  # a damaged buffer is reported, not fatal to the others
                    self.log(f"telemetry buffer of run {run_id} cannot be opened: {exc}")
        with self._lock:
            return sorted(r for r, run in self._runs.items() if run.buffer.pending_count)

    def open_runs(self) -> list[RunTelemetry]:
        with self._lock:
            return list(self._runs.values())

    def retire(self, run_id: str) -> None:
        """The run's result is reported: delete its buffer now if every event is acknowledged, else as soon
        as the last one is (also after a restart: a marker file remembers it)."""
        try:
            _check_run_id(run_id)
        except ValueError:
            return  # no buffer can have this name
        directory = self.runs_dir / run_id
        if (directory / BUFFER_FILE).exists():
            atomic_write_text(directory / RETIRE_FILE, "result reported\n")
            if run_id not in self._runs:
                try:
                    self.for_run(run_id)  # opened: deleted only once drained
                except Exception as exc:  # noqa: BLE001  (a damaged buffer is left for inspection)
                    self.log(f"telemetry buffer of run {run_id} cannot be opened: {exc}")
                    return
        with self._lock:
            self._retiring.add(run_id)
        self._retire_if_drained(run_id)

    def retire_drained(self) -> list[str]:
        """Delete the drained buffers of runs retired before a restart; the others stay (an unfinished run
        keeps its buffer, and so its numbering, even when every event is acknowledged). Returns the runs."""
        self.pending_runs()  # opens every buffer on disk and notes the retired ones
        with self._lock:
            for marker in self.runs_dir.glob(f"*/{RETIRE_FILE}"):  # stopped after deleting the buffer itself
                if not (marker.parent / BUFFER_FILE).exists():
                    self._retiring.add(marker.parent.name)
            retiring = sorted(self._retiring)
        return [run_id for run_id in retiring if self._retire_if_drained(run_id)]

    def _retire_if_drained(self, run_id: str) -> bool:
        with self._lock:
            if run_id not in self._retiring:
                return False
            run = self._runs.get(run_id)
            if run is not None and run.buffer.pending_count:
                return False
            self._retiring.discard(run_id)
            self._runs.pop(run_id, None)
        if run is not None:
            run.buffer.close()
        for name in (*_BUFFER_FILES, RETIRE_FILE):  # the marker last: a crash before it retires again
            (self.runs_dir / run_id / name).unlink(missing_ok=True)
        return True

    # --------------------------------------------------------------------------------- sender side
    def notify(self) -> None:
        with self.new_events:
            self._version += 1
            self.new_events.notify_all()

    def wait_for_events(self, seen_version: int, timeout_s: float) -> int:
        """Block until an append after ``seen_version`` (or the timeout, or close); returns the version."""
        with self.new_events:
            if self._version == seen_version and not self.closed:
                self.new_events.wait(timeout_s)
            return self._version

    def apply_ack(self, run_id: str, stream_id: str, stored_through_seq: int) -> int:
        """Apply a TelemetryAck; returns the events it freed (0 for an unknown run or another stream)."""
        with self._lock:
            run = self._runs.get(run_id)
        if run is None or run.buffer.stream_id != stream_id:
            return 0
        try:
            freed = run.buffer.ack(stored_through_seq)
        except ValueError as exc:
            self.log(f"ignored an acknowledgement for run {run_id}: {exc}")
            return 0
        if freed:
            with self.space:
                self.space.notify_all()
            self._retire_if_drained(run_id)
            self.notify()  # the sender may send what waited for this acknowledgement
        return freed

    def interrupt(self) -> None:
        """Make emits that wait for space (and only those) raise :class:`TelemetryClosed`: the agent is stopping."""
        self.interrupted = True
        with self.space:
            self.space.notify_all()

    def close(self) -> None:
        """Wake and refuse waiting emits; close every buffer (their events stay on disk)."""
        self.closed = True
        with self.space:
            self.space.notify_all()
        self.notify()
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            run.buffer.close()

    def remove_run_dir_if_empty(self, run_id: str) -> None:
        directory = self.runs_dir / run_id
        if directory.is_dir() and not any(directory.iterdir()):
            shutil.rmtree(directory, ignore_errors=True)


class TelemetrySender:
    """Streams a sink's unacknowledged events over ``StreamTelemetry`` and applies the acknowledgements.

    :meth:`stream_once` runs one call until it fails or :meth:`stop`; :meth:`run` repeats it with
    ``wait_retry(error)`` between calls. In-flight events per run are capped at ``window_events``; while
    a batch is in flight, the next one leaves when it is full or the acknowledgement arrives; if no
    acknowledgement arrives for ``resend_after_s`` while events are in flight, they are sent again.

    A run's batches leave at most one per ``min_batch_interval_s`` unless full: each costs the coordinator a
    database transaction, and a batch after every short training step kept the coordinator's disk and the
    board's cores busy beside training. Measured through the fleet on one 2-core machine
    (``bench/calibration.py --as-user``), the small CNN's paging-heavy steps took 5.3-5.8 ms with a batch per
    step and 3.4-3.9 ms with batches at most every 0.5 s; mlp's 2.5-2.9 ms and 1.5-1.6 ms. Batches of 500 then
    still left every other step of resnet18_cifar's paging-heavy schedule (248 events a step), and those steps took
    38-41 ms against 28-31 ms for the others; batches of up to :data:`BATCH_EVENTS` leave on the interval, and that
    schedule's steps measured 27-29 ms. An event still leaves within ``min_batch_interval_s`` (plus ``flush_s``)
    of being stored.
    """

    def __init__(self, channel: grpc.Channel, sink: TelemetrySink, *, batch_events: int = BATCH_EVENTS,
                 flush_s: float = 0.1, window_events: int = 2000, resend_after_s: float = 15.0,
                 min_batch_interval_s: float = MIN_BATCH_INTERVAL_S,
                 log: Callable[[str], None] | None = None) -> None:
        if not 0.0 <= min_batch_interval_s < float("inf"):
            raise ValueError(f"min_batch_interval_s must be a finite number of seconds >= 0, got {min_batch_interval_s!r}")
        self.stub = fleet_pb2_grpc.FleetStub(channel)
        self.sink = sink
        self.batch_events = batch_events
        self.flush_s = flush_s
        self.window_events = max(window_events, batch_events)
        self.resend_after_s = resend_after_s
        self.min_batch_interval_s = min_batch_interval_s
        self._last_batch_at: dict[str, float] = {}  # run -> when its last batch of events left (monotonic)
        self.log = log or sink.log
        self._stop = threading.Event()
        self._call = None
        self.batches_sent = 0
        self.events_sent = 0
        self.acks_received = 0

    def stop(self) -> None:
        self._stop.set()
        self.sink.notify()
        call = self._call
        if call is not None:
            call.cancel()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self, wait_retry: Callable[[grpc.RpcError], None]) -> None:
        """Stream until :meth:`stop`, reconnecting after each failure."""
        while not self._stop.is_set():
            try:
                self.stream_once()
                if not self._stop.is_set():
                    raise _StreamEnded()
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if exc.code() in REFUSED_RUN_CODES:
                    self._park_named_runs(exc)
                wait_retry(exc)

    def _park_named_runs(self, exc: grpc.RpcError) -> None:
        """A refusal that names a run (not assigned to us, unknown): stop sending it, keep its events on disk.

        Without this, one refused run would break the shared stream for every run, forever.
        """
        details = exc.details() or ""
        for run in self.sink.open_runs():
            if run.run_id in details and run.run_id not in self.sink.parked:
                self.sink.parked.add(run.run_id)
                self.log(f"the coordinator refuses telemetry of run {run.run_id} ({exc.code().name}: "
                         f"{details}); its {run.buffer.pending_count} unacknowledged events stay on disk, unsent")

    def stream_once(self) -> None:
        """One StreamTelemetry call: send batches, apply acks; returns when stopped, raises RpcError on failure."""
        done = threading.Event()
        sent_through: dict[str, int] = {}  # run -> highest seq sent on this call
        last_progress: dict[str, float] = {}  # run -> when its acknowledgements last moved
        reported_full: dict[str, bool] = {}  # run -> the buffer_full flag last sent
        self.sink.pending_runs()  # open buffers left on disk by an earlier process

        def batches():
            version = -1
            while not done.is_set() and not self._stop.is_set():
                sent_any = False
                for run in self.sink.open_runs():
                    if run.run_id in self.sink.parked:
                        continue
                    batch = self._next_batch(run, sent_through, last_progress, reported_full)
                    if batch is not None:
                        sent_any = True
                        self.batches_sent += 1
                        self.events_sent += len(batch.events)
                        yield batch
                if not sent_any:
                    version = self.sink.wait_for_events(version, self.flush_s)

        call = self.stub.StreamTelemetry(batches())
        self._call = call
        try:
            for ack in call:
                self.acks_received += 1
                self.sink.apply_ack(ack.run_id, ack.stream_id, ack.stored_through_seq)
                last_progress[ack.run_id] = time.monotonic()
        finally:
            done.set()
            self._call = None
            call.cancel()

    def _next_batch(self, run: RunTelemetry, sent_through: dict[str, int], last_progress: dict[str, float],
                    reported_full: dict[str, bool]):
        buffer = run.buffer
        try:
            acked, next_seq = buffer.acked_through, buffer.next_seq
        except Exception:  # closed meanwhile
            return None
        now = time.monotonic()
        sent = sent_through.get(run.run_id, acked)
        if sent < acked:
            sent = acked
        if sent > acked and now - last_progress.get(run.run_id, now) > self.resend_after_s:
            self.log(f"no acknowledgement for run {run.run_id} in {self.resend_after_s:.0f} s; resending from "
                     f"seq {acked + 1}")
            sent = acked
            last_progress[run.run_id] = now
        room = self.window_events - (sent - acked)
        # While a batch is unacknowledged, wait for a full one: a backlog then leaves in few large batches
        # (the coordinator's cost is per batch), and an idle stream still sends each event at once.
        not_full = next_seq - 1 - sent < self.batch_events
        coalescing = sent > acked and not_full
        # not full, and the run's last batch left less than the interval ago: wait for more
        too_soon = not_full and now - self._last_batch_at.get(run.run_id, -math.inf) < self.min_batch_interval_s
        if next_seq - 1 <= sent or room <= 0 or coalescing or too_soon:
            if run.full != reported_full.get(run.run_id, False):  # tell the coordinator, even with no events
                reported_full[run.run_id] = run.full
                return fleet_pb2.TelemetryBatch(stream_id=buffer.stream_id, run_id=run.run_id,
                                                buffer_full=run.full, buffered_events=buffer.pending_count)
            return None
        want = min(self.batch_events, room)
        try:
            rows = buffer.unacked(limit=(sent - acked) + want)
        except Exception:
            return None
        rows = [(seq, payload) for seq, payload in rows if seq > sent][:want]
        batch_bytes = 0
        for count, (_, payload) in enumerate(rows):
            batch_bytes += len(payload)
            if batch_bytes > BATCH_BYTES and count:  # the rest leave in the next batch
                rows = rows[:count]
                break
        if not rows:
            return None
        reported_full[run.run_id] = run.full
        batch = fleet_pb2.TelemetryBatch(stream_id=buffer.stream_id, run_id=run.run_id, buffer_full=run.full,
                                         buffered_events=buffer.pending_count)
        for seq, payload in rows:
            event = batch.events.add()
            event.ParseFromString(payload)
            event.seq = seq
        if sent == acked:  # nothing was in flight: the wait for an acknowledgement starts now
            last_progress[run.run_id] = now
        sent_through[run.run_id] = rows[-1][0]
        self._last_batch_at[run.run_id] = now
        return batch


class _StreamEnded(grpc.RpcError):
    """The coordinator closed the stream without an error: reconnect like after a failure."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the coordinator ended the telemetry stream"


def _check_run_id(run_id: str) -> None:
    if not run_id or "/" in run_id or "\\" in run_id or run_id in (".", "..") or run_id.startswith(".") \
            or len(run_id) > 128:
        raise ValueError(f"run id {run_id[:40]!r} cannot name a directory")
