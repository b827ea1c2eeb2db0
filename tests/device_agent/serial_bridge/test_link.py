"""The link's ARQ and sessions over real loopback sockets: a hand-driven peer checks each rule frame by frame,
and a host Link talks to a BoardLink both ways at once."""

from __future__ import annotations

import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from device_agent.serial_bridge.framing import (
    KIND_ACK,
    KIND_DATA,
    MAX_PAYLOAD_BYTES,
    Frame,
    FrameDecoder,
    encode_frame,
)
from device_agent.serial_bridge.link import (
    BoardLink,
    BoardResetError,
    HostReopenedError,
    Link,
    LinkClosedError,
    LinkError,
    LinkTimeoutError,
)

SESSION = 0x5EC0_0001
FAST = {"ack_timeout_s": 0.05, "max_retries": 100}


class SocketPort:
    """A connected socket with the part of pyserial's interface the link uses (the board end of a test line)."""

    def __init__(self, sock: socket.socket, name: str = "test-socket") -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.port, self.timeout = sock, name, None

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, size: int = 1) -> bytes:
        ready, _, _ = select.select([self.sock], [], [], self.timeout)
        if not ready:
            return b""
        data = self.sock.recv(size)
        if not data:
            raise OSError("socket disconnected")
        return data

    def write(self, data: bytes) -> int:
        self.sock.sendall(data)
        return len(data)

    def close(self) -> None:
        self.sock.close()


class RawPeer:
    """Plays one end by hand: writes exact frames and reads the other end's frames one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.decoder, self.pending = sock, FrameDecoder(), []

    def send(self, kind: int, seq: int, session: int, payload: bytes = b"") -> None:
        self.sock.sendall(encode_frame(kind, seq, session, payload))

    def next_frame(self, timeout_s: float = 5.0) -> Frame:
        deadline = time.monotonic() + timeout_s
        while not self.pending:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError("the link under test sent no frame")
            self.pending += self.decoder.feed(self.sock.recv(65536))
        return self.pending.pop(0)

    def silent_for(self, wait_s: float) -> bool:
        """Whether nothing arrives for ``wait_s``."""
        if self.pending:
            return False
        ready, _, _ = select.select([self.sock], [], [], wait_s)
        return not ready


def _listener() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0))


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


@pytest.fixture
def host_and_raw_board():
    """A host Link over pyserial's socket:// and the hand-driven board at the other end."""
    with _listener() as listener:
        host = Link.connect(f"socket://127.0.0.1:{listener.getsockname()[1]}", **FAST)
        conn, _ = listener.accept()
    yield host, RawPeer(conn)
    host.close()
    conn.close()


@pytest.fixture
def board_and_raw_host():
    """A BoardLink and the hand-driven host at the other end."""
    with _listener() as listener:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
    board = BoardLink(SocketPort(conn), session_id=SESSION, **FAST)
    yield board, RawPeer(client)
    board.close()
    client.close()


@pytest.fixture
def host_and_board():
    """A host Link and a BoardLink connected by a loopback socket."""
    with _listener() as listener:
        host = Link.connect(f"socket://127.0.0.1:{listener.getsockname()[1]}", **FAST)
        conn, _ = listener.accept()
    board = BoardLink(SocketPort(conn), session_id=SESSION, **FAST)
    yield host, board
    host.close()
    board.close()


def _open(pool, host: Link, board: RawPeer, reply: bytes = b"board info") -> None:
    """Open the host's session by hand: hello, ACK, the board's one reply, the host's ACK of it."""
    opened = pool.submit(host.open, b"hello")
    assert board.next_frame() == Frame(KIND_DATA, 0, 0, b"hello")
    board.send(KIND_ACK, 0, SESSION)
    board.send(KIND_DATA, 0, SESSION, reply)
    assert opened.result(timeout=5) == reply
    assert _next_ack(board) == Frame(KIND_ACK, 0, SESSION)


def _next_ack(peer: RawPeer) -> Frame:
    """The next ACK, skipping retransmitted DATA the other side sent before it saw ours."""
    while (frame := peer.next_frame()).kind != KIND_ACK:
        pass
    return frame


def test_open_sends_the_hello_learns_the_session_and_then_talks_in_it(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    assert host.session_id == SESSION
    sent = pool.submit(host.send, b"first")
    assert board.next_frame() == Frame(KIND_DATA, 1, SESSION, b"first")
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)
    board.send(KIND_DATA, 1, SESSION, b"answer")
    assert host.receive(5) == b"answer"
    assert _next_ack(board) == Frame(KIND_ACK, 1, SESSION)
    counters = host.counters
    assert counters.payload_bytes_sent == len(b"hello") + len(b"first")
    assert counters.payload_bytes_received == len(b"board info") + len(b"answer")
    assert counters.bytes_written >= counters.frames_sent * 14 and counters.bytes_read > 0


