"""The fault proxy corrupts and drops bytes at the rates asked, and the link still delivers every message exactly
once, in order, unchanged through it."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from device_agent.serial_bridge.framing import max_frame_wire_bytes
from device_agent.serial_bridge.link import BoardLink, HostReopenedError, Link, LinkTimeoutError
from device_agent.serial_bridge.proxy import FaultProxy
from tests.device_agent.serial_bridge.test_link import SocketPort


class _Sink:
    """A TCP server that keeps what it receives and sends ``reply`` to each connection."""

    def __init__(self, reply: bytes = b"") -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.sendall(self.reply)
            while data := conn.recv(65536):
                self.received += data


def _through(proxy: FaultProxy, data: bytes, sink: _Sink) -> bytes:
    """Send ``data`` through ``proxy`` to ``sink``, return what the client read back (the sink's reply)."""
    with socket.create_connection(("127.0.0.1", proxy.port)) as client:
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        back = bytearray()
        while chunk := client.recv(65536):
            back += chunk
    sink.thread.join(timeout=10)
    return bytes(back)


def test_probabilities_are_checked():
    for bad in ({"corrupt_probability": 1.0}, {"corrupt_probability": -0.01},
                {"corrupt_probability": 0.1, "drop_probability": 1.0}, {"corrupt_probability": "0.1"}):
        with pytest.raises(ValueError, match=r"per-byte probability in \[0, 1\)"):
            FaultProxy("127.0.0.1", 1, **bad)


def test_a_clean_proxy_relays_both_directions_unchanged():
    data = random.Random(3).randbytes(300_000)
    sink = _Sink(reply=data[::-1])
    with FaultProxy("127.0.0.1", sink.port, corrupt_probability=0.0) as proxy:
        assert _through(proxy, data, sink) == data[::-1]
        assert bytes(sink.received) == data
        assert proxy.bytes_forwarded == 2 * len(data)
        assert proxy.bytes_corrupted == proxy.bytes_dropped == 0


def test_corruption_hits_bytes_at_the_asked_rate():
    data = random.Random(4).randbytes(400_000)
    sink = _Sink()
    with FaultProxy("127.0.0.1", sink.port, corrupt_probability=0.05, drop_probability=0.0, seed=7) as proxy:
        _through(proxy, data, sink)
        received = bytes(sink.received)
        assert len(received) == len(data)
        differing = sum(a != b for a, b in zip(data, received, strict=True))
        assert differing == proxy.bytes_corrupted  # XOR with a nonzero byte always changes it
        # binomial(400k, 0.05): mean 20000, sd 138
        assert 19_300 < differing < 20_700
        assert proxy.bytes_dropped == 0 and proxy.bytes_forwarded == len(data)


def test_drops_default_to_a_tenth_and_the_fault_positions_follow_the_seed():
    data = random.Random(5).randbytes(200_000)
    outputs = []
    for seed in (11, 11, 12):
        sink = _Sink()
        with FaultProxy("127.0.0.1", sink.port, corrupt_probability=0.02, seed=seed) as proxy:
            _through(proxy, data, sink)
            assert proxy.drop_probability == pytest.approx(0.002)
            assert len(sink.received) == len(data) - proxy.bytes_dropped == proxy.bytes_forwarded
            assert 300 < proxy.bytes_dropped < 500  # binomial(200k, 0.002): mean 400, sd 20
            assert 3_500 < proxy.bytes_corrupted < 4_500
        outputs.append(bytes(sink.received))
    assert outputs[0] == outputs[1] != outputs[2]


def test_close_ends_relayed_connections_and_threads():
    sink = _Sink()
    proxy = FaultProxy("127.0.0.1", sink.port, corrupt_probability=0.0)
    client = socket.create_connection(("127.0.0.1", proxy.port))
    client.sendall(b"x")
    time.sleep(0.1)
    proxy.close()
    client.settimeout(5)
    assert client.recv(10) == b""  # the proxy closed our side
    client.close()
    assert not any(t.name.startswith(f"fault-proxy-{proxy.port}") for t in threading.enumerate())
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1)


