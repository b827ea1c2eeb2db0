"""INA219/INA226 and kin through the kernel's ``ina2xx`` hwmon driver: label ``measured:ina2xx``.

Layout (Linux ``Documentation/hwmon/ina2xx.rst``): ``/sys/class/hwmon/hwmonN/name`` is the chip
("ina219", "ina226", ...); ``power1_input`` is the power in µW, ``in1_input`` the bus voltage in mV,
``curr1_input`` the current in mA (``in0_input`` is the shunt voltage). Power is ``power1_input``
where present, else ``in1_input`` × ``curr1_input``. Several such chips are summed (each is assumed to
sit on its own supply); the detail names them. Sampled at 50 Hz and integrated (see
:class:`~device_agent.meters.base.SampledPowerMeter`).
"""

from __future__ import annotations

from pathlib import Path

from device_agent.meters.base import SampledPowerMeter, read_number, sysfs_path

NAME = "ina2xx"
SOURCE = "measured:ina2xx"
CHIPS = frozenset({"ina219", "ina220", "ina226", "ina230", "ina231", "ina234", "ina260", "sy24655"})


def chips(sysfs_root: str | Path = "/") -> list[Path]:
    """hwmon directories of ina2xx chips, in hwmon order."""
    found = []
    for hwmon in sorted(sysfs_path(sysfs_root, "class", "hwmon").glob("hwmon*"),
                        key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else 0):
        try:
            if (hwmon / "name").read_text().strip() in CHIPS:
                found.append(hwmon)
        except OSError:
            continue
    return found


def chip_power_w(hwmon: Path) -> float:
    power = hwmon / "power1_input"
    if power.exists():
        return read_number(power) / 1e6
    return read_number(hwmon / "in1_input") * read_number(hwmon / "curr1_input") / 1e6


class Ina2xxMeter(SampledPowerMeter):
    name = NAME
    label = SOURCE
    rate_hz = 50.0

    def __init__(self, hwmons: list[Path], **kwargs) -> None:
        super().__init__(**kwargs)
        self.hwmons = list(hwmons)
        names = [f"{h.name} ({(h / 'name').read_text().strip()})" for h in self.hwmons]
        self.detail = ("sum of " if len(names) > 1 else "") + ", ".join(names)

    def power_w(self) -> float:
        return sum(chip_power_w(hwmon) for hwmon in self.hwmons)


def detect(sysfs_root: str | Path = "/", path: str | None = None, **kwargs) -> Ina2xxMeter | None:
    try:
        found = chips(sysfs_root)
        if not found:
            return None
        meter = Ina2xxMeter(found, **kwargs)
        meter.power_w()
        return meter
    except (OSError, ValueError):
        return None