def test_open_learns_the_session_from_the_reply_when_the_ack_is_lost(pool, host_and_raw_board):
    host, board = host_and_raw_board
    opened = pool.submit(host.open, b"hello")
    assert board.next_frame() == Frame(KIND_DATA, 0, 0, b"hello")
    board.send(KIND_DATA, 0, SESSION, b"info")  # its ACK never came
    assert opened.result(timeout=5) == b"info"
    assert _next_ack(board) == Frame(KIND_ACK, 0, SESSION)
    sent = pool.submit(host.send, b"next")
    while (frame := board.next_frame()).seq == 0:
        pass  # hellos resent before the reply arrived
    assert frame == Frame(KIND_DATA, 1, SESSION, b"next")
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)


def test_a_hello_answered_twice_is_delivered_once(pool, host_and_raw_board):
    """The board answers every hello; a resent hello's second answer is a duplicate of seq 0 for the host."""
    host, board = host_and_raw_board
    opened = pool.submit(host.open, b"hello")
    assert board.next_frame() == Frame(KIND_DATA, 0, 0, b"hello")
    assert board.next_frame() == Frame(KIND_DATA, 0, 0, b"hello")  # the first one's ACK was "lost"
    for _ in range(2):
        board.send(KIND_ACK, 0, SESSION)
        board.send(KIND_DATA, 0, SESSION, b"info")
    assert opened.result(timeout=5) == b"info"
    with pytest.raises(LinkTimeoutError):
        host.receive(0.2)  # the second answer is not delivered
    assert _next_ack(board) == Frame(KIND_ACK, 0, SESSION)
    assert _next_ack(board) == Frame(KIND_ACK, 0, SESSION)  # but acknowledged again
    assert host.counters.duplicates_received == 1


