"""The serial link's frames: 0x7E, HDLC-escaped body, 0x7E; body = kind, flags, seq, session, payload, CRC-32.

flags bit 0 (FLAG_MORE) on a DATA frame: the message continues in the next DATA frame (the next seq); a message
is one or more DATA frames, MORE on all but the last, and at most MAX_PAYLOAD_BYTES in all. The other bits are 0.

The firmware (device_agent/firmware/cortex_m) encodes the same bytes; the two must change together.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = [
    "CRC_BYTES", "ESCAPE", "ESCAPE_XOR", "FLAG", "FLAG_MORE", "FRAME_OVERHEAD_BYTES", "HEADER_BYTES", "KIND_ACK", "KIND_DATA", "KINDS",
    "MAX_BODY_BYTES", "MAX_PAYLOAD_BYTES", "MIN_BODY_BYTES", "SEQ_MODULO", "Frame", "FrameDecoder",
    "decode_body", "encode_frame", "escape", "max_frame_wire_bytes",
]

FLAG = 0x7E
ESCAPE = 0x7D
ESCAPE_XOR = 0x20
KIND_DATA = 1
KIND_ACK = 2
KINDS = frozenset((KIND_DATA, KIND_ACK))
FLAG_MORE = 0x01  # flags: the message goes on in the next DATA frame
HEADER_BYTES = 8
CRC_BYTES = 4
MAX_PAYLOAD_BYTES = 4096
MIN_BODY_BYTES = HEADER_BYTES + CRC_BYTES
MAX_BODY_BYTES = MIN_BODY_BYTES + MAX_PAYLOAD_BYTES
FRAME_OVERHEAD_BYTES = MIN_BODY_BYTES + 2  # header, CRC and the two flags, before escapes
SEQ_MODULO = 1 << 16
_HEADER = struct.Struct("<BBHI")
_CRC = struct.Struct("<I")
_ESCAPED = {FLAG: bytes((ESCAPE, FLAG ^ ESCAPE_XOR)), ESCAPE: bytes((ESCAPE, ESCAPE ^ ESCAPE_XOR))}


@dataclass(frozen=True)
class Frame:
    """One decoded frame: DATA carries ``payload``; an ACK's ``seq`` names the DATA it acknowledges."""

    kind: int
    seq: int
    session_id: int
    payload: bytes = b""
    flags: int = 0


def escape(body: bytes) -> bytes:
    """``body`` with every 0x7E and 0x7D replaced by 0x7D, byte XOR 0x20 (the flag never appears inside)."""
    if FLAG not in body and ESCAPE not in body:
        return bytes(body)
    # ESCAPE first, so the escapes that FLAG's replacement adds are not escaped again
    return bytes(body).replace(b"\x7d", _ESCAPED[ESCAPE]).replace(b"\x7e", _ESCAPED[FLAG])


def encode_frame(kind: int, seq: int, session_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """The wire bytes of one frame, both flags included; ValueError for a field out of its range."""
    if kind not in KINDS:
        raise ValueError(f"frame kind {kind} is not DATA ({KIND_DATA}) or ACK ({KIND_ACK})")
    if not 0 <= seq < SEQ_MODULO:
        raise ValueError(f"seq {seq} is outside 0..{SEQ_MODULO - 1}")
    if not 0 <= session_id < 1 << 32:
        raise ValueError(f"session_id {session_id} does not fit in 32 bits")
    if not 0 <= flags < 256:
        raise ValueError(f"flags {flags} do not fit in 8 bits")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {len(payload)} bytes exceeds the link's limit of MAX_PAYLOAD_BYTES="
                         f"{MAX_PAYLOAD_BYTES} bytes; split it into several messages")
    head = _HEADER.pack(kind, flags, seq, session_id) + bytes(payload)
    body = head + _CRC.pack(zlib.crc32(head))
    return b"\x7e" + escape(body) + b"\x7e"


def max_frame_wire_bytes(payload_bytes: int = MAX_PAYLOAD_BYTES) -> int:
    """The most bytes a frame with ``payload_bytes`` can take on the wire (every body byte escaped)."""
    return 2 + 2 * (MIN_BODY_BYTES + payload_bytes)


def decode_body(body: bytes) -> Frame | str:
    """The Frame in an unescaped ``body``, or the reason it is dropped: "short", "long", "crc" or "kind"."""
    if len(body) < MIN_BODY_BYTES:
        return "short"
    if len(body) > MAX_BODY_BYTES:
        return "long"
    (crc,) = _CRC.unpack_from(body, len(body) - CRC_BYTES)
    if zlib.crc32(body[:-CRC_BYTES]) != crc:
        return "crc"
    kind, flags, seq, session_id = _HEADER.unpack_from(body)
    if kind not in KINDS:
        return "kind"
    return Frame(kind, seq, session_id, bytes(body[HEADER_BYTES:-CRC_BYTES]), flags)


class FrameDecoder:
    """Turns a byte stream, in any chunking, into Frames; counts what it drops (``crc_errors``, ``frames_dropped``).

    0x7D 0x7E aborts the frame and that flag opens the next; bytes before the first flag count as one dropped frame.
    """

    def __init__(self) -> None:
        self._body = bytearray()
        self._in_frame = False  # False until the first flag: what came before it is a partial frame
        self._escaped = False
        self._overflow = False
        self.crc_errors = 0
        self.frames_dropped = 0  # short, long, unknown kind, aborted, or bytes before the first flag
        self.frames_decoded = 0

    def feed(self, data: bytes) -> list[Frame]:
        """Consume ``data``; returns the frames it completed, in order."""
        frames: list[Frame] = []
        view = bytes(data)
        start, end = 0, len(view)
        while start < end:
            flag_at = view.find(b"\x7e", start)
            stop = end if flag_at < 0 else flag_at
            if stop > start:
                if self._in_frame:
                    self._append(view, start, stop)
                elif not self._overflow:
                    self._overflow = True  # garbage before the first flag: counted once, at that flag
            if flag_at < 0:
                break
            self._close(frames)
            start = flag_at + 1
        return frames

    def _append(self, view: bytes, start: int, stop: int) -> None:
        """Unescape view[start:stop] onto the body; an escape byte may end one chunk and its byte start the next."""
        out = bytearray()
        i = start
        if self._escaped:
            out.append(view[i] ^ ESCAPE_XOR)
            self._escaped = False
            i += 1
        while i < stop:
            j = view.find(b"\x7d", i, stop)
            if j < 0:
                out += view[i:stop]
                break
            out += view[i:j]
            if j + 1 < stop:
                out.append(view[j + 1] ^ ESCAPE_XOR)
                i = j + 2
            else:
                self._escaped = True
                break
        if self._overflow:
            return
        if len(self._body) + len(out) > MAX_BODY_BYTES:
            self._overflow = True  # too long for any valid frame: stop storing, drop it at its flag
            self._body.clear()
            return
        self._body += out

    def _close(self, frames: list[Frame]) -> None:
        """A flag: finish the frame in progress (or its abort) and open the next."""
        if self._escaped:
            self.frames_dropped += 1  # 0x7D 0x7E: the sender aborted this frame
        elif self._overflow:
            self.frames_dropped += 1
        elif self._body:
            result = decode_body(bytes(self._body))
            if isinstance(result, Frame):
                self.frames_decoded += 1
                frames.append(result)
            elif result == "crc":
                self.crc_errors += 1
            else:
                self.frames_dropped += 1
        self._body.clear()
        self._escaped = False
        self._overflow = False
        self._in_frame = True
