"""Telemetry: one event per executed instruction and a summary per step, on an in-process stream.

Calibration fits cost models to these events, so they carry raw measurements: durations from
``time.perf_counter`` around the instruction alone, bytes actually moved, and RSS right after it.

The stream holds only the most recent events (a ring of :data:`DEFAULT_CAPACITY`), counts the ones it
dropped, and aggregates every step summary into :class:`StepTotals`; a long run no longer grows by some
400 bytes per instruction. Subscribers (the ``--events FILE`` writer, the agent's telemetry) see every
event as it happens, so a file sink is complete whatever the capacity.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# Held events by default: about 25 MB of events, some 300 steps of resnet18_cifar at layer granularity
# (210 instructions a step), far more than calibration reads from one run.
DEFAULT_CAPACITY = 65_536


@dataclass(slots=True)
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
    rss_bytes: int  # process RSS: read after computes and page-ins (every instruction when instrumented), else the last
    recompute: bool = False  # a compute of a node already computed in this step
    # CPU time of this process during the instruction (all threads); None when not read (an uninstrumented
    # executor reads the meter around page transfers only).
    cpu_s: float | None = None
    # The meter's energy between readings just before and just after the instruction (page_out/page_in:
    # a modelled meter adds storage power over the duration), and the meter's label at the after reading;
    # None and "" without a meter. Disjoint intervals inside the step: they sum to at most its energy.
    energy_j: float | None = None
    energy_source: str = ""
    # Page transfers of a lowered step: seconds of the compute thread the transfer took besides its own time
    # (``duration_s``, on the I/O thread): starting it (a page-out builds its entry) and taking its result,
    # beyond waiting for the transfer itself. None where not timed (other instructions, interpreted steps).
    compute_thread_s: float | None = None
    type: str = "instruction"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
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


@dataclass
class StepTotals:
    """Every step summary the stream saw, aggregated: sums, maxima, first and last loss."""

    steps: int = 0
    instructions: int = 0  # instruction events seen (held or dropped)
    duration_s: float = 0.0
    compute_s: float = 0.0
    paging_s: float = 0.0
    optimizer_s: float = 0.0
    cpu_s: float = 0.0
    energy_j: float = 0.0  # over the steps that had an energy figure
    energy_steps: int = 0
    computes: int = 0
    recomputes: int = 0
    page_ins: int = 0
    page_outs: int = 0
    frees: int = 0
    bytes_paged_out: int = 0
    bytes_paged_in: int = 0
    peak_tracked_bytes: int = 0  # maximum over steps
    rss_peak_bytes: int = 0  # maximum over steps
    first_loss: float | None = None
    last_loss: float | None = None

    def add(self, summary: StepSummary) -> None:
        self.steps += 1  # spelled out: every step pays for this (a getattr/setattr loop took ~15 us)
        self.duration_s += summary.duration_s
        self.compute_s += summary.compute_s
        self.paging_s += summary.paging_s
        self.optimizer_s += summary.optimizer_s
        self.cpu_s += summary.cpu_s
        self.computes += summary.computes
        self.recomputes += summary.recomputes
        self.page_ins += summary.page_ins
        self.page_outs += summary.page_outs
        self.frees += summary.frees
        self.bytes_paged_out += summary.bytes_paged_out
        self.bytes_paged_in += summary.bytes_paged_in
        if summary.energy_j is not None:
            self.energy_j += summary.energy_j
            self.energy_steps += 1
        self.peak_tracked_bytes = max(self.peak_tracked_bytes, summary.peak_tracked_bytes)
        self.rss_peak_bytes = max(self.rss_peak_bytes, summary.rss_peak_bytes)
        if self.first_loss is None:
            self.first_loss = summary.loss
        self.last_loss = summary.loss

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EventStream:
    """Hands each event to the subscribers as it happens; holds the latest ``capacity`` of them.

    ``capacity=None`` holds every event (unbounded: for short runs only); ``keep=False`` (or capacity 0)
    holds none. :attr:`dropped` counts the events emitted but no longer held; :attr:`totals` aggregates
    every step summary, held or not.
    """

    def __init__(self, keep: bool = True, capacity: int | None = DEFAULT_CAPACITY) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be at least 0, got {capacity}")
        self.capacity = capacity if keep else 0
        self._held: deque[Event] = deque(maxlen=self.capacity)
        self.emitted = 0
        self.totals = StepTotals()
        self._subscribers: list[Callable[[Event], None]] = []

    @property
    def keep(self) -> bool:
        return self.capacity != 0

    @property
    def events(self) -> list[Event]:
        """The held events, oldest first."""
        return list(self._held)

    @property
    def held(self) -> int:
        """How many events the ring holds now (at most ``capacity``)."""
        return len(self._held)

    @property
    def dropped(self) -> int:
        """Events emitted that the ring no longer holds."""
        return self.emitted - len(self._held)

    @property
    def wants_instructions(self) -> bool:
        """Whether instruction events reach anyone (held or subscribed): a lowered step makes them only then."""
        return self.capacity != 0 or bool(self._subscribers)

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        self._subscribers.append(callback)

    def emit(self, event: Event) -> None:
        self.emitted += 1
        if isinstance(event, StepSummary):
            self.totals.add(event)
        else:
            self.totals.instructions += 1
        if self.capacity != 0:
            self._held.append(event)
        for callback in self._subscribers:
            callback(event)

    def instructions(self) -> list[InstructionEvent]:
        return [e for e in self._held if isinstance(e, InstructionEvent)]

    def steps(self) -> list[StepSummary]:
        return [e for e in self._held if isinstance(e, StepSummary)]


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
