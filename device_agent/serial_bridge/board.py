"""Drive the Cortex-M firmware (device_agent/firmware/cortex_m) over a Link: one McuMessage per frame.

Every request gets one reply: McuOk, McuError (raised here as McuBoardError with the board's message) or the
reply named in protos/poet/v1/mcu.proto. RunStep answers with one McuInstructionEvent per instruction, then
McuStepDone (or McuError naming the instruction that failed); ReadParams with every McuParamChunk, then McuOk.

    link = Link.connect(qemu_board.serial_url)
    board = McuBoard(link)
    info = board.hello()
    board.load_model(model); board.load_schedule(schedule); board.write_params(params)
    events, done = board.run_step(1, inputs, labels)
    params = board.read_params()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from device_agent import protos
from device_agent.errors import UserError
from device_agent.serial_bridge.framing import MAX_PAYLOAD_BYTES

mcu_pb2 = protos.load("poet.v1.mcu_pb2")
schedule_pb2 = protos.load("poet.v1.schedule_pb2")

__all__ = ["PROTOCOL_VERSION", "McuBoard", "McuBoardError", "McuProtocolError"]

PROTOCOL_VERSION = 1
DEFAULT_REPLY_TIMEOUT_S = 30.0
DEFAULT_STEP_TIMEOUT_S = 300.0  # an emulated step of a large batch is slow; the board answers after the step
_CHUNK_MARGIN_BYTES = 32  # field tags and varints around a chunk's data


class McuBoardError(UserError, RuntimeError):
    """The board answered a request with McuError; ``board_message`` is its reason as it sent it."""

    def __init__(self, request: str, board_message: str) -> None:
        super().__init__(f"the board refused {request}: {board_message}")
        self.request = request
        self.board_message = board_message


class McuProtocolError(RuntimeError):
    """The board answered with a message the protocol does not allow there."""


def _body(message) -> str:
    return message.WhichOneof("body") or "(empty)"


class McuBoard:
    """The host's driver of one board over ``link`` (device_agent.serial_bridge.link.Link)."""

    def __init__(self, link, *, reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.link = link
        self.reply_timeout_s = float(reply_timeout_s)
        self.step_timeout_s = float(step_timeout_s)
        self.info = None  # McuBoardInfo, from hello()
        self.model = None  # the McuModel last loaded

    # -- messages -------------------------------------------------------------------------------------------

    @property
    def max_payload_bytes(self) -> int:
        limit = self.info.max_payload_bytes if self.info is not None else 0
        return min(limit or MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES)

    def _send(self, message, what: str) -> None:
        payload = message.SerializeToString()
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"{what} encodes to {len(payload)} bytes; the board takes at most "
                             f"{self.max_payload_bytes} in one message")
        self.link.send(payload)

    def _receive(self, what: str, timeout_s: float | None = None):
        message = mcu_pb2.McuMessage()
        message.ParseFromString(self.link.receive(timeout_s or self.reply_timeout_s))
        if message.WhichOneof("body") == "error":
            raise McuBoardError(what, message.error.message)
        return message

    def _request_ok(self, message, what: str) -> None:
        self._send(message, what)
        reply = self._receive(what)
        if reply.WhichOneof("body") != "ok":
            raise McuProtocolError(f"the board answered {what} with {_body(reply)}, not ok")

    # -- the protocol ---------------------------------------------------------------------------------------

    def hello(self, timeout_s: float = 10.0, *, max_fragment_bytes: int = 0, ack_timeout_ms: int = 0):
        """Open the link's session; returns the board's McuBoardInfo (also kept as ``.info``).

        ``max_fragment_bytes`` and ``ack_timeout_ms`` set the board's side of the link from the hello on (0: its
        defaults, 4096 and 100 ms); the link's own ``fragment_bytes`` and ``ack_timeout_s`` set the host's."""
        hello = mcu_pb2.McuMessage(hello=mcu_pb2.McuHello(protocol_version=PROTOCOL_VERSION,
                                                          max_fragment_bytes=int(max_fragment_bytes),
                                                          ack_timeout_ms=int(ack_timeout_ms)))
        reply = mcu_pb2.McuMessage()
        reply.ParseFromString(self.link.open(hello.SerializeToString(), timeout_s=timeout_s))
        kind = reply.WhichOneof("body")
        if kind == "error":
            raise McuBoardError("the hello", reply.error.message)
        if kind != "board_info":
            raise McuProtocolError(f"the board answered the hello with {kind or '(empty)'}, not board_info")
        info = reply.board_info
        if info.protocol_version != PROTOCOL_VERSION:
            raise McuProtocolError(f"the board speaks protocol {info.protocol_version}; this host speaks "
                                   f"{PROTOCOL_VERSION}: flash the firmware that matches this poet-edge")
        self.info = info
        return info

    def load_model(self, model) -> None:
        """Send the McuModel: the layers, which layer each schedule node computes, batch size, SGD settings.
        The board zeroes its parameters and momentum buffers (torch's first SGD step follows); write_params next."""
        self._request_ok(mcu_pb2.McuMessage(load_model=mcu_pb2.McuLoadModel(model=model)), "the model")
        self.model = model

    def load_schedule(self, schedule) -> None:
        """Send the schedule: a poet.v1.Schedule, or a device_agent.schedule.Schedule (converted)."""
        if not isinstance(schedule, schedule_pb2.Schedule):
            from device_agent.serde import schedule_to_proto
            schedule = schedule_to_proto(schedule)
        self._request_ok(mcu_pb2.McuMessage(load_schedule=mcu_pb2.McuLoadSchedule(schedule=schedule)),
                         f"the schedule ({len(schedule.instructions)} instructions)")

    def _floats_per_chunk(self, extra_bytes: int = 0) -> int:
        return max(1, (self.max_payload_bytes - _CHUNK_MARGIN_BYTES - extra_bytes) // 4)

    def write_params(self, params: Iterable[tuple[int, int, object]] | Mapping[tuple[int, int], object]) -> None:
        """Write parameters: (layer, tensor, values) triples or {(layer, tensor): values}; tensor 0 is the
        weight ([out, in] as torch stores it), 1 the bias. Sent as little-endian float32 in chunks."""
        items = params.items() if isinstance(params, Mapping) else ((k[:2], k[2]) for k in params)
        per_chunk = self._floats_per_chunk()
        for (layer, tensor), values in items:
            flat = _float32(values)
            for offset in range(0, max(len(flat), 1), per_chunk):
                chunk = mcu_pb2.McuParamChunk(layer=int(layer), tensor=int(tensor), offset=offset,
                                              data=flat[offset:offset + per_chunk].tobytes())
                self._request_ok(mcu_pb2.McuMessage(param_chunk=chunk),
                                 f"parameters of layer {layer} tensor {tensor} at {offset}")

    def write_batch(self, inputs, labels) -> None:
        """Send one batch: inputs [batch, features] float32 and labels [batch] class indices."""
        flat = _float32(inputs)
        label_list = [int(v) for v in np.asarray(_numpy(labels)).reshape(-1)]
        first = True
        offset = 0
        while first or offset < len(flat):
            extra = 6 * len(label_list) + 8 if first else 0
            per_chunk = self._floats_per_chunk(extra)
            chunk = mcu_pb2.McuBatchChunk(offset=offset, inputs=flat[offset:offset + per_chunk].tobytes(),
                                          labels=label_list if first else [])
            self._request_ok(mcu_pb2.McuMessage(batch_chunk=chunk), f"the batch chunk at {offset}")
            offset += per_chunk
            first = False

    def run_step(self, step: int, inputs, labels, *, on_event=None):
        """Send the batch, run one training step; returns (list of McuInstructionEvent, McuStepDone).

        The board sends each instruction's event as soon as the instruction ran and waits for it to be taken
        before the next instruction: ``on_event(event)``, called as each arrives, sees the step as it runs."""
        self.write_batch(inputs, labels)
        what = f"step {step}"
        self._send(mcu_pb2.McuMessage(run_step=mcu_pb2.McuRunStep(step=int(step))), what)
        events = []
        while True:
            reply = self._receive(what, self.step_timeout_s)
            kind = reply.WhichOneof("body")
            if kind == "instruction_event":
                events.append(reply.instruction_event)
                if on_event is not None:
                    on_event(reply.instruction_event)
            elif kind == "step_done":
                return events, reply.step_done
            else:
                raise McuProtocolError(f"the board answered {what} with {kind or '(empty)'}")

    def read_params(self) -> dict[tuple[int, int], torch.Tensor]:
        """Every parameter the board holds: {(layer, tensor): 1-D float32 tensor}."""
        what = "reading the parameters"
        self._send(mcu_pb2.McuMessage(read_params=mcu_pb2.McuReadParams()), what)
        parts: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
        while True:
            reply = self._receive(what)
            kind = reply.WhichOneof("body")
            if kind == "ok":
                break
            if kind != "param_chunk":
                raise McuProtocolError(f"the board answered {what} with {kind or '(empty)'}")
            chunk = reply.param_chunk
            parts.setdefault((chunk.layer, chunk.tensor), []).append(
                (chunk.offset, np.frombuffer(chunk.data, dtype="<f4")))
        out = {}
        for key, chunks in parts.items():
            chunks.sort(key=lambda item: item[0])
            expected = 0
            for offset, values in chunks:
                if offset != expected:
                    raise McuProtocolError(f"parameters of layer {key[0]} tensor {key[1]}: a chunk at {offset}, "
                                           f"expected {expected}")
                expected += len(values)
            out[key] = torch.from_numpy(np.concatenate([values for _, values in chunks]).astype(np.float32))
        return out


def _numpy(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def _float32(values) -> np.ndarray:
    """Values as a flat little-endian float32 array."""
    return np.ascontiguousarray(_numpy(values), dtype="<f4").reshape(-1)
