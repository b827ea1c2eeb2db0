"""The board's energy meters, detected in one place, best first.

Order (best first): the board-level meters, then RAPL.

1. ``ina3221`` (Jetson): its board-input rail measures the whole module.
2. ``ina2xx`` (an INA219/INA226 on the supply).
3. ``pi5-pmic`` (Raspberry Pi 5): the PMIC's output rails, most of the board.
4. ``rapl``: the CPU package only (no storage, no board), so it comes last.

Nothing found: the modelled estimate (``modelled:cpu-time×power``). :func:`detect_meters` is what the
agent uses for its RegisterRequest's ``meters`` and for :func:`default_energy_meter`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from device_agent.meters import ina2xx, ina3221, pi5_pmic, rapl
from device_agent.meters.base import EnergyMeter
from device_agent.meters.modelled import ModelledEnergyMeter, modelled_energy_meter

MODELLED_NAME = "modelled"

# name -> detect(sysfs_root, path, **meter_kwargs) -> meter or None; a new meter is one more entry.
DETECTORS: dict[str, Callable[..., EnergyMeter | None]] = {
    ina3221.NAME: ina3221.detect,
    ina2xx.NAME: ina2xx.detect,
    pi5_pmic.NAME: pi5_pmic.detect,
    rapl.NAME: rapl.detect,
}


def detect_meters(sysfs_root: str | Path = "/", path: str | None = None, **meter_kwargs) -> list[EnergyMeter]:
    """Every meter this board can read, best first (their threads start on the first ``read()``).

    ``sysfs_root`` prefixes ``/sys`` (a fixture tree in tests); ``path`` is the ``PATH`` searched for
    ``vcgencmd`` (None: the environment's). ``meter_kwargs`` go to each meter (``fallback``, ``log``,
    ``clock``, ``start_thread``).
    """
    found = []
    for detect in DETECTORS.values():
        meter = detect(sysfs_root, path, **meter_kwargs)
        if meter is not None:
            found.append(meter)
    return found


def meter_names(sysfs_root: str | Path = "/", path: str | None = None) -> list[str]:
    """Names of the detected meters, best first, or ``["modelled"]`` when there is none."""
    meters = detect_meters(sysfs_root, path, start_thread=False)
    for meter in meters:
        meter.close()
    return [meter.name for meter in meters] or [MODELLED_NAME]


def best_meter(sysfs_root: str | Path = "/", path: str | None = None, **meter_kwargs) -> EnergyMeter | None:
    """The best detected meter (the others are closed), or None."""
    meters = detect_meters(sysfs_root, path, **meter_kwargs)
    for other in meters[1:]:
        other.close()
    return meters[0] if meters else None


def default_energy_meter(threads: int | None = None, profile: dict | None = None, *,
                         sysfs_root: str = "/", path: str | None = None) -> EnergyMeter | ModelledEnergyMeter:
    """The board's best energy meter, else the modelled one.

    A measured meter falls back to :func:`~device_agent.meters.modelled.modelled_energy_meter` (same
    ``threads`` and ``profile``) if it is lost mid-run. ``sysfs_root`` and ``path`` (the ``PATH`` searched for
    ``vcgencmd``) are for tests.
    """
    modelled = modelled_energy_meter(threads, profile)
    meter = best_meter(sysfs_root, path, fallback=modelled)
    return meter if meter is not None else modelled
