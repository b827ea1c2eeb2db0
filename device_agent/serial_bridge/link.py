"""Reliable messages over a serial line: stop-and-wait ARQ with board sessions on framing.py's frames.

``Link`` is the host's end; ``BoardLink`` plays the board's end by the firmware's rules (tests, simulated boards).
"""
from __future__ import annotations

import contextlib
import io
import os
import secrets
import select
import socket
import time
from collections import deque
from dataclasses import dataclass

import serial

from device_agent.serial_bridge.framing import (
    KIND_ACK,
    KIND_DATA,
    MAX_PAYLOAD_BYTES,
    SEQ_MODULO,
    Frame,
    FrameDecoder,
    encode_frame,
)

__all__ = [
    "DEFAULT_ACK_TIMEOUT_S", "DEFAULT_BAUDRATE", "DEFAULT_MAX_RETRIES", "BoardLink", "BoardResetError",
    "HostReopenedError", "Link", "LinkClosedError", "LinkCounters", "LinkError", "LinkTimeoutError",
]

DEFAULT_ACK_TIMEOUT_S = 0.3
DEFAULT_MAX_RETRIES = 40
DEFAULT_BAUDRATE = 115200
DEFAULT_POLL_S = 0.02  # how long one read may block on a port that cannot be waited on with select
_READ_CHUNK_BYTES = 65536


class LinkError(Exception):
    """The serial link failed; the message says where and what to check."""


class LinkTimeoutError(LinkError, TimeoutError):
    """The peer did not acknowledge, or sent nothing, in time."""


class LinkClosedError(LinkError):
    """The serial port or socket under the link failed or was closed."""


class BoardResetError(LinkError):
    """The board sent a session id other than the one learned at open(): it rebooted; open() again."""


class HostReopenedError(LinkError):
    """(Board side) a hello arrived while a send waited for its ACK: the host started over; receive() it."""


@dataclass(frozen=True)
class LinkCounters:
    """A snapshot of one link's traffic; ``frames_sent`` counts every frame written, ACKs and resends included."""

    frames_sent: int = 0
    frames_retransmitted: int = 0
    crc_errors: int = 0  # frames dropped for a bad CRC
    frames_dropped: int = 0  # other malformed frames: short, long, unknown kind, aborted
    bytes_written: int = 0
    bytes_read: int = 0
    payload_bytes_sent: int = 0  # each delivered message once, resends not counted
    payload_bytes_received: int = 0
    frames_received: int = 0  # well-formed frames
    duplicates_received: int = 0  # DATA received again because our ACK was lost (ACKed, not delivered)
    frames_ignored: int = 0  # well-formed but out of sequence, a stale ACK, or another session's


