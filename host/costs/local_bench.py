"""Measure THIS machine into a PlatformProfile (``poet profile --local [--flash-dir DIR]``).

The measurements live on the board side (:mod:`device_agent.profiling`), so a board's PROFILE job runs
the same code; this module validates the result as a :class:`PlatformProfile`.
"""

from __future__ import annotations

from collections.abc import Callable

from device_agent.profiling import ENERGY_SOURCE, LocalBenchError, measure_compute_flops_per_s
from device_agent.profiling import profile_local_machine as measure_local_machine
from host.costs.profile import PlatformProfile

__all__ = ["ENERGY_SOURCE", "LocalBenchError", "measure_compute_flops_per_s", "profile_local_machine"]


def profile_local_machine(flash_dir: str, *, name: str = "local", quick: bool = False,
                          progress: Callable[[str], None] | None = None, compute_power_w: float | None = None,
                          memory_power_w: float | None = None) -> PlatformProfile:
    """Benchmark this machine's CPU (torch) and ``flash_dir`` storage into a profile with modelled energy."""
    fields = measure_local_machine(flash_dir, name=name, quick=quick, progress=progress,
                                   compute_power_w=compute_power_w, memory_power_w=memory_power_w)
    return PlatformProfile.from_dict(fields, file_label=f"local profile {name!r}")
