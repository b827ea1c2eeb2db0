"""The link's ARQ and sessions over real loopback sockets: a hand-driven peer checks each rule frame by frame,
and a host Link talks to a BoardLink both ways at once; messages in fragments, also through FaultProxy."""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from device_agent.serial_bridge.framing import (
    FLAG_MORE,
    KIND_ACK,
    KIND_DATA,
    MAX_PAYLOAD_BYTES,
    Frame,
    FrameDecoder,
    encode_frame,
)
from device_agent.serial_bridge.link import (
    BACKOFF_MAX_FACTOR,
    DEFAULT_ACK_TIMEOUT_S,
    MIN_FRAGMENT_BYTES,
    BoardLink,
    BoardResetError,
    HostReopenedError,
    Link,
    LinkClosedError,
    LinkError,
    LinkTimeoutError,
    ack_timeout_s_for,
    fragment_bytes_for,
)
from device_agent.serial_bridge.proxy import FaultProxy

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

    def send(self, kind: int, seq: int, session: int, payload: bytes = b"", flags: int = 0) -> None:
        self.sock.sendall(encode_frame(kind, seq, session, payload, flags))

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


def _copy_times(board: RawPeer, seq: int, count: int, resend_reply: bool) -> list[float]:
    """When the host's first ``count`` copies of DATA ``seq`` arrive; with ``resend_reply`` the board sends its last
    reply again after each (alive, as a board behind a busy line is, but not acknowledging)."""
    arrived = []
    while len(arrived) < count:
        frame = board.next_frame()
        if frame.kind == KIND_DATA and frame.seq == seq:
            arrived.append(time.monotonic())
            if resend_reply:
                board.send(KIND_DATA, 0, SESSION, b"board info")
    return arrived


def test_a_peer_that_is_heard_but_does_not_acknowledge_gets_longer_waits_and_a_silent_one_does_not():
    """A board whose line is congested goes on resending its own frames while ours queue behind them: each copy of
    ours resent at the first wait adds to the queue (an emulated board on a loaded machine stopped acknowledging so).
    Heard from during a wait, the host doubles it, up to BACKOFF_MAX_FACTOR times the first; a silent board keeps the
    first wait, so a dead one is found out as fast as before."""
    with _listener() as listener:
        host = Link.connect(f"socket://127.0.0.1:{listener.getsockname()[1]}", ack_timeout_s=0.1, max_retries=100)
        conn, _ = listener.accept()
    board = RawPeer(conn)
    with ThreadPoolExecutor(max_workers=1) as pool, contextlib.closing(host), contextlib.closing(conn):
        _open(pool, host, board)
        sent = pool.submit(host.send, b"busy")
        busy = _copy_times(board, 1, 6, resend_reply=True)
        board.send(KIND_ACK, 1, SESSION)
        sent.result(timeout=10)
        sent = pool.submit(host.send, b"quiet")
        quiet = _copy_times(board, 2, 6, resend_reply=False)
        board.send(KIND_ACK, 2, SESSION)
        sent.result(timeout=10)
    busy_waits = [later - earlier for earlier, later in zip(busy, busy[1:], strict=False)]
    quiet_waits = [later - earlier for earlier, later in zip(quiet, quiet[1:], strict=False)]
    assert max(quiet_waits) < 0.3, quiet_waits  # 0.1 s each
    assert busy_waits[0] < 0.3 and busy_waits[1] > 0.15, busy_waits  # 0.1, then 0.2, 0.4, 0.8, 0.8
    assert busy_waits[-1] > 0.6 and max(busy_waits) < 0.1 * BACKOFF_MAX_FACTOR + 0.3, busy_waits


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


# ------------------------------------------------------------------------------------------------ fragmentation
def _fragments(peer: RawPeer, count: int, session: int = SESSION, ack: bool = True) -> list[Frame]:
    """The next ``count`` DATA frames (skipping resends of one already seen), each ACKed when ``ack``."""
    frames: list[Frame] = []
    while len(frames) < count:
        frame = peer.next_frame()
        if frame.kind != KIND_DATA or (frames and frame.seq == frames[-1].seq):
            continue
        frames.append(frame)
        if ack:
            peer.send(KIND_ACK, frame.seq, session)
    return frames


