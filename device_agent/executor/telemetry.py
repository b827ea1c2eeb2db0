"""Telemetry: one event per executed instruction and a summary per step, on an in-process stream.

Calibration fits cost models to these events, so they carry raw measurements: durations from
``time.perf_counter`` around the instruction alone, bytes actually moved, and RSS right after it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class InstructionEvent:
    step: int
    position: int  # index of the instruction in the schedule
    kind: str  # compute | page_out | page_in | free
    node: int
    node_name: str
    node_kind: str  # fwd | loss | bwd
    location: str  # ram | flash (meaningful for free)
    duration_s: float
    bytes_moved: int  # compute: bytes added to RAM; page_out/in: file bytes; free: bytes released
    ram_in_use_bytes: int  # controlled bytes after the instruction
    rss_bytes: int  # process resident set size after the instruction
    recompute: bool = False  # a compute of a node already computed in this step
    cpu_s: float = 0.0  # CPU time of this process during the instruction (all threads)
    type: str = "instruction"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepSummary:
    step: int
    duration_s: float
    loss: float
    peak_tracked_bytes: int
    peak_pinned_bytes: int  # pinned internals (BatchNorm statistics) held by live graphs; part of fixed_bytes
    ram_budget_bytes: float
    fixed_bytes: int
    computes: int
    recomputes: int
    page_ins: int
    page_outs: int
    frees: int
    bytes_paged_out: int
    bytes_paged_in: int
    compute_s: float
    paging_s: float
    optimizer_s: float
    cpu_s: float
    energy_j: float | None
    energy_source: str
    rss_peak_bytes: int
    program_runs: int  # forward programs actually run (equals computes of fwd/loss nodes)
    backward_runs: int  # backward passes actually run (equals computes of bwd nodes)
    saved_tensor_reads: int  # saved tensors autograd read back from the RAM store
    type: str = "step"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Event = InstructionEvent | StepSummary


class EventStream:
    """Keeps events (unless ``keep`` is False) and hands each to the subscribers as it happens."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.events: list[Event] = []
        self._subscribers: list[Callable[[Event], None]] = []

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        self._subscribers.append(callback)

    def emit(self, event: Event) -> None:
        if self.keep:
            self.events.append(event)
        for callback in self._subscribers:
            callback(event)

    def instructions(self) -> list[InstructionEvent]:
        return [e for e in self.events if isinstance(e, InstructionEvent)]

    def steps(self) -> list[StepSummary]:
        return [e for e in self.events if isinstance(e, StepSummary)]


class JsonLinesWriter:
    """Subscriber writing one JSON object per line; flushed after every step summary."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._handle = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def __call__(self, event: Event) -> None:
        self._handle.write(json.dumps(event.to_dict(), ensure_ascii=False) + "\n")
        if isinstance(event, StepSummary):
            self._handle.flush()

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()
