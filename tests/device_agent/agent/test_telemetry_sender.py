"""Per-run durable telemetry and its sender over real mutual TLS: acks, resend after reconnect, back-pressure."""

from __future__ import annotations

import threading
import time

import pytest

from device_agent.agent.telemetry import BUFFER_FILE, RETIRE_FILE, TelemetryClosed, TelemetrySender, TelemetrySink
from tests.device_agent.agent.fleet_double import FakeFleet, Server, channel, fleet_pb2, make_certs, wait_until


@pytest.fixture(scope="module")
def cert_root(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs") / "fleet", "node-a")


@pytest.fixture
def server(cert_root):
    srv = Server(cert_root, FakeFleet()).start()
    yield srv
    srv.stop()


class Streaming:
    """A sender on its own thread, as the agent runs it (and as the bench runs a thousand)."""

    def __init__(self, cert_root, target, sink, **kwargs):
        self.channel = channel(cert_root, "node-a", target)
        self.sender = TelemetrySender(self.channel, sink, **kwargs)
        self.errors = []
        self.thread = threading.Thread(target=self.sender.run, args=(self._retry,), daemon=True)
        self.thread.start()

    def _retry(self, exc):
        self.errors.append(exc.code())
        time.sleep(0.05)

    def close(self):
        self.sender.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.channel.close()


def _event(step: int):
    return fleet_pb2.TelemetryEvent(job_id="job-1", unix_time_s=time.time(), rss=fleet_pb2.RssSample(rss_bytes=step))


def test_events_are_stored_once_and_acks_free_the_buffer(cert_root, server, tmp_path):
    logs = []
    sink = TelemetrySink(tmp_path, log=logs.append)
    run = sink.for_run("run-1")
    streaming = Streaming(cert_root, server.target, sink, batch_events=7)
    try:
        for i in range(30):
            run.emit(_event(i))
        run.emit_many([_event(i) for i in range(30, 50)])
        assert run.emitted == 50
        wait_until(lambda: run.buffer.pending_count == 0, what="acks for all 50 events")
        assert server.fleet.stored("run-1") == list(range(1, 51))
        assert server.fleet.duplicates == 0
        batches = [b for b in server.fleet.batches if b.events]
        assert max(len(b.events) for b in batches) <= 7
        assert {b.stream_id for b in batches} == {run.buffer.stream_id}
        events = server.fleet.events[(run.buffer.stream_id, "run-1")]
        assert [events[s].rss.rss_bytes for s in range(1, 51)] == list(range(50))  # seq k is the k-th event emitted
    finally:
        streaming.close()
        sink.close()


def test_a_run_that_emits_after_every_short_step_sends_few_batches_and_loses_no_event(cert_root, server, tmp_path):
    """A batch per training step cost the coordinator a transaction each and slowed the board's paging steps: a
    run's batches leave at most one per interval unless full, and every event still arrives."""
    sink = TelemetrySink(tmp_path)
    run = sink.for_run("run-1")
    streaming = Streaming(cert_root, server.target, sink, batch_events=500, min_batch_interval_s=1.0)
    try:
        for i in range(20):  # a step's events every 20 ms, the acknowledgements back long before the next
            run.emit(_event(i))
            time.sleep(0.02)
        wait_until(lambda: run.buffer.pending_count == 0, what="acks for all 20 events")
        assert server.fleet.stored("run-1") == list(range(1, 21))
        batches = [b for b in server.fleet.batches if b.events]
        assert len(batches) == 2, [len(b.events) for b in batches]  # the first event at once, the rest together
    finally:
        streaming.close()
        sink.close()
    with pytest.raises(ValueError, match="min_batch_interval_s"):
        TelemetrySender(None, sink, min_batch_interval_s=float("nan"))


def test_a_batch_of_large_events_stays_under_the_byte_cap(cert_root, server, tmp_path, monkeypatch):
    import device_agent.agent.telemetry as telemetry

    monkeypatch.setattr(telemetry, "BATCH_BYTES", 50_000)
    sink = TelemetrySink(tmp_path)
    run = sink.for_run("run-1")
    streaming = Streaming(cert_root, server.target, sink, min_batch_interval_s=0.0)
    try:
        big = [fleet_pb2.TelemetryEvent(job_id="j" * 10_000, unix_time_s=float(i)) for i in range(30)]
        run.emit_many(big)
        wait_until(lambda: run.buffer.pending_count == 0, what="acks for all 30 events")
        assert server.fleet.stored("run-1") == list(range(1, 31))
        batches = [b for b in server.fleet.batches if b.events]
        assert len(batches) >= 6 and all(sum(e.ByteSize() for e in b.events) <= 50_000 + 100 * len(b.events)
                                         for b in batches), [len(b.events) for b in batches]
    finally:
        streaming.close()
        sink.close()


def test_resend_from_the_acked_point_after_the_server_restarts(cert_root, server, tmp_path):
    sink = TelemetrySink(tmp_path)
    run = sink.for_run("run-r")
    streaming = Streaming(cert_root, server.target, sink)
    try:
        run.emit_many([_event(i) for i in range(20)])
        wait_until(lambda: run.buffer.acked_through == 20, what="first acks")
        server.fleet.hold_acks.set()  # the next events are stored by the server, but never acknowledged
        run.emit_many([_event(i) for i in range(20, 40)])
        wait_until(lambda: len(server.fleet.stored("run-r")) == 40, what="events 21..40 at the server")
        assert run.buffer.acked_through == 20
        server.stop()
        run.emit_many([_event(i) for i in range(40, 60)])  # while the coordinator is down
        time.sleep(0.3)
        server.fleet.hold_acks.clear()
        server.start()  # same port, same store
        wait_until(lambda: run.buffer.pending_count == 0, timeout_s=20, what="everything acknowledged")
        assert server.fleet.stored("run-r") == list(range(1, 61))  # each seq stored exactly once
        assert server.fleet.duplicates >= 20  # 21..40 were sent again from the acked point: that is the resend
        assert streaming.errors  # the stream really broke
    finally:
        streaming.close()
        sink.close()


def test_ack_application_ignores_other_streams_old_and_impossible_acks(tmp_path):
    logs = []
    sink = TelemetrySink(tmp_path, log=logs.append)
    run = sink.for_run("run-a")
    run.emit_many([_event(i) for i in range(5)])
    stream = run.buffer.stream_id
    assert sink.apply_ack("run-a", "another-stream", 5) == 0
    assert sink.apply_ack("no-such-run", stream, 5) == 0
    assert sink.apply_ack("run-a", stream, 3) == 3 and run.buffer.pending_count == 2
    assert sink.apply_ack("run-a", stream, 2) == 0  # older: ignored
    assert sink.apply_ack("run-a", stream, 99) == 0 and run.buffer.acked_through == 3
    assert any("ignored an acknowledgement" in line for line in logs)
    sink.close()


def test_full_buffer_blocks_the_runner_until_acks_free_space(cert_root, server, tmp_path):
    logs = []
    sink = TelemetrySink(tmp_path, max_events_per_run=10, log=logs.append)
    run = sink.for_run("run-f")
    server.fleet.hold_acks.set()
    streaming = Streaming(cert_root, server.target, sink)
    emitted = []

    def runner():
        for i in range(25):
            run.emit(_event(i))
            emitted.append(i)

    thread = threading.Thread(target=runner, daemon=True)
    try:
        thread.start()
        wait_until(lambda: len(emitted) == 10, what="ten events")
        time.sleep(0.5)
        assert thread.is_alive() and len(emitted) == 10 and run.emitted == 10  # blocked, nothing dropped
        assert [line for line in logs if "telemetry buffer full" in line] == [
            "telemetry buffer full for run run-f: pausing training until the coordinator acknowledges"]
        wait_until(lambda: any(b.buffer_full for b in server.fleet.batches), what="buffer_full sent")
        server.fleet.hold_acks.clear()
        server.stop()  # the acks lost with the held stream come after a reconnect
        server.start()
        thread.join(20)
        assert not thread.is_alive() and len(emitted) == 25
        wait_until(lambda: run.buffer.pending_count == 0, what="all acknowledged")
        assert server.fleet.stored("run-f") == list(range(1, 26))
        assert any("has room again" in line for line in logs)
    finally:
        streaming.close()
        sink.close()


@pytest.mark.parametrize("how", ["close", "interrupt"])
def test_stopping_releases_a_blocked_emit(tmp_path, how):
    sink = TelemetrySink(tmp_path, max_events_per_run=1, log=lambda _m: None)
    run = sink.for_run("run-c")
    run.emit(_event(0))
    failure = []

    def emit():
        try:
            run.emit(_event(1))
        except TelemetryClosed as exc:
            failure.append(exc)

    thread = threading.Thread(target=emit)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
    getattr(sink, how)()
    thread.join(5)
    assert failure and run.emitted == 1
    if how == "interrupt":
        sink.apply_ack("run-c", run.buffer.stream_id, 1)
        run.emit(_event(2))  # an emit with room still succeeds while stopping
        assert run.emitted == 2
    sink.close()


def test_restart_resumes_numbering_and_sends_what_was_left(cert_root, server, tmp_path):
    sink = TelemetrySink(tmp_path)
    sink.for_run("run-x").emit_many([_event(i) for i in range(12)])
    sink.for_run("run-y").emit_many([_event(i) for i in range(3)])
    stream_x = sink.for_run("run-x").buffer.stream_id
    sink.close()  # the agent died before sending anything
    again = TelemetrySink(tmp_path)
    assert again.pending_runs() == ["run-x", "run-y"]
    streaming = Streaming(cert_root, server.target, again)
    try:
        wait_until(lambda: again.pending_runs() == [], what="leftovers acknowledged")
        assert server.fleet.stored("run-x") == list(range(1, 13)) and server.fleet.stored("run-y") == [1, 2, 3]
        x = again.for_run("run-x")
        assert x.buffer.stream_id == stream_x and x.emitted == 12
        x.emit(_event(99))
        wait_until(lambda: server.fleet.stored("run-x") == list(range(1, 14)), what="seq 13")
    finally:
        streaming.close()
        again.close()


def test_retire_deletes_a_drained_buffer_now_or_after_its_last_ack(tmp_path):
    sink = TelemetrySink(tmp_path, log=lambda _m: None)
    run = sink.for_run("run-d")
    run.emit_many([_event(i) for i in range(4)])
    stream = run.buffer.stream_id
    sink.retire("run-d")
    assert (tmp_path / "runs/run-d" / BUFFER_FILE).exists()  # 4 events not acknowledged yet
    sink.apply_ack("run-d", stream, 3)
    assert (tmp_path / "runs/run-d" / BUFFER_FILE).exists()
    sink.apply_ack("run-d", stream, 4)
    assert not (tmp_path / "runs/run-d" / BUFFER_FILE).exists()
    assert sink.pending_runs() == []
    empty = sink.for_run("run-e")
    sink.retire("run-e")
    assert not (tmp_path / "runs/run-e" / BUFFER_FILE).exists() and empty.buffer
    with pytest.raises(ValueError, match="cannot name a directory"):
        sink.for_run("../escape")
    sink.close()


def test_a_restart_deletes_only_buffers_retired_before_it_never_an_unfinished_runs(tmp_path):
    """Issue 17, part 2: a drained buffer of an unfinished run is kept, so the run never numbers from 1 again."""
    sink = TelemetrySink(tmp_path, log=lambda _m: None)
    unfinished, reported = sink.for_run("run-u"), sink.for_run("run-r")
    unfinished.emit_many([_event(i) for i in range(3)])
    reported.emit_many([_event(i) for i in range(2)])
    sink.apply_ack("run-u", unfinished.buffer.stream_id, 3)  # every event of the unfinished run acknowledged
    stream_r = reported.buffer.stream_id
    sink.retire("run-r")  # its result is reported; 2 events still unacknowledged
    assert (tmp_path / "runs/run-r" / RETIRE_FILE).exists()
    sink.close()  # the agent dies

    again = TelemetrySink(tmp_path, log=lambda _m: None)
    assert again.retire_drained() == []
    assert (tmp_path / "runs/run-u" / BUFFER_FILE).exists() and (tmp_path / "runs/run-r" / BUFFER_FILE).exists()
    resumed = again.for_run("run-u")
    assert resumed.emitted == 3
    resumed.emit(_event(9))
    assert resumed.buffer.unacked() and resumed.buffer.unacked()[0][0] == 4  # numbering goes on, not from 1
    again.apply_ack("run-r", stream_r, 2)  # the retirement survived the restart
    assert not (tmp_path / "runs/run-r" / BUFFER_FILE).exists()
    assert not (tmp_path / "runs/run-r" / RETIRE_FILE).exists()
    again.close()
