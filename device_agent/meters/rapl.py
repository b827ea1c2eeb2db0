"""Intel RAPL (also AMD's) package energy through the powercap sysfs interface: label ``measured:rapl``.

Layout (Linux ``Documentation/power/powercap/powercap.rst``): each package is a zone
``/sys/class/powercap/intel-rapl:N/`` with ``energy_uj`` (a cumulative counter in µJ that wraps to 0
after ``max_energy_range_uj``) and ``name`` ("package-N"). Its subzones ``intel-rapl:N:M`` (core,
uncore, dram) are parts of the package, so only the ``intel-rapl:N`` zones are summed. RAPL measures
the CPU package (and DRAM where a subzone exists), never the whole board: board-total meters are
preferred over it (see :mod:`device_agent.meters.registry`). Since 2020 ``energy_uj`` is readable by
root only on most distributions; an unreadable counter is not detected.

Wrap-around: a read that finds the counter below the previous one counts
``max_energy_range_uj - previous + current``. That is right only if at most one wrap happened
between the two reads, so a background thread reads every
``max_energy_range_uj / MAX_POWER_W / 4`` seconds (capped at :data:`MAX_INTERVAL_S`):
with the stated maximum package power of :data:`MAX_POWER_W` = 500 W, a wrap takes at least
``range / 500 W`` (524 s for the common 262,143 J range), and the thread reads four times within it
(every 60 s there, the cap).
"""

from __future__ import annotations

import re
from pathlib import Path

from device_agent.meters.base import EnergyMeter, MeterLost, read_number, sysfs_path

NAME = "rapl"
SOURCE = "measured:rapl"
MAX_POWER_W = 500.0  # stated upper bound on one package's power, for the read interval
MAX_INTERVAL_S = 60.0
_PACKAGE = re.compile(r"^intel-rapl:\d+$")


def package_zones(sysfs_root: str | Path = "/") -> list[Path]:
    """The package zones (``intel-rapl:N``, not the ``intel-rapl:N:M`` subzones), in order."""
    base = sysfs_path(sysfs_root, "class", "powercap")
    try:
        names = [entry.name for entry in base.iterdir() if _PACKAGE.match(entry.name)]
    except OSError:
        return []
    return [base / name for name in sorted(names, key=lambda n: int(n.split(":")[1]))]


class RaplMeter(EnergyMeter):
    name = NAME
    label = SOURCE
    kind = "energy"

    def __init__(self, zones: list[Path], **kwargs) -> None:
        super().__init__(**kwargs)
        if not zones:
            raise ValueError("no RAPL package zone")
        self.zones = list(zones)
        self.ranges_uj = [read_number(zone / "max_energy_range_uj") for zone in self.zones]
        if min(self.ranges_uj) <= 0:
            raise ValueError("max_energy_range_uj must be positive")
        self._previous: list[float] | None = None
        self._energy = 0.0
        self.detail = "package zones " + ", ".join(zone.name for zone in self.zones)

    def interval_s(self) -> float:
        return min(min(self.ranges_uj) / 1e6 / MAX_POWER_W / 4, MAX_INTERVAL_S)

    def counters_uj(self) -> list[float]:
        return [read_number(zone / "energy_uj") for zone in self.zones]

    def _tick(self) -> None:
        counters = self.counters_uj()
        with self._lock:
            if self._previous is not None:
                for previous, current, top in zip(self._previous, counters, self.ranges_uj, strict=True):
                    delta = current - previous if current >= previous else top - previous + current
                    self._energy += delta / 1e6
            self._previous = counters

    def _energy_now(self, now: float) -> float:
        self._tick()  # a read is cheap: take the counter now, not at the last background read
        with self._lock:
            if self._previous is None:
                raise MeterLost("no reading yet")
            return self._energy

    def reading_now(self) -> dict[str, float]:
        return {"energy_j": sum(self.counters_uj()) / 1e6}


def detect(sysfs_root: str | Path = "/", path: str | None = None, **kwargs) -> RaplMeter | None:
    zones = package_zones(sysfs_root)
    try:
        if not zones:
            return None
        meter = RaplMeter(zones, **kwargs)
        meter.counters_uj()  # readable? (root only on most systems)
        return meter
    except (OSError, ValueError):
        return None