class _EchoBoard:
    """The board's side: answers each hello with b"info" and echoes every other message, until stopped."""

    def __init__(self, board: BoardLink) -> None:
        self.board, self.echoed, self.stop = board, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                message = self.board.receive(0.05)  # receiving keeps acknowledging what the host resends
            except LinkTimeoutError:
                continue
            try:
                self.board.send(b"info" if self.board.received_hello else message)
            except HostReopenedError:
                continue  # a resent hello: it is in the queue, answer that one
            self.echoed += not self.board.received_hello


def _echo_through_proxy(payloads: list[bytes], **proxy_options):
    """Host -> proxy -> board; every payload is echoed; returns (echoes, host counters, board counters, proxy)."""
    options = {"ack_timeout_s": 0.03, "max_retries": 2000}
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            FaultProxy("127.0.0.1", listener.getsockname()[1], **proxy_options) as proxy, \
            ThreadPoolExecutor(max_workers=1) as pool:
        host = Link.connect(f"socket://127.0.0.1:{proxy.port}", **options)
        conn, _ = listener.accept()
        board = BoardLink(SocketPort(conn), **options)
        echo = _EchoBoard(board)
        with host, board:
            board_done = pool.submit(echo.run)
            try:
                assert host.open(b"hello", timeout_s=60) == b"info"
                echoes = []
                for payload in payloads:
                    host.send(payload)
                    echoes.append(host.receive(60))
                # both ends keep reading until the board's last echo is acknowledged (or a late copy shows up)
                while echo.echoed < len(payloads) and not board_done.done():
                    with contextlib.suppress(LinkTimeoutError):
                        echoes.append(host.receive(0.05))
            finally:
                echo.stop.set()
            board_done.result(timeout=10)
            return echoes, host.counters, board.counters, proxy


def _payloads(count: int, max_bytes: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(1, max_bytes)) for _ in range(count)]


@pytest.mark.parametrize("frames_hit", [0.01, 0.05])
def test_200_full_size_messages_arrive_once_in_order_when_frames_are_hit(frames_hit):
    """200 payloads of 1..4096 bytes each way, the byte rate set so that ``frames_hit`` of the frames are faulty.

    (1% or 5% per byte would spoil practically every frame of a few kB: 0.99**4100 = 1e-18.)"""
    payloads = _payloads(200, 4096, seed=int(frames_hit * 1000))
    mean_wire_bytes = max_frame_wire_bytes(2048) / 2  # escapes are rare in random bytes
    per_byte = 1 - (1 - frames_hit) ** (1 / mean_wire_bytes)
    echoes, host, board, proxy = _echo_through_proxy(payloads, corrupt_probability=per_byte, seed=1)
    assert echoes == payloads
    assert host.payload_bytes_sent == board.payload_bytes_received  # nothing delivered twice
    assert board.payload_bytes_sent == host.payload_bytes_received
    assert proxy.bytes_corrupted > 0
    if frames_hit == 0.05:
        assert host.frames_retransmitted + board.frames_retransmitted > 0
        assert host.crc_errors + board.crc_errors > 0


@pytest.mark.parametrize(("per_byte", "max_bytes", "count"), [(0.01, 64, 60), (0.05, 6, 30)])
def test_small_messages_survive_1_and_5_percent_of_bytes_corrupted(per_byte, max_bytes, count):
    payloads = _payloads(count, max_bytes, seed=count)
    echoes, host, board, proxy = _echo_through_proxy(payloads, corrupt_probability=per_byte, seed=2)
    assert echoes == payloads
    assert host.payload_bytes_sent == board.payload_bytes_received
    assert board.payload_bytes_sent == host.payload_bytes_received
    assert proxy.bytes_corrupted > 0 and proxy.bytes_dropped > 0
    assert host.frames_retransmitted > 0 and board.frames_retransmitted > 0
    assert host.crc_errors + host.frames_dropped > 0 and board.crc_errors + board.frames_dropped > 0
