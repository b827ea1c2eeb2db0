"""Energy without a power meter: process CPU time x an assumed power, plus paging time x storage power.

Every figure it produces is labelled ``modelled:cpu-time×power``: it is a model, never a measurement.
``compute_power_w`` is the power with ``threads`` CPU threads busy, so one CPU-second costs
``compute_power_w / threads`` joules. The caller supplies the powers (e.g. from a platform profile), or
:func:`modelled_energy_meter` takes the documented assumptions below.
"""

from __future__ import annotations

import time
from typing import NamedTuple

SOURCE = "modelled:cpu-time×power"

# Assumed active power per busy CPU thread, by platform.machine(). x86-64: a desktop/server core under
# full load draws roughly 5-10 W (a 65 W TDP 8-core desktop part ~8 W/core, a 205 W 28-core server part
# ~7.3 W/core); we take 7.5 W. Arm (aarch64/armv7l): POET's Raspberry Pi figure, 0.6 A x 5 V for 4 cores
# = 0.75 W/core.
CPU_POWER_PER_THREAD_W = {"x86_64": 7.5, "amd64": 7.5, "aarch64": 0.75, "arm64": 0.75, "armv7l": 0.75}
# Assumed storage power while paging. x86-64 hosts: an NVMe/SATA SSD writing or reading draws ~2-6 W;
# we take 3.0 W. Arm boards: POET's Raspberry Pi SD-card figure, 30 mA x 5 V = 0.15 W.
STORAGE_POWER_W = {"x86_64": 3.0, "amd64": 3.0, "aarch64": 0.15, "arm64": 0.15, "armv7l": 0.15}
FALLBACK_MACHINE = "x86_64"


def assumed_machine(machine: str) -> str:
    """The key of the power assumptions for ``platform.machine()`` (an unknown machine is priced as x86-64)."""
    return machine.lower() if machine.lower() in CPU_POWER_PER_THREAD_W else FALLBACK_MACHINE


class EnergyReading(NamedTuple):
    # A NamedTuple, not a frozen dataclass: an instrumented executor reads the meter around every instruction,
    # and a tuple is built in a fifth of the time.
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


def modelled_energy_meter(threads: int | None = None, profile: dict | None = None) -> ModelledEnergyMeter:
    """The modelled meter of this machine: a local profile's powers, or the assumptions above."""
    import platform

    import torch

    threads = torch.get_num_threads() if threads is None else threads
    if profile is not None and profile.get("energy_source") == SOURCE:
        return ModelledEnergyMeter(profile["compute_power_w"], profile["memory_power_w"], threads)
    key = assumed_machine(platform.machine())
    return ModelledEnergyMeter(CPU_POWER_PER_THREAD_W[key] * threads, STORAGE_POWER_W[key], threads)
