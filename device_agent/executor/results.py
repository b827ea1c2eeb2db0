"""What a step reports: the work it did (:class:`Counters`) and its :class:`StepResult`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from device_agent.executor.telemetry import StepSummary

__all__ = ["COUNTER_FIELDS", "Counters", "StepResult", "copy_counters"]


@dataclass
class Counters:
    computes: int = 0
    recomputes: int = 0
    page_ins: int = 0
    page_outs: int = 0
    frees_ram: int = 0
    frees_flash: int = 0
    program_runs: int = 0
    backward_runs: int = 0
    saved_tensor_reads: int = 0
    bytes_paged_out: int = 0
    bytes_paged_in: int = 0
    computes_per_node: Counter = field(default_factory=Counter)

    def plan_counts(self) -> dict[str, int]:
        return {
            "computes": self.computes,
            "recomputes": self.recomputes,
            "page_ins": self.page_ins,
            "page_outs": self.page_outs,
        }


@dataclass
class StepResult:
    step: int
    loss: float
    duration_s: float
    peak_tracked_bytes: int
    counters: Counters
    summary: StepSummary
    lowered: bool = False  # ran as the straight-line program (lowering.py), not instruction by instruction


# the counters that are plain numbers (all but computes_per_node)
COUNTER_FIELDS = ("computes", "recomputes", "page_ins", "page_outs", "frees_ram", "frees_flash", "program_runs",
                  "backward_runs", "saved_tensor_reads", "bytes_paged_out", "bytes_paged_in")


def copy_counters(counters: Counters) -> Counters:
    copied = Counters(**{name: getattr(counters, name) for name in COUNTER_FIELDS})
    copied.computes_per_node = counters.computes_per_node.copy()
    return copied