class _Endpoint:
    """The ARQ both sides share; subclasses decide which frames belong to the session and what a hello does."""

    peer = "peer"

    def __init__(self, port, *, ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
                 max_retries: int = DEFAULT_MAX_RETRIES, name: str | None = None,
                 poll_s: float = DEFAULT_POLL_S) -> None:
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s must be positive, not {ack_timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, not {max_retries}")
        self.port = port
        self.ack_timeout_s = float(ack_timeout_s)
        self.max_retries = int(max_retries)
        self.name = name or str(getattr(port, "port", None) or getattr(port, "name", None) or port)
        self._decoder = FrameDecoder()
        self._fileno = _fileno(port)
        # With a descriptor, select() does the waiting and reads must not block; without one, reads block
        # for at most poll_s so a deadline is never overshot by much.
        port.timeout = 0 if self._fileno is not None else poll_s
        self._tx_seq = 0
        self._rx_expected = 0
        self._incoming: deque[bytes] = deque()
        self._awaiting: int | None = None  # the seq of our DATA waiting for its ACK
        self._acked = False
        self._closed = False
        self._counts = dict.fromkeys(
            ("frames_sent", "frames_retransmitted", "bytes_written", "bytes_read", "payload_bytes_sent",
             "payload_bytes_received", "frames_received", "duplicates_received", "frames_ignored"), 0)

    # -- public -----------------------------------------------------------------------------------------------

    @property
    def counters(self) -> LinkCounters:
        """The traffic so far (a snapshot)."""
        return LinkCounters(crc_errors=self._decoder.crc_errors, frames_dropped=self._decoder.frames_dropped,
                            **self._counts)

    def send(self, payload: bytes) -> None:
        """Send one message and block until the peer acknowledges it; LinkTimeoutError after max_retries resends."""
        _check_size(payload)
        self._check_ready()
        seq = self._tx_seq
        self._transmit(encode_frame(KIND_DATA, seq, self._tx_session(), payload), seq)
        self._tx_seq = (seq + 1) % SEQ_MODULO
        self._counts["payload_bytes_sent"] += len(payload)

    def receive(self, timeout_s: float = 10.0) -> bytes:
        """The next message from the peer, waiting up to ``timeout_s``; LinkTimeoutError if none arrives."""
        self._check_ready()
        deadline = time.monotonic() + timeout_s
        polled = False  # receive(0) still reads what has already arrived
        while not self._incoming:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 and polled:
                raise LinkTimeoutError(
                    f"no message from the {self.peer} on {self.name} within {timeout_s:g} s: check that the "
                    f"{self.peer} is running and connected to {self.name}, and that it had something to send")
            self._pump(max(0.0, remaining_s))
            polled = True
        return self._incoming.popleft()

    def close(self) -> None:
        """Close the port under the link (idempotent)."""
        if not self._closed:
            self._closed = True
            self.port.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the ARQ ----------------------------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._closed:
            raise LinkClosedError(f"the link on {self.name} is closed")

    def _tx_session(self) -> int:
        raise NotImplementedError

    def _accept(self, frame: Frame) -> bool:
        """Whether ``frame`` belongs to this session (it may raise, or handle the frame itself and say False)."""
        raise NotImplementedError

    def _transmit(self, frame: bytes, seq: int, *, what: str | None = None) -> None:
        """Write ``frame`` until ACK(seq) arrives, processing everything else that comes in meanwhile."""
        started = time.monotonic()
        self._awaiting, self._acked = seq, False
        try:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    self._counts["frames_retransmitted"] += 1
                self._write(frame)
                deadline = time.monotonic() + self.ack_timeout_s
                while not self._acked:
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        break
                    self._pump(remaining_s)
                    self._after_pump()
                if self._acked:
                    return
        finally:
            self._awaiting = None
        raise LinkTimeoutError(
            f"no ACK from the {self.peer} on {self.name} for {what or f'DATA seq {seq}'} after {self.max_retries + 1} "
            f"transmissions over {time.monotonic() - started:.1f} s: check that the {self.peer} is powered and "
            f"running its firmware, that {self.name} is its serial line (and the baud rate matches), that no other "
            "program holds the port, and whether the board rebooted")

    def _after_pump(self) -> None:
        """Hook run after each batch of frames while a send waits (the board side aborts on a hello)."""

    def _pump(self, wait_s: float) -> None:
        """Read what arrives within ``wait_s`` (returns early on data) and process its frames."""
        data = self._read(wait_s)
        if not data:
            return
        self._counts["bytes_read"] += len(data)
        for frame in self._decoder.feed(data):
            self._counts["frames_received"] += 1
            self._process(frame)

    def _process(self, frame: Frame) -> None:
        if not self._accept(frame):
            self._counts["frames_ignored"] += 1
            return
        if frame.kind == KIND_ACK:
            if self._awaiting is not None and frame.seq == self._awaiting:
                self._acked = True
            else:
                self._counts["frames_ignored"] += 1  # a second ACK for a resend, or a stale one
            return
        if frame.seq == self._rx_expected:
            self._deliver(frame.payload)
            self._rx_expected = (self._rx_expected + 1) % SEQ_MODULO
            self._write_ack(frame.seq)
        elif frame.seq == (self._rx_expected - 1) % SEQ_MODULO:
            self._counts["duplicates_received"] += 1  # the peer did not get our ACK: repeat it
            self._write_ack(frame.seq)
        else:
            self._counts["frames_ignored"] += 1

    def _deliver(self, payload: bytes) -> None:
        self._incoming.append(payload)
        self._counts["payload_bytes_received"] += len(payload)

    def _write_ack(self, seq: int) -> None:
        self._write(encode_frame(KIND_ACK, seq, self._tx_session()))

    # -- the port ---------------------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        try:
            self.port.write(data)
            flush = getattr(self.port, "flush", None)
            if flush is not None:
                flush()  # a UART: the ACK timer starts once the frame has left, not when it was queued
        except (serial.SerialException, OSError, ValueError) as error:
            raise LinkClosedError(f"writing to {self.name} failed: {error}") from error
        self._counts["frames_sent"] += 1
        self._counts["bytes_written"] += len(data)

    def _read(self, wait_s: float) -> bytes:
        try:
            if self._fileno is not None:
                ready, _, _ = select.select([self._fileno], [], [], max(0.0, wait_s))
                return self.port.read(_READ_CHUNK_BYTES) if ready else b""
            data = self.port.read(1)
            waiting = getattr(self.port, "in_waiting", 0)
            return data + self.port.read(waiting) if data and waiting else data
        except (serial.SerialException, OSError, ValueError) as error:
            raise LinkClosedError(f"reading from {self.name} failed: {error}") from error


class Link(_Endpoint):
    """The host's end of the link to a board; ``open(hello)`` starts a session, then send() and receive()."""

    peer = "board"

    def __init__(self, port, **options) -> None:
        super().__init__(port, **options)
        self.session_id: int | None = None  # the board's, learned by open()
        self._opening = False

    @classmethod
    def connect(cls, url: str, *, baudrate: int = DEFAULT_BAUDRATE, **options) -> Link:
        """A Link over ``url``: a device (``/dev/ttyACM0``), ``socket://127.0.0.1:PORT`` (QEMU) or ``loop://``."""
        try:
            port = serial.serial_for_url(url, baudrate=baudrate, timeout=0)
        except (serial.SerialException, OSError, ValueError) as error:
            raise LinkClosedError(f"cannot open the serial line {url}: {error}; check the device path or that "
                                  "the emulator is listening on that port") from error
        if url.startswith("socket://"):
            _no_delay(port)
        return cls(port, name=url, **options)

    def open(self, hello_payload: bytes, *, timeout_s: float = 10.0) -> bytes:
        """Start a session: send the hello (seq 0, session 0), learn the board's session id, return its one reply.

        ``timeout_s`` bounds the wait for that reply once the hello is acknowledged."""
        _check_size(hello_payload)
        super()._check_ready()  # closed or not; a session is what this makes
        self.session_id = None
        self._tx_seq, self._rx_expected = 0, 0
        self._incoming.clear()
        self._opening = True
        try:
            self._transmit(encode_frame(KIND_DATA, 0, 0, hello_payload), 0, what="the hello (DATA seq 0, session 0)")
        finally:
            self._opening = False
        self._tx_seq = 1
        self._counts["payload_bytes_sent"] += len(hello_payload)
        return self.receive(timeout_s)

    def _check_ready(self) -> None:
        super()._check_ready()
        if self.session_id is None and not self._opening:
            raise LinkError(f"the link on {self.name} has no session: call open(hello) first")

    def _tx_session(self) -> int:
        return self.session_id or 0

    def _accept(self, frame: Frame) -> bool:
        if frame.session_id == 0:
            return False  # the board never sends session 0: not ours
        if self.session_id is None:
            # only the hello's ACK or the board's first message (seq 0) tell us the session
            if not (self._opening and frame.seq == 0):
                return False
            self.session_id = frame.session_id
            if frame.kind == KIND_DATA and self._awaiting == 0:
                self._acked = True  # its answer implies the hello arrived (only the ACK was lost)
            return True
        if frame.session_id != self.session_id:
            raise BoardResetError(
                f"the board on {self.name} now sends session {frame.session_id:#010x} instead of "
                f"{self.session_id:#010x}: it rebooted; call open() again and restart the job")
        return True


class BoardLink(_Endpoint):
    """The board's end: a hello (DATA, session 0) resets its seqs, is ACKed and delivered, and aborts a pending send.

    DATA of another nonzero session (a host still on an earlier boot) is ACKed in ours, so the host sees the reboot."""

    peer = "host"

    def __init__(self, port, *, session_id: int | None = None, **options) -> None:
        super().__init__(port, **options)
        self.session_id = session_id if session_id is not None else _new_session_id()
        if not 0 < self.session_id < 1 << 32:
            raise ValueError(f"a board's session id is a nonzero u32, not {self.session_id}")
        self._rx_expected = 1
        self._hellos: deque[bool] = deque()  # parallel to _incoming: which messages were hellos
        self._reopened = False
        self.received_hello = False

    def reboot(self, session_id: int | None = None) -> None:
        """Forget everything as a power cycle would, and draw a new session id."""
        self.session_id = session_id if session_id is not None else _new_session_id()
        self._tx_seq, self._rx_expected = 0, 1
        self._incoming.clear()
        self._hellos.clear()
        self._decoder = FrameDecoder()

    def receive(self, timeout_s: float = 10.0) -> bytes:
        """The next message; ``received_hello`` says whether it was a hello (answer it with one message)."""
        payload = super().receive(timeout_s)
        self.received_hello = self._hellos.popleft()
        return payload

    def send(self, payload: bytes) -> None:
        self._reopened = False
        super().send(payload)

    def _deliver(self, payload: bytes) -> None:
        super()._deliver(payload)
        self._hellos.append(False)

    def _tx_session(self) -> int:
        return self.session_id

    def _accept(self, frame: Frame) -> bool:
        if frame.session_id == self.session_id:
            return True
        if frame.kind == KIND_DATA and frame.session_id == 0:
            self._incoming.clear()
            self._hellos.clear()
            self._rx_expected, self._tx_seq = 1, 0
            self._incoming.append(frame.payload)
            self._hellos.append(True)
            self._counts["payload_bytes_received"] += len(frame.payload)
            self._write_ack(frame.seq)
            if self._awaiting is not None:
                self._reopened = True
            return False
        if frame.kind == KIND_DATA:
            self._write_ack(frame.seq)  # a host still on an earlier boot's session: show it ours
        return False

    def _process(self, frame: Frame) -> None:
        if frame.kind == KIND_DATA and frame.session_id == 0:
            self._accept(frame)  # a hello is handled, not ignored
            return
        super()._process(frame)

    def _after_pump(self) -> None:
        if self._reopened:
            self._reopened = False
            raise HostReopenedError(f"the host on {self.name} sent a new hello while a message waited for its ACK")


def _new_session_id() -> int:
    return secrets.randbelow((1 << 32) - 1) + 1


def _check_size(payload: bytes) -> None:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"a message of {len(payload)} bytes exceeds the link's limit of MAX_PAYLOAD_BYTES="
                         f"{MAX_PAYLOAD_BYTES} bytes; split it into several messages")


def _no_delay(port) -> None:
    """Turn off Nagle's algorithm on a socket:// port: a small frame held back for a delayed TCP ACK costs 40 ms."""
    with contextlib.suppress(OSError, ValueError), socket.socket(fileno=os.dup(port.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _fileno(port) -> int | None:
    """The port's descriptor if select() can wait on it (serial devices, socket://), else None (loop://)."""
    try:
        fileno = port.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    return fileno if isinstance(fileno, int) and fileno >= 0 else None
