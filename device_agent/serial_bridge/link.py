"""Reliable messages over a serial line: stop-and-wait ARQ with board sessions on framing.py's frames.

``Link`` is the host's end; ``BoardLink`` plays the board's end by the firmware's rules (tests, simulated boards).

A message of up to MAX_PAYLOAD_BYTES goes as consecutive DATA frames of at most ``fragment_bytes`` payload bytes
each, FLAG_MORE on all but the last; every fragment is its own ARQ unit (seq, ACK, resends) and the receiver
delivers whole messages only. A hello is always one frame. On a noisy line, small fragments get through where a
4 KB frame never would: ``fragment_bytes_for(p)`` sizes them for a per-byte fault probability ``p``, and
``ack_timeout_s_for`` gives an ACK timeout for a fragment size and a line speed.

A damaged frame (bad CRC, cut short, aborted) is a loss seen early, which both ends (and the firmware) act on
without waiting for the timeout: a sender waiting for an ACK sends its DATA again at once (the damaged frame
was most likely that ACK); an end that is not sending repeats the ACK of the last DATA it took in sequence,
which the sender, waiting for the ACK of the next seq, takes as "not received" and sends that DATA again at once.
Neither applies to the hello. The frames are the same; a peer without these rules ignores such an ACK as stale.

A frame waits for its ACK at least twice its time on the line (``line_bytes_per_s``, known for serial devices and
QEMU's socket), and a copy sent on a timeout or a repeated ACK draws an ACK of its own that is not taken as "not
received" for the next frame: a slow line never fills with copies of frames that were still crossing.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import secrets
import select
import socket
import time
from collections import deque
from dataclasses import dataclass

import serial

from device_agent.errors import UserError
from device_agent.serial_bridge.framing import (
    FLAG_MORE,
    FRAME_OVERHEAD_BYTES,
    KIND_ACK,
    KIND_DATA,
    MAX_PAYLOAD_BYTES,
    SEQ_MODULO,
    Frame,
    FrameDecoder,
    encode_frame,
)

__all__ = [
    "DEFAULT_ACK_TIMEOUT_S", "DEFAULT_BAUDRATE", "DEFAULT_GIVE_UP_S", "DEFAULT_MAX_RETRIES", "LOOPBACK_ACK_FLOOR_S",
    "LOOPBACK_BYTES_PER_S", "MIN_FRAGMENT_BYTES", "BoardLink", "BoardResetError", "HostReopenedError", "Link",
    "LinkClosedError", "LinkCounters", "LinkError", "LinkTimeoutError", "ack_timeout_s_for", "fragment_bytes_for",
]

DEFAULT_ACK_TIMEOUT_S = 0.3
DEFAULT_MAX_RETRIES = 40  # at least; with a shorter ACK timeout, as many as DEFAULT_GIVE_UP_S takes
DEFAULT_GIVE_UP_S = DEFAULT_MAX_RETRIES * DEFAULT_ACK_TIMEOUT_S
MIN_FRAGMENT_BYTES = 16  # fragment_bytes_for never goes below: 12 bytes of frame overhead per 16 of payload
ESCAPE_ALLOWANCE = 1.02  # a frame's body grows by about this much with escapes (2 byte values of 256: ~0.8%)
FRAGMENT_SURVIVAL = 0.5  # fragment_bytes_for: the share of whole frames that must get through
# A loopback socket (QEMU's UART, the fault proxy): the emulated board moves tens of KB/s and answers a frame it
# has read within a millisecond or two; the host's Python side as fast. The floor covers scheduling hiccups.
LOOPBACK_BYTES_PER_S = 20_000.0
LOOPBACK_ACK_FLOOR_S = 0.02
# A DATA that timed out while the peer was sending (its own resends, ACKs of copies) waits this many times longer
# before the next copy, up to BACKOFF_MAX_FACTOR times the first wait: the peer is alive but slow to drain the line.
# Resent at a fixed 0.3 s, 4 KB frames to an emulated board on a loaded machine (three busy processes on two cores)
# queued faster than the board read them: its ACKs for our earlier frames sat behind hundreds of kilobytes of copies,
# it gave up on its own reply, and stopped acknowledging (6 runs of 6 failed; tests/device_agent/firmware). A peer
# that sends nothing (dead, or given up) keeps the first wait, so it is found out as fast as before.
BACKOFF_FACTOR = 2.0
BACKOFF_MAX_FACTOR = 8.0
DEFAULT_BAUDRATE = 115200
UART_BITS_PER_BYTE = 10  # 8N1: a start bit, 8 data bits, a stop bit
DEFAULT_POLL_S = 0.02  # how long one read may block on a port that cannot be waited on with select
_READ_CHUNK_BYTES = 65536


class LinkError(UserError):
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
    messages_sent: int = 0  # acknowledged in full (the hello included)
    messages_received: int = 0  # delivered whole
    fragments_sent: int = 0  # DATA frames acknowledged (a message's fragments; resends not counted)
    fragments_received: int = 0  # DATA frames taken in sequence
    reassembly_overflows: int = 0  # messages dropped because their fragments added up to over MAX_PAYLOAD_BYTES
    fast_retransmissions: int = 0  # of frames_retransmitted: sent again on a damaged frame or repeated ACK, not a timeout
    repeated_acks_sent: int = 0  # ACKs of the last DATA taken, sent again because a damaged frame arrived


def fragment_bytes_for(corrupt_probability: float, drop_probability: float | None = None) -> int:
    """The largest fragment (payload bytes) whose whole frame survives a line that corrupts ``corrupt_probability``
    of the bytes and drops ``drop_probability`` (default: a tenth of it, as FaultProxy does) with probability at
    least FRAGMENT_SURVIVAL; MAX_PAYLOAD_BYTES on a clean line, never below MIN_FRAGMENT_BYTES.

    A frame of n payload bytes is about (12 + n) * ESCAPE_ALLOWANCE + 2 bytes on the wire: 47 at 1%, 16 at 2%."""
    for label, value in (("corrupt_probability", corrupt_probability), ("drop_probability", drop_probability)):
        if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
            raise ValueError(f"{label} is a per-byte probability in [0, 1), not {value!r}")
    if drop_probability is None:
        drop_probability = corrupt_probability / 10
    fault = drop_probability + (1.0 - drop_probability) * corrupt_probability
    if fault <= 0.0:
        return MAX_PAYLOAD_BYTES
    wire_bytes = math.log(FRAGMENT_SURVIVAL) / math.log1p(-fault)  # (1 - fault) ** wire_bytes == FRAGMENT_SURVIVAL
    payload = math.floor((wire_bytes - 2) / ESCAPE_ALLOWANCE) - (FRAME_OVERHEAD_BYTES - 2)
    return max(MIN_FRAGMENT_BYTES, min(MAX_PAYLOAD_BYTES, payload))


def ack_timeout_s_for(fragment_bytes: int = MAX_PAYLOAD_BYTES, *, bytes_per_s: float = LOOPBACK_BYTES_PER_S,
                      floor_s: float = LOOPBACK_ACK_FLOOR_S) -> float:
    """An ACK timeout for frames of ``fragment_bytes`` on a line moving ``bytes_per_s``: ``floor_s`` plus twice the
    frame's time on the line (it may queue behind a frame going the other way). Loopback defaults: 26 ms for
    47-byte fragments, 0.44 s for 4096 (QEMU's UART takes ~20 KB/s from the host)."""
    if fragment_bytes < 0 or bytes_per_s <= 0 or floor_s <= 0:
        raise ValueError(f"need fragment_bytes >= 0, bytes_per_s > 0 and floor_s > 0, not {fragment_bytes}, "
                         f"{bytes_per_s}, {floor_s}")
    wire_bytes = (fragment_bytes + FRAME_OVERHEAD_BYTES) * ESCAPE_ALLOWANCE
    return floor_s + 2 * wire_bytes / bytes_per_s


class _Endpoint:
    """The ARQ both sides share; subclasses decide which frames belong to the session and what a hello does."""

    peer = "peer"

    def __init__(self, port, *, ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
                 max_retries: int | None = None, name: str | None = None,
                 poll_s: float = DEFAULT_POLL_S, fragment_bytes: int = MAX_PAYLOAD_BYTES,
                 line_bytes_per_s: float | None = None) -> None:
        """``max_retries`` resends of a frame before LinkTimeoutError; by default DEFAULT_MAX_RETRIES, or as many
        as DEFAULT_GIVE_UP_S takes at ``ack_timeout_s``. ``fragment_bytes``: the most payload bytes one DATA frame
        this end sends carries (a public attribute: it may change between messages). ``line_bytes_per_s``: how fast
        the line moves bytes (None: instantly), which lengthens the wait of a large frame (ack_wait_s)."""
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s must be positive, not {ack_timeout_s}")
        if line_bytes_per_s is not None and not (isinstance(line_bytes_per_s, (int, float))
                                                 and 0 < line_bytes_per_s < math.inf):
            raise ValueError(f"line_bytes_per_s must be a positive number or None, not {line_bytes_per_s!r}")
        self.line_bytes_per_s = line_bytes_per_s
        if max_retries is None:
            max_retries = max(DEFAULT_MAX_RETRIES, math.ceil(DEFAULT_GIVE_UP_S / ack_timeout_s))
        if max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, not {max_retries}")
        self.port = port
        self.ack_timeout_s = float(ack_timeout_s)
        self.max_retries = int(max_retries)
        self.fragment_bytes = fragment_bytes  # checked by the property
        self.name = name or str(getattr(port, "port", None) or getattr(port, "name", None) or port)
        self._decoder = FrameDecoder()
        self._fileno = _fileno(port)
        # With a descriptor, select() does the waiting and reads must not block; without one, reads block
        # for at most poll_s so a deadline is never overshot by much.
        port.timeout = 0 if self._fileno is not None else poll_s
        self._tx_seq = 0
        self._rx_expected = 0
        self._incoming: deque[bytes] = deque()
        self._partial = bytearray()  # the fragments of the message coming in, so far
        self._discarding = False  # the message coming in overflowed: drop its fragments up to its last
        self._awaiting: int | None = None  # the seq of our DATA waiting for its ACK
        self._acked = False
        self._fast_resend = False  # whether the DATA awaiting its ACK may be sent again before its timeout
        self._resend_now = False  # a damaged frame or a repeated ACK says the peer did not get it
        self._took_data = False  # a DATA (not the hello) was taken in sequence in this session
        self._last_copies = 1  # the last DATA acknowledged: 1 + its resends on a timeout or a repeated ACK
        self._resend_on_repeat = False  # the resend due now answers a repeated ACK (not damage seen)
        self._copy_acks_due = 0  # while a DATA waits: repeated ACKs of the previous seq that answer its copies
        self._closed = False
        self._counts = dict.fromkeys(
            ("frames_sent", "frames_retransmitted", "bytes_written", "bytes_read", "payload_bytes_sent",
             "payload_bytes_received", "frames_received", "duplicates_received", "frames_ignored", "messages_sent",
             "messages_received", "fragments_sent", "fragments_received", "reassembly_overflows",
             "fast_retransmissions", "repeated_acks_sent"), 0)

    # -- public -----------------------------------------------------------------------------------------------

    @property
    def fragment_bytes(self) -> int:
        """The most payload bytes in one DATA frame this end sends (1..MAX_PAYLOAD_BYTES)."""
        return self._fragment_bytes

    @fragment_bytes.setter
    def fragment_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PAYLOAD_BYTES:
            raise ValueError(f"fragment_bytes must be an integer in 1..{MAX_PAYLOAD_BYTES}, not {value!r}")
        self._fragment_bytes = value

    @property
    def counters(self) -> LinkCounters:
        """The traffic so far (a snapshot)."""
        return LinkCounters(crc_errors=self._decoder.crc_errors, frames_dropped=self._decoder.frames_dropped,
                            **self._counts)

    def send(self, payload: bytes) -> None:
        """Send one message, as fragments of at most ``fragment_bytes``, and block until the peer acknowledges its
        last one; LinkTimeoutError after max_retries resends of a fragment."""
        _check_size(payload)
        self._check_ready()
        payload = bytes(payload)
        size = self.fragment_bytes
        starts = range(0, max(len(payload), 1), size)
        for index, start in enumerate(starts):
            seq = self._tx_seq
            last = index == len(starts) - 1
            frame = encode_frame(KIND_DATA, seq, self._tx_session(), payload[start:start + size],
                                 0 if last else FLAG_MORE)
            try:
                self._transmit(frame, seq, what=None if len(starts) == 1 else
                               f"DATA seq {seq} (fragment {index + 1} of {len(starts)})")
            except LinkError:
                if index:
                    self._abandon()
                raise
            self._tx_seq = (seq + 1) % SEQ_MODULO
            self._counts["fragments_sent"] += 1
        self._counts["payload_bytes_sent"] += len(payload)
        self._counts["messages_sent"] += 1

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

    def ack_wait_s(self, frame_bytes: int) -> float:
        """How long a frame of ``frame_bytes`` (on the wire) waits for its ACK before it goes again: ack_timeout_s,
        or on a line of known speed at least LOOPBACK_ACK_FLOOR_S plus twice its time on the line, so that a 4 KB
        frame on a slow line is not sent again while its first copy is still crossing."""
        if self.line_bytes_per_s is None:
            return self.ack_timeout_s
        return max(self.ack_timeout_s, LOOPBACK_ACK_FLOOR_S + 2 * frame_bytes / self.line_bytes_per_s)

    # -- the ARQ ----------------------------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._closed:
            raise LinkClosedError(f"the link on {self.name} is closed")

    def _tx_session(self) -> int:
        raise NotImplementedError

    def _accept(self, frame: Frame) -> bool:
        """Whether ``frame`` belongs to this session (it may raise, or handle the frame itself and say False)."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """A send failed after some of its fragments were taken: the peer holds part of a message."""

    def _reset_reassembly(self) -> None:
        self._partial.clear()
        self._discarding = False
        self._took_data = False

    def _may_repeat_ack(self) -> bool:
        """Whether a damaged frame may be answered with the ACK of the last DATA taken (a session is open)."""
        return self._took_data

    def _transmit(self, frame: bytes, seq: int, *, what: str | None = None, fast: bool = True) -> None:
        """Write ``frame`` until ACK(seq) arrives, processing everything else that comes in meanwhile.

        It goes again after each ack_wait_s and, when ``fast``, as soon as the peer shows it did not get it (a
        damaged frame; a repeated ACK of the previous seq beyond the ones that answer the copies of that frame
        sent on a timeout or a repeated ACK before its ACK came); LinkTimeoutError after max_retries timeouts (or max_retries such early resends)."""
        started = time.monotonic()
        self._awaiting, self._acked, self._fast_resend = seq, False, fast
        # A copy of the previous frame sent on a timeout or on a repeated ACK most likely arrived whole and drew
        # an ACK of its own: that many repeats of its ACK answer copies, not a loss of this frame (taken as a
        # loss, each would resend this frame too, and the next, a cascade). Copies sent on damage seen are not
        # counted: the damaged frame was as likely our DATA as its ACK.
        self._copy_acks_due = self._last_copies - 1
        first_wait_s = wait_s = self.ack_wait_s(len(frame))
        timeouts = early = on_repeat = 0
        try:
            while True:
                self._resend_now = self._resend_on_repeat = False
                self._write(frame)
                heard = self._counts["frames_received"]
                deadline = time.monotonic() + wait_s
                while not self._acked and not self._resend_now:
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        break
                    self._pump(remaining_s)
                    self._after_pump()
                if self._acked:
                    self._last_copies = 1 + timeouts + on_repeat
                    return
                if self._resend_now:
                    early += 1
                    on_repeat += self._resend_on_repeat
                    self._counts["fast_retransmissions"] += 1
                else:
                    timeouts += 1
                    if self._counts["frames_received"] > heard:  # alive, and the line busy: let it drain
                        wait_s = min(wait_s * BACKOFF_FACTOR, first_wait_s * BACKOFF_MAX_FACTOR)
                if max(timeouts, early) > self.max_retries:
                    break
                self._counts["frames_retransmitted"] += 1
        finally:
            self._awaiting = None
            self._fast_resend = self._resend_now = self._resend_on_repeat = False
        raise LinkTimeoutError(
            f"no ACK from the {self.peer} on {self.name} for {what or f'DATA seq {seq}'} after {timeouts + early} "
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
        damaged = self._decoder.crc_errors + self._decoder.frames_dropped
        for frame in self._decoder.feed(data):
            self._counts["frames_received"] += 1
            self._process(frame)
        if self._decoder.crc_errors + self._decoder.frames_dropped > damaged:
            self._on_damage()

    def _on_damage(self) -> None:
        """A damaged frame arrived: most likely the ACK we wait for, else the peer's DATA; say so at once."""
        if self._awaiting is not None:
            if self._fast_resend and not self._acked:
                self._resend_now = True
        elif self._may_repeat_ack():
            self._counts["repeated_acks_sent"] += 1
            self._write_ack((self._rx_expected - 1) % SEQ_MODULO)

    def _process(self, frame: Frame) -> None:
        if not self._accept(frame):
            self._counts["frames_ignored"] += 1
            return
        if frame.kind == KIND_ACK:
            if self._awaiting is not None and frame.seq == self._awaiting:
                self._acked = True
            elif (self._awaiting is not None and frame.seq == (self._awaiting - 1) % SEQ_MODULO
                  and self._fast_resend and self._copy_acks_due <= 0):
                self._resend_now = self._resend_on_repeat = True  # the peer repeats its last ACK: not arrived whole
            elif self._awaiting is not None and frame.seq == (self._awaiting - 1) % SEQ_MODULO:
                self._copy_acks_due -= 1  # the ACK of a copy of the previous frame
                self._counts["frames_ignored"] += 1
            else:
                self._counts["frames_ignored"] += 1  # a second ACK for a resend, or a stale one
            return
        if frame.seq == self._rx_expected:
            self._took_data = True
            self._reassemble(frame)
            self._rx_expected = (self._rx_expected + 1) % SEQ_MODULO
            self._write_ack(frame.seq)
        elif frame.seq == (self._rx_expected - 1) % SEQ_MODULO:
            self._counts["duplicates_received"] += 1  # the peer did not get our ACK: repeat it
            self._write_ack(frame.seq)
        else:
            self._counts["frames_ignored"] += 1

    def _reassemble(self, frame: Frame) -> None:
        """Take an in-sequence DATA fragment; deliver the message its last fragment completes."""
        self._counts["fragments_received"] += 1
        more = bool(frame.flags & FLAG_MORE)
        if self._discarding:
            self._discarding = more
            return
        if len(self._partial) + len(frame.payload) > MAX_PAYLOAD_BYTES:
            self._counts["reassembly_overflows"] += 1  # the peer broke the limit: drop the whole message
            self._partial.clear()
            self._discarding = more
            return
        if not more and not self._partial:
            self._deliver(frame.payload)
            return
        self._partial += frame.payload
        if not more:
            message = bytes(self._partial)
            self._partial.clear()
            self._deliver(message)

    def _deliver(self, payload: bytes) -> None:
        self._incoming.append(payload)
        self._counts["payload_bytes_received"] += len(payload)
        self._counts["messages_received"] += 1

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
            options.setdefault("line_bytes_per_s", LOOPBACK_BYTES_PER_S)
        elif not url.startswith("loop://"):
            options.setdefault("line_bytes_per_s", baudrate / UART_BITS_PER_BYTE)
        return cls(port, name=url, **options)

    def open(self, hello_payload: bytes, *, timeout_s: float = 10.0) -> bytes:
        """Start a session: send the hello (seq 0, session 0, always one frame), learn the board's session id,
        return its one reply (in as many fragments as the board sends).

        ``timeout_s`` bounds the wait for that reply once the hello is acknowledged."""
        _check_size(hello_payload)
        super()._check_ready()  # closed or not; a session is what this makes
        self.session_id = None
        self._tx_seq, self._rx_expected = 0, 0
        self._incoming.clear()
        self._reset_reassembly()
        self._opening = True
        try:
            self._transmit(encode_frame(KIND_DATA, 0, 0, hello_payload), 0, what="the hello (DATA seq 0, session 0)",
                           fast=False)
        finally:
            self._opening = False
        self._tx_seq = 1
        self._counts["payload_bytes_sent"] += len(hello_payload)
        self._counts["messages_sent"] += 1
        self._counts["fragments_sent"] += 1
        return self.receive(timeout_s)

    def _check_ready(self) -> None:
        super()._check_ready()
        if self.session_id is None and not self._opening:
            raise LinkError(f"the link on {self.name} has no session: call open(hello) first")

    def _tx_session(self) -> int:
        return self.session_id or 0

    def _abandon(self) -> None:
        self.session_id = None  # the board holds part of a message: only a new hello puts both ends in step

    def _may_repeat_ack(self) -> bool:
        return self._took_data and self.session_id is not None and not self._opening

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
        self._reset_reassembly()
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
        if frame.kind == KIND_DATA and frame.session_id == 0:  # a hello: one frame, whatever its flags
            self._incoming.clear()
            self._hellos.clear()
            self._reset_reassembly()
            self._rx_expected, self._tx_seq = 1, 0
            self._incoming.append(frame.payload)
            self._hellos.append(True)
            self._counts["payload_bytes_received"] += len(frame.payload)
            self._counts["messages_received"] += 1
            self._counts["fragments_received"] += 1
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
