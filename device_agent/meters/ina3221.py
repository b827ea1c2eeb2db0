"""NVIDIA Jetson's INA3221 rail monitors, both driver layouts: label ``measured:ina3221``.

* JetPack 5/6 (mainline ``ina3221`` hwmon driver, Linux ``Documentation/hwmon/ina3221.rst``):
  ``/sys/class/hwmon/hwmonN/name`` is "ina3221"; channel K (1-3) has ``inK_label`` (the rail name from
  the device tree), ``inK_input`` (bus voltage, mV) and ``currK_input`` (mA). Power is V × I.
  Channels labelled "NC" (not connected) or disabled (``inK_enable`` 0) are skipped.
* JetPack 4 (NVIDIA's L4T ``ina3221x`` iio driver, described in NVIDIA's Jetson Linux Developer
  Guide, "Power Monitoring"): ``/sys/bus/i2c/drivers/ina3221x/<bus-addr>/iio:deviceN/`` with
  ``rail_name_K`` (K from 0), ``in_powerK_input`` (mW), ``in_voltageK_input`` (mV) and
  ``in_currentK_input`` (mA). Power is ``in_powerK_input``, else V × I.

The board-input rail (``VDD_IN``; ``POM_5V_IN`` on the Nano) measures the whole module and is the
figure used where present; the other rails are inside it and are never added to it. Only when no
input rail exists (e.g. AGX Xavier, AGX Orin) are all the rails summed, and the meter's ``detail``
says so. Sampled at 50 Hz and integrated (see :class:`~device_agent.meters.base.SampledPowerMeter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from device_agent.meters.base import SampledPowerMeter, read_number, sysfs_path

NAME = "ina3221"
SOURCE = "measured:ina3221"
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


@dataclass(frozen=True)
class Rail:
    name: str
    where: str  # driver layout and directory, for the detail
    read_w: Callable[[], float]


def _hwmon_rails(sysfs_root: str | Path) -> list[Rail]:
    rails = []
    for hwmon in sorted(sysfs_path(sysfs_root, "class", "hwmon").glob("hwmon*")):
        try:
            if (hwmon / "name").read_text().strip() != "ina3221":
                continue
        except OSError:
            continue
        for channel in (1, 2, 3):
            volts, amps = hwmon / f"in{channel}_input", hwmon / f"curr{channel}_input"
            if not (volts.exists() and amps.exists()):
                continue
            try:
                label = (hwmon / f"in{channel}_label").read_text().strip()
            except OSError:
                label = f"{hwmon.name}/in{channel}"
            enable = hwmon / f"in{channel}_enable"
            if label.upper() == "NC" or (enable.exists() and enable.read_text().strip() == "0"):
                continue
            rails.append(Rail(label, f"hwmon {hwmon.name}",
                              lambda v=volts, a=amps: read_number(v) * read_number(a) / 1e6))
    return rails


def _iio_rails(sysfs_root: str | Path) -> list[Rail]:
    rails = []
    for device in sorted(sysfs_path(sysfs_root, "bus", "i2c", "drivers", "ina3221x").glob("*/iio:device*")):
        for name_file in sorted(device.glob("rail_name_*")):
            channel = name_file.name.rsplit("_", 1)[1]
            try:
                label = name_file.read_text().strip()
            except OSError:
                continue
            power = device / f"in_power{channel}_input"
            volts, amps = device / f"in_voltage{channel}_input", device / f"in_current{channel}_input"
            if power.exists():
                reader = lambda p=power: read_number(p) / 1e3  # noqa: E731
            elif volts.exists() and amps.exists():
                reader = lambda v=volts, a=amps: read_number(v) * read_number(a) / 1e6  # noqa: E731
            else:
                continue
            rails.append(Rail(label, f"ina3221x {device.parent.name}/{device.name}", reader))
    return rails


def find_rails(sysfs_root: str | Path = "/") -> tuple[list[Rail], str]:
    """The rails to add up and a description: the input rail alone where one exists, else every rail."""
    rails = _hwmon_rails(sysfs_root) or _iio_rails(sysfs_root)
    if not rails:
        return [], ""
    for wanted in INPUT_RAILS:
        for rail in rails:
            if rail.name.upper() == wanted:
                return [rail], f"board input rail {rail.name} ({rail.where})"
    names = "+".join(rail.name for rail in rails)
    wheres = ", ".join(dict.fromkeys(rail.where for rail in rails))
    return rails, f"sum of rails {names} (no board-input rail {'/'.join(INPUT_RAILS)}; {wheres})"


class Ina3221Meter(SampledPowerMeter):
    name = NAME
    label = SOURCE
    rate_hz = 50.0

    def __init__(self, rails: list[Rail], detail: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rails = list(rails)
        self.detail = detail

    def power_w(self) -> float:
        return sum(rail.read_w() for rail in self.rails)


def detect(sysfs_root: str | Path = "/", path: str | None = None, **kwargs) -> Ina3221Meter | None:
    try:
        rails, detail = find_rails(sysfs_root)
        if not rails:
            return None
        meter = Ina3221Meter(rails, detail, **kwargs)
        meter.power_w()
        return meter
    except (OSError, ValueError):
        return None
