"""Frames on the wire: exact bytes (shared with the firmware), escaping, CRC, and what the decoder drops."""

from __future__ import annotations

import random
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_agent.serial_bridge.framing import (
    FLAG_MORE,
    KIND_ACK,
    KIND_DATA,
    MAX_PAYLOAD_BYTES,
    Frame,
    FrameDecoder,
    encode_frame,
    escape,
    max_frame_wire_bytes,
)

# Golden frames: the firmware's tests check the same bytes.
GOLDEN_DATA = bytes.fromhex("7e 01 00 01 00 78 56 34 12 7d 5e 7d 5d 00 41 65 6b db 63 7e")
GOLDEN_ACK = bytes.fromhex("7e 02 00 ef be 0d f0 fe ca a6 8b c2 d9 7e")
GOLDEN_MORE = bytes.fromhex("7e 01 01 02 00 78 56 34 12 7d 5e 7d 5d 00 41 a6 0f 62 49 7e")  # a fragment, MORE set


def _crc32_bitwise(data: bytes) -> int:
    """IEEE 802.3 CRC-32 computed bit by bit (reflected polynomial 0xEDB88320), independent of zlib."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _wire(body: bytes) -> bytes:
    return b"\x7e" + escape(body) + b"\x7e"


def _body(kind: int, seq: int, session: int, payload: bytes, *, crc_delta: int = 0) -> bytes:
    head = struct.pack("<BBHI", kind, 0, seq, session) + payload
    return head + struct.pack("<I", (zlib.crc32(head) ^ crc_delta) & 0xFFFFFFFF)


def test_golden_frames_have_the_specified_layout():
    assert encode_frame(KIND_DATA, 1, 0x12345678, b"\x7e\x7d\x00A") == GOLDEN_DATA
    assert encode_frame(KIND_ACK, 0xBEEF, 0xCAFEF00D) == GOLDEN_ACK
    # unescaped: kind, flags 0, seq LE, session LE, payload, CRC-32 LE over all of it
    body = bytes.fromhex("01 00 0100 78563412 7e7d0041")
    assert _crc32_bitwise(body) == struct.unpack("<I", bytes.fromhex("656bdb63"))[0]
    assert FrameDecoder().feed(GOLDEN_DATA) == [Frame(KIND_DATA, 1, 0x12345678, b"\x7e\x7d\x00A")]
    assert FrameDecoder().feed(GOLDEN_ACK) == [Frame(KIND_ACK, 0xBEEF, 0xCAFEF00D, b"")]


def test_no_flag_inside_a_frame_and_every_byte_value_round_trips():
    payload = bytes(range(256)) * 3
    wire = encode_frame(KIND_DATA, 0x7E7D, 0x7E7D7E7D, payload)
    assert wire[0] == wire[-1] == 0x7E and 0x7E not in wire[1:-1]
    assert len(wire) <= max_frame_wire_bytes(len(payload))
    assert FrameDecoder().feed(wire) == [Frame(KIND_DATA, 0x7E7D, 0x7E7D7E7D, payload)]


@settings(max_examples=60, deadline=None)
@given(frames=st.lists(st.tuples(st.sampled_from([KIND_DATA, KIND_ACK]), st.integers(0, 0xFFFF),
                                 st.integers(0, 0xFFFFFFFF), st.binary(max_size=300)), min_size=1, max_size=8),
       cuts=st.lists(st.integers(0, 5000), max_size=12), extra_flags=st.integers(0, 3))
def test_any_chunking_decodes_the_same_frames(frames, cuts, extra_flags):
    expected = [Frame(kind, seq, session, payload if kind == KIND_DATA else b"")
                for kind, seq, session, payload in frames]
    wire = (b"\x7e" * extra_flags).join(encode_frame(f.kind, f.seq, f.session_id, f.payload) for f in expected)
    decoder = FrameDecoder()
    got, start = [], 0
    for cut in sorted({c % (len(wire) + 1) for c in cuts}) + [len(wire)]:
        got += decoder.feed(wire[start:cut])
        start = cut
    assert got == expected
    assert decoder.crc_errors == decoder.frames_dropped == 0


def test_byte_by_byte_with_an_escape_split_across_reads():
    wire = encode_frame(KIND_DATA, 7, 9, b"\x7d\x7e" * 10)
    decoder = FrameDecoder()
    got = []
    for byte in wire:
        got += decoder.feed(bytes([byte]))
    assert got == [Frame(KIND_DATA, 7, 9, b"\x7d\x7e" * 10)]


def test_a_bad_crc_is_counted_and_the_next_frame_still_decodes():
    decoder = FrameDecoder()
    good = encode_frame(KIND_DATA, 2, 5, b"next")
    assert decoder.feed(_wire(_body(KIND_DATA, 1, 5, b"hello", crc_delta=1)) + good) == [
        Frame(KIND_DATA, 2, 5, b"next")]
    assert (decoder.crc_errors, decoder.frames_dropped) == (1, 0)
    flipped = bytearray(encode_frame(KIND_DATA, 3, 5, b"payload"))
    flipped[10] ^= 0x01  # a payload bit
    assert decoder.feed(bytes(flipped)) == []
    assert decoder.crc_errors == 2


def test_short_long_and_unknown_kind_frames_are_dropped():
    decoder = FrameDecoder()
    assert decoder.feed(_wire(b"\x01\x00\x00")) == []  # shorter than 12 bytes
    assert decoder.feed(_wire(_body(KIND_DATA, 0, 1, b"")[:11])) == []
    assert decoder.frames_dropped == 2
    longest = _body(KIND_DATA, 0, 1, bytes(MAX_PAYLOAD_BYTES))
    assert decoder.feed(_wire(longest)) == [Frame(KIND_DATA, 0, 1, bytes(MAX_PAYLOAD_BYTES))]
    assert decoder.feed(_wire(_body(KIND_DATA, 0, 1, bytes(MAX_PAYLOAD_BYTES + 1)))) == []  # CRC fine, too long
    assert decoder.frames_dropped == 3
    assert decoder.feed(_wire(_body(3, 0, 1, b"x"))) == []  # CRC fine, no such kind
    assert decoder.feed(_wire(_body(0, 0, 1, b""))) == []
    assert (decoder.frames_dropped, decoder.crc_errors) == (5, 0)
    assert decoder.feed(encode_frame(KIND_ACK, 4, 1)) == [Frame(KIND_ACK, 4, 1)]


def test_an_endless_body_does_not_grow_the_buffer():
    decoder = FrameDecoder()
    decoder.feed(b"\x7e")
    for _ in range(20):
        decoder.feed(b"\x55" * 4096)
    assert len(decoder._body) <= 12 + MAX_PAYLOAD_BYTES
    assert decoder.feed(b"\x7e" + encode_frame(KIND_ACK, 1, 2)[1:]) == [Frame(KIND_ACK, 1, 2)]
    assert decoder.frames_dropped == 1


def test_escape_then_flag_aborts_and_that_flag_opens_the_next_frame():
    decoder = FrameDecoder()
    partial = encode_frame(KIND_DATA, 1, 5, b"abandoned")[:9]
    following = encode_frame(KIND_DATA, 2, 5, b"kept")[1:]  # without its opening flag: the abort's flag opens it
    assert decoder.feed(partial + b"\x7d\x7e" + following) == [Frame(KIND_DATA, 2, 5, b"kept")]
    assert (decoder.frames_dropped, decoder.crc_errors) == (1, 0)


def test_bytes_before_the_first_flag_and_empty_frames_are_skipped():
    decoder = FrameDecoder()
    noise = bytes(random.Random(1).randrange(0, 0x7D) for _ in range(50))
    frames = decoder.feed(noise + b"\x7e\x7e\x7e" + encode_frame(KIND_ACK, 9, 3) + b"\x7e\x7e")
    assert frames == [Frame(KIND_ACK, 9, 3)]
    assert (decoder.frames_dropped, decoder.crc_errors, decoder.frames_decoded) == (1, 0, 1)


def test_encode_frame_refuses_fields_out_of_range():
    with pytest.raises(ValueError, match="MAX_PAYLOAD_BYTES=4096"):
        encode_frame(KIND_DATA, 0, 1, bytes(MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(ValueError, match="kind"):
        encode_frame(3, 0, 1, b"")
    with pytest.raises(ValueError, match="seq"):
        encode_frame(KIND_DATA, 1 << 16, 1, b"")
    with pytest.raises(ValueError, match="session"):
        encode_frame(KIND_DATA, 0, 1 << 32, b"")
    with pytest.raises(ValueError, match="flags"):
        encode_frame(KIND_DATA, 0, 1, b"", 256)
    assert len(encode_frame(KIND_DATA, 0, 1, bytes(MAX_PAYLOAD_BYTES))) >= 12 + MAX_PAYLOAD_BYTES + 2


def test_the_more_flag_is_the_flags_byte_bit_0_and_nothing_else_changes():
    """A fragment's frame differs from a whole message's only in the flags byte (and so the CRC)."""
    assert FLAG_MORE == 0x01
    assert encode_frame(KIND_DATA, 2, 0x12345678, b"\x7e\x7d\x00A", FLAG_MORE) == GOLDEN_MORE
    body = bytes.fromhex("01 01 0200 78563412 7e7d0041")
    assert _crc32_bitwise(body) == struct.unpack("<I", bytes.fromhex("a60f6249"))[0]
    assert FrameDecoder().feed(GOLDEN_MORE) == [Frame(KIND_DATA, 2, 0x12345678, b"\x7e\x7d\x00A", FLAG_MORE)]
    assert encode_frame(KIND_DATA, 1, 0x12345678, b"\x7e\x7d\x00A", 0) == GOLDEN_DATA