def test_a_message_goes_as_fragments_with_more_on_all_but_the_last(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    host.fragment_bytes = 16
    message = bytes(range(40))
    sent = pool.submit(host.send, message)
    first = board.next_frame()
    assert first == Frame(KIND_DATA, 1, SESSION, message[:16], FLAG_MORE)
    assert board.next_frame() == first  # stop-and-wait per fragment: unACKed, the same fragment goes again
    board.send(KIND_ACK, 1, SESSION)
    rest = _fragments(board, 2)
    sent.result(timeout=5)
    assert rest == [Frame(KIND_DATA, 2, SESSION, message[16:32], FLAG_MORE), Frame(KIND_DATA, 3, SESSION, message[32:])]
    counters = host.counters
    assert (counters.messages_sent, counters.fragments_sent) == (2, 4)  # the hello, then 3 fragments
    assert counters.payload_bytes_sent == len(b"hello") + 40
    for size, count in ((16, 1), (17, 2), (0, 1)):  # exactly one fragment; one byte over; empty
        sent = pool.submit(host.send, bytes(size))
        frames = _fragments(board, count)
        sent.result(timeout=5)
        assert [f.flags for f in frames] == [FLAG_MORE] * (count - 1) + [0]
        assert b"".join(f.payload for f in frames) == bytes(size)


def test_the_host_reassembles_fragments_and_delivers_whole_messages_once(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    board.send(KIND_DATA, 1, SESSION, b"frag", FLAG_MORE)
    board.send(KIND_DATA, 1, SESSION, b"frag", FLAG_MORE)  # its ACK was lost: not added twice
    board.send(KIND_DATA, 3, SESSION, b"!")  # seq 2 was lost: dropped
    with pytest.raises(LinkTimeoutError):
        host.receive(0.2)  # nothing whole yet
    assert [board.next_frame() for _ in range(2)] == [Frame(KIND_ACK, 1, SESSION)] * 2
    board.send(KIND_DATA, 2, SESSION, b"ment", FLAG_MORE)
    board.send(KIND_DATA, 3, SESSION, b"ed")
    assert host.receive(5) == b"fragmented"
    assert [board.next_frame() for _ in range(2)] == [Frame(KIND_ACK, 2, SESSION), Frame(KIND_ACK, 3, SESSION)]
    counters = host.counters
    assert (counters.messages_received, counters.fragments_received, counters.duplicates_received) == (2, 4, 1)
    assert counters.payload_bytes_received == len(b"board info") + len(b"fragmented")


def test_a_message_over_4096_bytes_in_fragments_is_dropped_and_counted(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    board.send(KIND_DATA, 1, SESSION, bytes(4000), FLAG_MORE)
    board.send(KIND_DATA, 2, SESSION, bytes(97), FLAG_MORE)  # 4097 in all
    board.send(KIND_DATA, 3, SESSION, b"tail")
    board.send(KIND_DATA, 4, SESSION, bytes(4000), FLAG_MORE)
    board.send(KIND_DATA, 5, SESSION, b"\x01" * 96)  # exactly 4096
    assert host.receive(5) == bytes(4000) + b"\x01" * 96
    assert [board.next_frame().seq for _ in range(5)] == [1, 2, 3, 4, 5]  # every fragment ACKed
    assert host.counters.reassembly_overflows == 1
    assert host.counters.messages_received == 2


def test_the_board_side_fragments_and_a_hello_drops_a_partial_message(pool, board_and_raw_host):
    board, host = board_and_raw_host
    board.fragment_bytes = 3
    host.send(KIND_DATA, 0, 0, b"hello")
    assert board.receive(5) == b"hello" and board.received_hello
    assert host.next_frame() == Frame(KIND_ACK, 0, SESSION)
    sending = pool.submit(board.send, b"info!!!")
    frames = _fragments(host, 3)
    sending.result(timeout=5)
    assert frames == [Frame(KIND_DATA, 0, SESSION, b"inf", FLAG_MORE), Frame(KIND_DATA, 1, SESSION, b"o!!", FLAG_MORE),
                      Frame(KIND_DATA, 2, SESSION, b"!")]
    host.send(KIND_DATA, 1, SESSION, b"part", FLAG_MORE)
    host.send(KIND_DATA, 0, 0, b"hello again", FLAG_MORE)  # a hello, even flagged MORE, is one whole frame
    host.send(KIND_DATA, 1, SESSION, b"new")
    assert board.receive(5) == b"hello again" and board.received_hello
    assert board.receive(5) == b"new" and not board.received_hello  # not b"partnew"
    assert [host.next_frame() for _ in range(3)] == [Frame(KIND_ACK, 1, SESSION), Frame(KIND_ACK, 0, SESSION),
                                                     Frame(KIND_ACK, 1, SESSION)]


def test_host_and_board_link_fragment_both_ways(pool, host_and_board):
    host, board = host_and_board
    host.fragment_bytes, board.fragment_bytes = 100, 37
    opened = pool.submit(host.open, b"hello")
    assert board.receive(5) == b"hello"
    board.send(b"info" * 30)  # the reply to the hello, in 4 fragments
    assert opened.result(timeout=5) == b"info" * 30
    up = [bytes([i]) * size for i, size in enumerate((0, 1, 99, 100, 101, 4096))]
    down = [bytes([255 - i]) * size for i, size in enumerate((4096, 37, 38, 0, 2000))]
    for message in up:
        sent = pool.submit(host.send, message)
        assert board.receive(5) == message
        sent.result(timeout=5)
    for message in down:
        sent = pool.submit(board.send, message)
        assert host.receive(5) == message
        sent.result(timeout=5)
    assert host.counters.fragments_sent == 1 + sum(max(1, -(-len(m) // 100)) for m in up)
    assert board.counters.fragments_sent == 4 + sum(max(1, -(-len(m) // 37)) for m in down)
    assert board.counters.messages_received == 1 + len(up) and host.counters.messages_received == 1 + len(down)
    assert host.counters.frames_retransmitted == board.counters.frames_retransmitted == 0


def test_a_send_that_fails_after_some_fragments_ends_the_session(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    host.fragment_bytes, host.max_retries, host.ack_timeout_s = 4, 2, 0.02
    sent = pool.submit(host.send, b"half a message")
    assert _fragments(board, 1)[0] == Frame(KIND_DATA, 1, SESSION, b"half", FLAG_MORE)  # only the first is ACKed
    with pytest.raises(LinkTimeoutError, match=r"DATA seq 2 \(fragment 2 of 4\) after 3 transmissions"):
        sent.result(timeout=5)
    with pytest.raises(LinkError, match=r"call open\(hello\) first"):
        host.send(b"x")  # the board holds part of a message: only a hello puts both ends in step


def test_fragment_and_timeout_options_are_checked():
    with pytest.raises(ValueError, match=r"fragment_bytes must be an integer in 1..4096"):
        Link.connect("loop://", fragment_bytes=0)
    with pytest.raises(ValueError, match=r"fragment_bytes must be an integer in 1..4096, not 4097"):
        Link.connect("loop://", fragment_bytes=MAX_PAYLOAD_BYTES + 1)
    with Link.connect("loop://", fragment_bytes=47, ack_timeout_s=0.03) as link:
        assert link.fragment_bytes == 47
        assert link.max_retries == 400  # a short timeout retries as long as the default one (12 s)
    with Link.connect("loop://") as link:
        assert (link.fragment_bytes, link.ack_timeout_s, link.max_retries) == (4096, 0.3, 40)


# ------------------------------------------------------------------------------------------------ losses seen early
def test_a_damaged_frame_while_waiting_for_an_ack_sends_the_data_again_at_once(pool, host_and_raw_board):
    host, board = host_and_raw_board
    _open(pool, host, board)
    host.ack_timeout_s = 5.0  # a resend within the test's time comes from the damage, not the timeout
    sent = pool.submit(host.send, b"question")
    assert board.next_frame() == Frame(KIND_DATA, 1, SESSION, b"question")
    damaged = bytearray(encode_frame(KIND_ACK, 1, SESSION))
    damaged[5] ^= 0x01  # as if the line hit our ACK
    board.sock.sendall(bytes(damaged))
    assert board.next_frame(timeout_s=1) == Frame(KIND_DATA, 1, SESSION, b"question")
    board.send(KIND_ACK, 0, SESSION)  # the ACK before (repeated: "I did not get seq 1"): again at once
    assert board.next_frame(timeout_s=1) == Frame(KIND_DATA, 1, SESSION, b"question")
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)
    counters = host.counters
    assert counters.frames_retransmitted == counters.fast_retransmissions == 2
    assert counters.crc_errors == 1


def test_a_damaged_frame_while_receiving_repeats_the_last_ack_but_not_before_any_data(pool, board_and_raw_host):
    board, host = board_and_raw_host
    host.send(KIND_DATA, 0, 0, b"hello")
    assert board.receive(5) == b"hello"
    assert host.next_frame() == Frame(KIND_ACK, 0, SESSION)
    host.sock.sendall(b"\x7e\x01\x02\x7e")  # a frame cut short: nothing taken since the hello, nothing to repeat
    with pytest.raises(LinkTimeoutError):
        board.receive(0.2)
    assert host.silent_for(0.1) and board.counters.frames_dropped == 1
    host.send(KIND_DATA, 1, SESSION, b"one")
    assert board.receive(5) == b"one"
    assert host.next_frame() == Frame(KIND_ACK, 1, SESSION)
    damaged = bytearray(encode_frame(KIND_DATA, 2, SESSION, b"two"))
    damaged[9] ^= 0x01
    host.sock.sendall(bytes(damaged))
    with pytest.raises(LinkTimeoutError):
        board.receive(0.2)
    assert host.next_frame(timeout_s=1) == Frame(KIND_ACK, 1, SESSION)  # "still at seq 1": send seq 2 again
    assert board.counters.repeated_acks_sent == 1 and board.counters.crc_errors == 1


# ------------------------------------------------------------------------------------------------ a lossy line
def test_fragment_bytes_for_sizes_frames_to_survive_half_the_time():
    assert fragment_bytes_for(0.0) == MAX_PAYLOAD_BYTES
    assert fragment_bytes_for(0.01) == 47 and fragment_bytes_for(0.01, 0.0) == 53
    assert fragment_bytes_for(0.02) == MIN_FRAGMENT_BYTES == 16 and fragment_bytes_for(0.3) == 16
    for p in (0.0005, 0.001, 0.003, 0.01, 0.015):
        n = fragment_bytes_for(p)
        survive = (1 - (p / 10 + (1 - p / 10) * p)) ** ((n + 12) * 1.02 + 2)
        larger = (1 - (p / 10 + (1 - p / 10) * p)) ** ((n + 13) * 1.02 + 2)
        assert survive >= 0.5 > larger, (p, n)
    with pytest.raises(ValueError):
        fragment_bytes_for(1.0)
    assert 0.02 < ack_timeout_s_for(47) < 0.03  # tens of ms on a loopback
    assert ack_timeout_s_for(4096) > DEFAULT_ACK_TIMEOUT_S  # a 4 KB frame takes ~0.2 s into QEMU's UART


class _Echo:
    """The board's side over a lossy line: answers each hello with b"info", echoes everything else, until stopped."""

    def __init__(self, board: BoardLink) -> None:
        self.board, self.received, self.echoed, self.hellos, self.stop = board, [], 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                message = self.board.receive(0.05)  # receiving keeps acknowledging what the host resends
            except LinkTimeoutError:
                continue
            if self.board.received_hello:
                self.hellos += 1
            else:
                self.received.append(message)
            try:
                self.board.send(b"info" if self.board.received_hello else message)
            except HostReopenedError:
                continue
            self.echoed += not self.board.received_hello


@pytest.mark.parametrize("per_byte", [pytest.param(0.01, marks=pytest.mark.slow),  # 1%: ~4-10 s
                                      pytest.param(0.02, marks=pytest.mark.slow)])  # 2%: ~15-27 s
def test_multi_kb_messages_cross_1_and_2_percent_corrupted_bytes_in_fragments(per_byte):
    """With 4 KB frames nothing would arrive (0.99**4200 = 5e-19); in fragment_bytes_for(p) fragments every
    message does, once, in order, unchanged, both ways; ACK timeouts of tens of ms."""
    rng = random.Random(int(per_byte * 1000))
    payloads = [rng.randbytes(rng.randint(1000, MAX_PAYLOAD_BYTES)) for _ in range(8)] + [rng.randbytes(4096)]
    fragment = fragment_bytes_for(per_byte)
    options = {"fragment_bytes": fragment, "ack_timeout_s": ack_timeout_s_for(fragment)}
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            FaultProxy("127.0.0.1", listener.getsockname()[1], corrupt_probability=per_byte, seed=3) as proxy, \
            ThreadPoolExecutor(max_workers=1) as pool:
        host = Link.connect(f"socket://127.0.0.1:{proxy.port}", **options)
        conn, _ = listener.accept()
        board = BoardLink(SocketPort(conn), **options)
        echo = _Echo(board)
        with host, board:
            board_done = pool.submit(echo.run)
            try:
                assert host.open(b"hello", timeout_s=60) == b"info"
                echoes = []
                for payload in payloads:
                    host.send(payload)
                    echoes.append(host.receive(60))
                while echo.echoed < len(payloads) and not board_done.done():  # the last echo's ACK may be lost
                    with contextlib.suppress(LinkTimeoutError):
                        echoes.append(host.receive(0.05))
            finally:
                echo.stop.set()
            board_done.result(timeout=10)
    assert echo.received == payloads  # host -> board: once each, in order, unchanged
    assert echoes == payloads  # and back
    up, down = host.counters, board.counters
    total = sum(map(len, payloads))
    assert (up.messages_sent, up.payload_bytes_sent) == (len(payloads) + 1, len(b"hello") + total)
    assert (up.messages_received, up.payload_bytes_received) == (len(payloads) + 1, len(b"info") + total)
    # a hello whose ACK was lost is sent again: the board takes (and answers) each copy
    assert (down.messages_received, down.payload_bytes_received) == (len(payloads) + echo.hellos,
                                                                     len(b"hello") * echo.hellos + total)
    assert up.fragments_sent >= len(b"hello") // fragment + sum(-(-len(p) // fragment) for p in payloads)
    assert up.frames_retransmitted > 0 and down.frames_retransmitted > 0
    assert up.crc_errors > 0 and down.crc_errors > 0
    assert up.reassembly_overflows == down.reassembly_overflows == 0
    assert proxy.bytes_corrupted > 0 and proxy.bytes_dropped > 0


# ------------------------------------------------------------------------------------------------ a slow line
class _SlowLine:
    """Relays a loopback TCP connection at ``bytes_per_s`` each way, as QEMU's UART drains the host's socket: what
    the far end has not read yet waits in the socket buffers."""

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.target_port, self.bytes_per_s = self.listener.getsockname()[1], target_port, bytes_per_s
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target_port))
        self.sockets += [client, server]
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        chunk = 256
        with contextlib.suppress(OSError):
            while data := source.recv(chunk):
                time.sleep(len(data) / self.bytes_per_s)
                sink.sendall(data)

    def close(self) -> None:
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_4_kb_frames_on_a_line_slower_than_the_ack_timeout_are_sent_once():
    """A 4 KB frame takes 0.34 s to cross a 12 KB/s line, longer than the 0.3 s ACK timeout: the host waits for its
    ACK for twice the frame's time on the line (socket:// assumes LOOPBACK_BYTES_PER_S) instead of queueing a
    second copy behind the first. Without that, each spurious resend drew a second ACK that the next frame took
    for "not received", and the line filled with copies until the board gave up (a QEMU board under load)."""
    payloads = [bytes([n]) * MAX_PAYLOAD_BYTES for n in range(6)]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        line = _SlowLine(listener.getsockname()[1], bytes_per_s=12_000)
        host = Link.connect(f"socket://127.0.0.1:{line.port}")
        conn, _ = listener.accept()
        board = BoardLink(SocketPort(conn))  # answers at once: its small replies need no longer wait
        received: list[bytes] = []

        def serve() -> None:
            with contextlib.suppress(LinkError):
                while len(received) < len(payloads):
                    message = board.receive(30)
                    if not board.received_hello:
                        received.append(message)
                    board.send(b"ok")

        with host, board, ThreadPoolExecutor(max_workers=1) as pool:
            served = pool.submit(serve)
            try:
                assert host.open(b"hello") == b"ok"
                for payload in payloads:
                    host.send(payload)
                    assert host.receive(30) == b"ok"
                served.result(timeout=30)
            finally:
                line.close()
    assert received == payloads
    assert host.counters.frames_retransmitted == 0, host.counters
    assert board.counters.duplicates_received == 0, board.counters


def test_a_second_ack_of_a_resent_frame_does_not_resend_the_next_at_once(pool, host_and_raw_board):
    """The board ACKs each copy of a frame the host sent twice; the second ACK arrives while the host waits for the
    next frame's: it answers the copy, not "the next did not arrive", so the next frame waits for its timeout."""
    host, board = host_and_raw_board
    _open(pool, host, board)
    sent = pool.submit(host.send, b"first")
    assert board.next_frame() == Frame(KIND_DATA, 1, SESSION, b"first")
    assert board.next_frame(timeout_s=1) == Frame(KIND_DATA, 1, SESSION, b"first")  # the timeout's resend
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)
    host.ack_timeout_s = 5.0  # a resend within the test's time would be a fast one
    sent = pool.submit(host.send, b"second")
    assert board.next_frame() == Frame(KIND_DATA, 2, SESSION, b"second")
    board.send(KIND_ACK, 1, SESSION)  # the ACK of the second copy of seq 1
    assert board.silent_for(0.3), "the host sent seq 2 again on the ACK of a copy of seq 1"
    board.send(KIND_ACK, 2, SESSION)
    sent.result(timeout=5)
    assert host.counters.fast_retransmissions == 0


def test_the_ack_of_a_copy_sent_on_a_repeated_ack_does_not_resend_the_next(pool, host_and_raw_board):
    """A repeated ACK resends a frame at once; if the first copy had arrived after all, the peer ACKs both copies,
    and that second ACK, arriving while the next frame waits, must not resend the next frame too (a cascade)."""
    host, board = host_and_raw_board
    _open(pool, host, board)
    host.ack_timeout_s = 5.0  # every resend within the test's time is an early one
    sent = pool.submit(host.send, b"first")
    assert board.next_frame() == Frame(KIND_DATA, 1, SESSION, b"first")
    board.send(KIND_ACK, 0, SESSION)  # "seq 1 did not arrive": sent again at once
    assert board.next_frame(timeout_s=1) == Frame(KIND_DATA, 1, SESSION, b"first")
    board.send(KIND_ACK, 1, SESSION)
    sent.result(timeout=5)
    sent = pool.submit(host.send, b"second")
    assert board.next_frame() == Frame(KIND_DATA, 2, SESSION, b"second")
    board.send(KIND_ACK, 1, SESSION)  # the ACK of the second copy of seq 1
    assert board.silent_for(0.3), "the host sent seq 2 again on the ACK of a copy of seq 1"
    board.send(KIND_ACK, 2, SESSION)
    sent.result(timeout=5)
    assert host.counters.fast_retransmissions == 1