def test_duplicate_data_is_acked_again_but_delivered_once(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    board.send(KIND_DATA, 1, SESSION, b"once")
    board.send(KIND_DATA, 1, SESSION, b"once")
    assert host.receive(5) == b"once"
    with pytest.raises(LinkTimeoutError, match="no message from the board"):
        host.receive(0.2)
    assert [board.next_frame(), board.next_frame()] == [Frame(KIND_ACK, 1, SESSION)] * 2
    assert host.counters.duplicates_received == 1


def test_out_of_sequence_and_session_zero_data_is_dropped_unacknowledged(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    board.send(KIND_DATA, 5, SESSION, b"ahead")
    board.send(KIND_DATA, 1, 0, b"no session")
    board.send(KIND_ACK, 1, SESSION)  # acknowledges nothing we sent
    with pytest.raises(LinkTimeoutError):
        host.receive(0.2)
    assert board.silent_for(0.1)
    assert host.counters.frames_ignored == 3
    board.send(KIND_DATA, 1, SESSION, b"in order")
    time.sleep(0.1)
    assert host.receive(0) == b"in order"  # a zero timeout still reads what has arrived


def test_the_sender_resends_until_acked(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    sent = pool.submit(host.send, b"again")
    copies = [board.next_frame() for _ in range(3)]
    assert copies == [Frame(KIND_DATA, 1, SESSION, b"again")] * 3
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)
    assert host.counters.frames_retransmitted >= 2
    assert host.counters.payload_bytes_sent == len(b"hello") + len(b"again")  # resends are not payload


def test_data_arriving_while_waiting_for_an_ack_is_acked_and_queued(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    sent = pool.submit(host.send, b"question")
    assert board.next_frame() == Frame(KIND_DATA, 1, SESSION, b"question")
    board.send(KIND_DATA, 1, SESSION, b"early answer")  # as if our ACK of the question had been lost
    assert _next_ack(board) == Frame(KIND_ACK, 1, SESSION)
    assert not sent.done()
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)
    assert host.receive(0) == b"early answer"


def test_sequence_numbers_wrap_at_65536(pool, host_and_board):
    host, board = host_and_board
    opened = pool.submit(host.open, b"hello")
    assert board.receive(5) == b"hello" and board.received_hello
    board.send(b"info")
    assert opened.result(timeout=5) == b"info"
    host._tx_seq = board._rx_expected = 0xFFFF  # 65535 messages later
    board._tx_seq = host._rx_expected = 0xFFFE
    for index in range(3):
        sent = pool.submit(host.send, b"up %d" % index)
        assert board.receive(5) == b"up %d" % index
        sent.result(timeout=5)
        sent = pool.submit(board.send, b"down %d" % index)
        assert host.receive(5) == b"down %d" % index
        sent.result(timeout=5)
    assert (host._tx_seq, board._tx_seq) == (2, 1)


def test_host_and_board_send_at_once_and_each_gets_everything_in_order(pool, host_and_board):
    host, board = host_and_board
    opened = pool.submit(host.open, b"hello")
    assert board.receive(5) == b"hello"
    board.send(b"info")
    assert opened.result(timeout=5) == b"info"
    up = [bytes([i]) * (1 + 97 * i) for i in range(30)]
    down = [bytes([255 - i]) * (4096 - 101 * i) for i in range(30)]

    def send_then_receive(link, messages, count):
        for message in messages:
            link.send(message)
        return [link.receive(10) for _ in range(count)]  # a side that stops reading stops acknowledging

    host_got = pool.submit(send_then_receive, host, up, len(down))
    board_got = pool.submit(send_then_receive, board, down, len(up))
    assert board_got.result(timeout=60) == up
    assert host_got.result(timeout=60) == down
    assert host.counters.payload_bytes_received == len(b"info") + sum(map(len, down))
    assert board.counters.payload_bytes_received == len(b"hello") + sum(map(len, up))


def test_a_rebooted_board_is_reported_and_a_new_open_recovers(pool, host_and_board):
    host, board = host_and_board
    opened = pool.submit(host.open, b"hello")
    board.receive(5)
    board.send(b"info")
    opened.result(timeout=5)
    board.reboot(session_id=SESSION + 1)
    answered = pool.submit(board.receive, 5)
    with pytest.raises(BoardResetError, match="rebooted; call open"):
        host.send(b"into the void")  # the new boot ACKs it in its own session
    opened = pool.submit(host.open, b"hello again")
    assert answered.result(timeout=5) == b"hello again" and board.received_hello
    board.send(b"info 2")
    assert opened.result(timeout=5) == b"info 2"
    assert host.session_id == SESSION + 1


def test_any_frame_of_another_session_after_open_raises_board_reset(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    board.send(KIND_DATA, 1, SESSION ^ 0xFF, b"new boot")
    with pytest.raises(BoardResetError, match=f"{SESSION ^ 0xFF:#010x}"):
        host.receive(5)


def test_the_board_acks_a_hello_resets_its_sequence_and_aborts_a_pending_send(pool, board_and_raw_host):
    board, host = board_and_raw_host
    host.send(KIND_DATA, 0, 0, b"hello")
    assert board.receive(5) == b"hello" and board.received_hello
    assert host.next_frame() == Frame(KIND_ACK, 0, SESSION)
    sending = pool.submit(board.send, b"info")
    assert host.next_frame() == Frame(KIND_DATA, 0, SESSION, b"info")
    host.send(KIND_DATA, 0, 0, b"hello, again")  # the host started over before acknowledging
    with pytest.raises(HostReopenedError):
        sending.result(timeout=5)
    while (frame := host.next_frame()).kind != KIND_ACK:
        pass
    assert frame == Frame(KIND_ACK, 0, SESSION)
    assert board.receive(5) == b"hello, again" and board.received_hello
    sending = pool.submit(board.send, b"info")
    while (frame := host.next_frame()) != Frame(KIND_DATA, 0, SESSION, b"info"):
        pass
    host.send(KIND_ACK, 0, SESSION)
    sending.result(timeout=5)
    host.send(KIND_DATA, 1, SESSION, b"job")
    assert board.receive(5) == b"job" and not board.received_hello


def test_the_board_answers_an_old_session_with_its_own(board_and_raw_host):
    board, host = board_and_raw_host
    host.send(KIND_DATA, 7, SESSION + 1, b"from before the reboot")
    with pytest.raises(LinkTimeoutError):
        board.receive(0.2)
    assert host.next_frame() == Frame(KIND_ACK, 7, SESSION)


def test_send_gives_up_naming_the_port_and_what_to_check(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    host.max_retries, host.ack_timeout_s = 3, 0.02
    with pytest.raises(LinkTimeoutError, match=r"no ACK from the board on socket://127\.0\.0\.1:\d+ for DATA seq 1 "
                                               r"after 4 transmissions.*powered"):
        host.send(b"nobody listens")
    assert host.counters.frames_retransmitted == 3


def test_open_over_a_loopback_times_out_on_its_own_echo():
    """loop:// returns what is written: the host reads its own session-0 hellos and must not take them."""
    with Link.connect("loop://", ack_timeout_s=0.02, max_retries=2) as host:
        with pytest.raises(LinkTimeoutError, match=r"loop://.*hello \(DATA seq 0, session 0\) after 3"):
            host.open(b"hello")
        counters = host.counters
    assert (counters.frames_sent, counters.frames_retransmitted) == (3, 2)
    assert counters.frames_received == counters.frames_ignored == 3
    assert host.session_id is None


def test_payload_limit_unopened_link_refused_port_and_closed_peer(pool, host_and_raw_board):
    host, board = host_and_raw_board
    with pytest.raises(LinkError, match=r"call open\(hello\) first"):
        host.send(b"x")
    with pytest.raises(ValueError, match="MAX_PAYLOAD_BYTES=4096"):
        host.open(bytes(MAX_PAYLOAD_BYTES + 1))
    _open(pool, host, board)
    with pytest.raises(ValueError, match="MAX_PAYLOAD_BYTES=4096"):
        host.send(bytes(MAX_PAYLOAD_BYTES + 1))
    board.sock.close()
    with pytest.raises(LinkClosedError, match="reading from socket://"):
        host.receive(5)
    with _listener() as listener:
        port = listener.getsockname()[1]
    with pytest.raises(LinkClosedError, match=f"cannot open the serial line socket://127.0.0.1:{port}"):
        Link.connect(f"socket://127.0.0.1:{port}")
