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

from host.fleet.admission import CallLimitError, CallSlots
from host.fleet.limits import MAX_STREAMS_PER_NODE

from .test_service import admin, fleet_pb2, register, submit

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
