"""Energy without a power meter: process CPU time x an assumed power, plus paging time x storage power.

Every figure it produces is labelled ``modelled:cpu-time×power``: it is a model, never a measurement.
``compute_power_w`` is the power with ``threads`` CPU threads busy, so one CPU-second costs
``compute_power_w / threads`` joules; the caller supplies the assumptions (e.g. from a platform profile).
"""

from __future__ import annotations

import time
from typing import NamedTuple

SOURCE = "modelled:cpu-time×power"


class EnergyReading(NamedTuple):
    # A NamedTuple, not a frozen dataclass: the executor reads the meter around every instruction, and a
    # tuple is built in a fifth of the time.
    cpu_s: float
    wall_s: float


class ModelledEnergyMeter:
    """energy_j = cpu_s x compute_power_w / threads + paging_s x memory_power_w."""

    source = SOURCE

    def __init__(self, compute_power_w: float, memory_power_w: float, threads: int = 1) -> None:
        if compute_power_w < 0 or memory_power_w < 0 or threads < 1:
            raise ValueError("powers must be non-negative and threads at least 1")
        self.compute_power_w = float(compute_power_w)
        self.memory_power_w = float(memory_power_w)
        self.threads = int(threads)

    @staticmethod
    def read() -> EnergyReading:
        return EnergyReading(cpu_s=time.process_time(), wall_s=time.perf_counter())

    def energy_j(self, start: EnergyReading, end: EnergyReading, paging_s: float = 0.0) -> tuple[float, float]:
        """(energy_j, cpu_s) between two readings, with ``paging_s`` of flash traffic inside."""
        cpu_s = max(end.cpu_s - start.cpu_s, 0.0)
        return cpu_s * self.compute_power_w / self.threads + paging_s * self.memory_power_w, cpu_s
