"""A TrainingGraph priced on a platform: per-node compute, page-in and page-out time and energy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host.graph.training_graph import TrainingGraph


@dataclass
class PricedGraph:
    """Per-node costs, each a float array of length ``graph.size`` (seconds and joules)."""

    graph: TrainingGraph
    platform: str
    cost_model: str  # "analytic" | "calibrated" | ...
    energy_source: str  # e.g. "modelled:poet2022-constants", "modelled:cpu-time×power"
    compute_s: np.ndarray
    compute_j: np.ndarray
    page_in_s: np.ndarray
    page_in_j: np.ndarray
    page_out_s: np.ndarray
    page_out_j: np.ndarray
    transfer_overlap: float = 1.0  # share of a page transfer's time hidden behind compute (PlatformProfile's)
    # seconds of each page-in's / page-out's price that hold the compute thread (never hidden; PlatformProfile's)
    page_in_compute_thread_s: float = 0.0
    page_out_compute_thread_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.transfer_overlap <= 1.0:
            raise ValueError(f"PricedGraph.transfer_overlap must be between 0 and 1, got {self.transfer_overlap!r}")
        for kind in ("page_in", "page_out"):
            thread_s = getattr(self, f"{kind}_compute_thread_s")
            if not 0.0 <= thread_s < float("inf"):
                raise ValueError(f"PricedGraph.{kind}_compute_thread_s must be finite and non-negative, got {thread_s!r}")
        size = self.graph.size
        for field_name in ("compute_s", "compute_j", "page_in_s", "page_in_j", "page_out_s", "page_out_j"):
            values = np.asarray(getattr(self, field_name), dtype=np.float64)
            if values.shape != (size,):
                raise ValueError(f"PricedGraph.{field_name} has shape {values.shape}, expected ({size},)")
            if not np.all(np.isfinite(values)) or np.any(values < 0):
                raise ValueError(f"PricedGraph.{field_name} must be finite and non-negative")
            setattr(self, field_name, values)

    @property
    def base_runtime_s(self) -> float:
        """Plain forward+backward runtime: every node computed once, no paging (the paper's budget base)."""
        return float(self.compute_s.sum())

    def instruction_seconds(self, instructions, free_ram_s: float = 0.0, free_flash_s: float = 0.0) -> list[float]:
        """Seconds of each instruction: a compute's or a transfer's priced time, a free's given time."""
        table = {"compute": self.compute_s, "page_in": self.page_in_s, "page_out": self.page_out_s}
        return [float(table[i.kind][i.node]) if i.kind in table else
                (free_flash_s if i.location == "flash" else free_ram_s) for i in instructions]

    def overlapped_runtime_s(self, instructions, ram_timeline_bytes, ram_budget_bytes: float | None,
                             free_ram_s: float = 0.0, free_flash_s: float = 0.0) -> float:
        """Seconds of a step of ``instructions`` when its page transfers run behind compute as the executor runs
        them (:func:`device_agent.executor.overlap.overlapped_step_s`); never more than the instructions' sum."""
        from device_agent.executor.overlap import overlapped_step_s
        from device_agent.replay import instruction_workspace_bytes

        seconds = self.instruction_seconds(instructions, free_ram_s, free_flash_s)
        if not any(i.kind == "page_in" for i in instructions):  # nothing to hide behind compute
            return float(sum(seconds))
        thread = {"page_in": self.page_in_compute_thread_s, "page_out": self.page_out_compute_thread_s}
        thread_s = [min(thread.get(i.kind, 0.0), s) for i, s in zip(instructions, seconds, strict=True)]
        io_s = [s - t for s, t in zip(seconds, thread_s, strict=True)]  # what the I/O thread runs
        return overlapped_step_s(instructions, io_s, ram_timeline_bytes, ram_budget_bytes or 0.0,
                                 workspace=instruction_workspace_bytes(self.graph.nodes, instructions),
                                 hidden_share=self.transfer_overlap, compute_thread_s=thread_s)

    @property
    def base_compute_j(self) -> float:
        """Compute energy of computing every node once: a lower bound on any schedule's energy."""
        return float(self.compute_j.sum())
