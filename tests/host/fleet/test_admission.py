"""One board with a valid certificate cannot take the coordinator's threads: its long polls replace each other,
its streams and downloads are capped and cancelled when idle, and the operator is answered at once throughout.
Real mutual-TLS gRPC on loopback; the hostile board is this test."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from host.fleet.admission import CallLimitError, CallSlots, board_calls_for
from host.fleet.limits import MAX_STREAMS_PER_NODE, OPERATOR_RESERVED_WORKERS

from .test_service import _channel, admin, fleet_pb2, register, submit

QUICK_S = 5.0  # what "at once" means on a shared 2-core machine


def _list_agents_s(cert_dir, port) -> float:
    started = time.monotonic()
    admin(cert_dir, port).ListAgents(fleet_pb2.ListAgentsRequest(), timeout=QUICK_S)
    return time.monotonic() - started


@pytest.mark.slow  # ~5 s: a flood of long polls
def test_seventy_long_polls_of_one_board_leave_the_operator_answered_at_once(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    outcomes: queue.Queue = queue.Queue()

    def poll():
        started = time.monotonic()
        try:
            stub.PullJob(fleet_pb2.PullJobRequest(wait_s=30), timeout=60)
            outcomes.put(("returned", time.monotonic() - started))
        except grpc.RpcError as error:
            outcomes.put((error.code().name, time.monotonic() - started))

    with ThreadPoolExecutor(max_workers=70) as pool:
        for _ in range(70):
            pool.submit(poll)
        time.sleep(2.0)
        assert _list_agents_s(cert_dir, coordinator.port) < QUICK_S
        assert coordinator.coordinator.slots.open_calls("pi-1") <= 1  # the newest poll waits; the others left
        runs = submit(cert_dir, coordinator.port, agents=["pi-1"])  # the waiting poll takes the job at once
        assert runs
    results = [outcomes.get() for _ in range(70)]
    kinds = {kind for kind, _ in results}
    assert kinds <= {"returned", "RESOURCE_EXHAUSTED"}, results
    assert max(seconds for _, seconds in results) < 25  # none was held to its 30 s wait


@pytest.mark.slow  # ~5 s: a flood of streams
def test_sixty_four_silent_telemetry_streams_of_one_board_hold_two_threads(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    never = threading.Event()

    def silent():
        never.wait()
        yield from ()

    codes: queue.Queue = queue.Queue()

    def stream(call):
        try:
            list(call)
            codes.put("OK")
        except grpc.RpcError as error:
            codes.put(error.code().name)

    calls = [stub.StreamTelemetry(silent(), timeout=60) for _ in range(64)]
    threads = [threading.Thread(target=stream, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    refused = [codes.get(timeout=30) for _ in range(64 - MAX_STREAMS_PER_NODE)]
    assert refused == ["RESOURCE_EXHAUSTED"] * len(refused)
    assert coordinator.coordinator.slots.open_calls("pi-1", "stream") == MAX_STREAMS_PER_NODE
    assert _list_agents_s(cert_dir, coordinator.port) < QUICK_S
    other = register(cert_dir, coordinator.port, "pi-2")  # other boards are not affected
    assert other.Heartbeat(fleet_pb2.HeartbeatRequest(), timeout=QUICK_S) is not None
    never.set()
    for call in calls:
        call.cancel()
    deadline = time.monotonic() + 10
    while coordinator.coordinator.slots.open_calls("pi-1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert coordinator.coordinator.slots.open_calls("pi-1") == 0  # a closed stream gives its slot back


def test_call_slots_count_per_board_and_kind():
    slots = CallSlots({"call": 3, "stream": 1, "download": 1})
    with slots.hold("a", "stream"):
        with pytest.raises(CallLimitError, match=r"node 'a' already holds 1 open telemetry streams \(the limit"):
            with slots.hold("a", "stream"):
                pass
        with slots.hold("b", "stream"), slots.hold("a", "download"), slots.hold("a"):
            with pytest.raises(CallLimitError, match=r"holds 3 open calls"):
                with slots.hold("a"):
                    pass
    assert slots.open_calls("a") == slots.open_calls("a", "stream") == 0
    replaced_first = slots.new_poll("a")
    assert not replaced_first()
    slots.new_poll("a")
    assert replaced_first()


@pytest.mark.slow  # ~5 s: a crowd of boards
def test_a_crowd_of_boards_never_takes_the_threads_kept_for_the_operator(cert_dir, tmp_path):
    """Each board within its own limits, together more calls than the server has threads: the boards hold at most
    the threads minus OPERATOR_RESERVED_WORKERS, the rest are refused RESOURCE_EXHAUSTED naming the fleet-wide
    limit, and ListAgents and the health check are answered at once. Without the fleet-wide limit, 5 long polls and
    10 silent streams took all 12 threads and the operator waited."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from host.fleet.server import start_coordinator

    workers = 12
    running = start_coordinator("127.0.0.1:0", cert_dir, state_dir=tmp_path / "state", max_workers=workers)
    boards = ["pi-1", "pi-2", "pi-3", "pi-gone", "pi-small"]
    stubs = [register(cert_dir, running.port, name) for name in boards]
    never = threading.Event()
    outcomes: queue.Queue = queue.Queue()

    def silent():
        never.wait()
        yield from ()

    def consume(call):
        try:
            list(call)
            outcomes.put(("OK", ""))
        except grpc.RpcError as error:
            outcomes.put((error.code().name, error.details()))

    def poll(stub):
        try:
            stub.PullJob(fleet_pb2.PullJobRequest(wait_s=30), timeout=60)
            outcomes.put(("OK", ""))
        except grpc.RpcError as error:
            outcomes.put((error.code().name, error.details()))

    calls = []
    try:
        for stub in stubs:
            threading.Thread(target=poll, args=(stub,), daemon=True).start()
            for _ in range(MAX_STREAMS_PER_NODE):
                call = stub.StreamTelemetry(silent(), timeout=60)
                calls.append(call)
                threading.Thread(target=consume, args=(call,), daemon=True).start()
        held = board_calls_for(workers)
        assert held == workers - OPERATOR_RESERVED_WORKERS
        total = len(stubs) * (1 + MAX_STREAMS_PER_NODE)
        refused = [outcomes.get(timeout=30) for _ in range(total - held)]
        assert {code for code, _ in refused} == {"RESOURCE_EXHAUSTED"}, refused
        assert all("board calls" in detail and "retry" in detail for _, detail in refused), refused[0]
        assert running.coordinator.slots.open_board_calls() == held
        assert _list_agents_s(cert_dir, running.port) < QUICK_S
        health = health_pb2_grpc.HealthStub(_channel(cert_dir, "alice", running.port))
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=QUICK_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        never.set()
        for call in calls:
            call.cancel()
        running.stop(grace_s=0)


def test_a_server_needs_more_threads_than_it_keeps_for_the_operator():
    assert board_calls_for(OPERATOR_RESERVED_WORKERS + 1) == 1
    with pytest.raises(ValueError, match=rf"more than {OPERATOR_RESERVED_WORKERS} threads"):
        board_calls_for(OPERATOR_RESERVED_WORKERS)
    slots = CallSlots(board_calls=2)
    with slots.hold("a"), slots.hold("b"):
        with pytest.raises(CallLimitError, match=r"already serves 2 board calls"):
            with slots.hold("c"):
                pass
    assert slots.open_board_calls() == 0
