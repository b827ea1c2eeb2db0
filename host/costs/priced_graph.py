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

    def __post_init__(self) -> None:
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

    @property
    def base_compute_j(self) -> float:
        """Compute energy of computing every node once: a lower bound on any schedule's energy."""
        return float(self.compute_j.sum())
