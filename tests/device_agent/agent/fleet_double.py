"""A test double of the coordinator's Fleet service, on a real mutual-TLS gRPC server on loopback.

It behaves as the protocol says for what the agent's tests need (identity from the certificate,
chunked content-addressed models, per-run telemetry stored once and acknowledged at the highest
contiguous sequence, results) and has knobs to misbehave: cut a model stream, corrupt a chunk,
hold acknowledgements, refuse a removed node, fail calls as UNAVAILABLE.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from device_agent.agent.client import SERVER_KEEPALIVE_OPTIONS
from device_agent.protos import load
from host.fleet import certs

fleet_pb2 = load("poet.v1.fleet_pb2")
fleet_pb2_grpc = load("poet.v1.fleet_pb2_grpc")


def make_certs(root: Path, *nodes: str) -> Path:
    certs.init_certs(root)
    for node in nodes:
        certs.issue_cert(root, node, "node")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeFleet(fleet_pb2_grpc.FleetServicer):
    def __init__(self, *, heartbeat_interval_s: float = 0.2, chunk_bytes: int = 1024) -> None:
        self.lock = threading.Lock()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.chunk_bytes = chunk_bytes
        self.registrations: list[tuple[str, object]] = []
        self.heartbeats: list[object] = []
        self.jobs: list[object] = []
        self.models: dict[str, bytes] = {}
        self.fetch_offsets: list[int] = []
        self.cut_after_chunks: list[int] = []  # per FetchModel call, in order: abort after this many chunks
        self.corrupt_calls = 0  # this many FetchModel calls send one chunk with a wrong chunk_sha256
        self.corrupt_archive_calls = 0  # ... or one chunk with matching chunk hash but wrong bytes
        self.events: dict[tuple[str, str], dict[int, object]] = {}  # (stream, run) -> seq -> event
        self.duplicates = 0
        self.batches: list[object] = []
        self.hold_acks = threading.Event()  # set: receive and store, acknowledge nothing
        self.results: list[object] = []
        self.fail_reports = 0  # this many ReportResult calls fail UNAVAILABLE
        self.denied: set[str] = set()  # removed nodes: PERMISSION_DENIED
        self.cancel_job_ids: set[str] = set()
        self.register_again_once = False
        self.calls: list[str] = []  # method names, in arrival order

    # ------------------------------------------------------------------ helpers
    def _who(self, context, method: str) -> str:
        self.calls.append(method)
        role, name = certs.peer_identity(context.auth_context())
        if name in self.denied:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"agent {name} was removed from the fleet")
        return name

    def add_model(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.models[digest] = data
        return digest

    def stored(self, run_id: str) -> list[int]:
        with self.lock:
            return sorted(seq for (stream, run), events in self.events.items() if run == run_id for seq in events)

    # ------------------------------------------------------------------ Fleet
    def Register(self, request, context):
        name = self._who(context, "Register")
        with self.lock:
            self.registrations.append((name, request))
        return fleet_pb2.RegisterReply(agent_name=name, protocol_version=fleet_pb2.PROTOCOL_VERSION_1,
                                       heartbeat_interval_s=self.heartbeat_interval_s,
                                       max_message_bytes=8 << 20, model_chunk_bytes=self.chunk_bytes)

    def Heartbeat(self, request, context):
        self._who(context, "Heartbeat")
        with self.lock:
            self.heartbeats.append(request)
            again, self.register_again_once = self.register_again_once, False
        return fleet_pb2.HeartbeatReply(heartbeat_interval_s=self.heartbeat_interval_s,
                                        cancel_job_ids=sorted(self.cancel_job_ids), register_again=again)

    def PullJob(self, request, context):
        self._who(context, "PullJob")
        deadline = time.monotonic() + min(request.wait_s, 1.0)
        while time.monotonic() < deadline and context.is_active():
            with self.lock:
                if self.jobs:
                    return fleet_pb2.PullJobReply(job=self.jobs.pop(0))
            time.sleep(0.02)
        return fleet_pb2.PullJobReply(retry_after_s=0)

    def FetchModel(self, request, context):
        self._who(context, "FetchModel")
        data = self.models.get(request.digest)
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.digest}")
        with self.lock:
            self.fetch_offsets.append(request.offset_bytes)
            cut = self.cut_after_chunks.pop(0) if self.cut_after_chunks else None
            corrupt = self.corrupt_calls > 0
            self.corrupt_calls -= corrupt
            bad_bytes = not corrupt and self.corrupt_archive_calls > 0
            self.corrupt_archive_calls -= bad_bytes
        sent = 0
        for offset in range(request.offset_bytes, len(data), self.chunk_bytes):
            if cut is not None and sent == cut:
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection cut by the test")
            chunk = data[offset:offset + self.chunk_bytes]
            digest = hashlib.sha256(chunk).hexdigest()
            if corrupt and sent == 1:
                chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]  # flipped in transit: chunk hash no longer matches
            if bad_bytes and sent == 1:
                chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                digest = hashlib.sha256(chunk).hexdigest()  # consistent chunk, wrong archive
            yield fleet_pb2.ModelChunk(offset_bytes=offset, data=chunk, chunk_sha256=digest,
                                       total_size_bytes=len(data))
            sent += 1

    def StreamTelemetry(self, request_iterator, context):
        self._who(context, "StreamTelemetry")
        for batch in request_iterator:
            key = (batch.stream_id, batch.run_id)
            with self.lock:
                self.batches.append(batch)
                stored = self.events.setdefault(key, {})
                for event in batch.events:
                    if event.seq in stored:
                        self.duplicates += 1
                    else:
                        stored[event.seq] = event
                through = 0
                while through + 1 in stored:
                    through += 1
            if not self.hold_acks.is_set():
                yield fleet_pb2.TelemetryAck(stream_id=batch.stream_id, run_id=batch.run_id,
                                             stored_through_seq=through)

    def ReportResult(self, request, context):
        self._who(context, "ReportResult")
        with self.lock:
            if self.fail_reports > 0:
                self.fail_reports -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "report dropped by the test")
            self.results.append(request)
        return fleet_pb2.ReportResultReply()


class Server:
    """The double on 127.0.0.1:port with the coordinator's real certificate; restartable on the same port."""

    def __init__(self, cert_root: Path, fleet: FakeFleet, port: int | None = None) -> None:
        self.cert_root = cert_root
        self.fleet = fleet
        self.port = port or free_port()
        self.server = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Server:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=SERVER_KEEPALIVE_OPTIONS)
        fleet_pb2_grpc.add_FleetServicer_to_server(self.fleet, server)
        bound = server.add_secure_port(self.target, certs.server_credentials(self.cert_root / "coordinator"))
        assert bound == self.port
        server.start()
        self.server = server
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait(5)
            self.server = None


def channel(cert_root: Path, node: str, target: str) -> grpc.Channel:
    from device_agent.agent.client import CHANNEL_OPTIONS

    return grpc.secure_channel(target, certs.channel_credentials(cert_root / node), options=CHANNEL_OPTIONS)


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
