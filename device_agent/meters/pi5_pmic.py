"""Raspberry Pi 5 PMIC rails through ``vcgencmd pmic_read_adc``: label ``measured:pi5-pmic``.

``vcgencmd`` (found on ``PATH``) prints one line per ADC channel of the Pi 5's power-management IC
(the format Raspberry Pi's ``vcgencmd`` prints on the Pi 5, as shown in Raspberry Pi forum threads
on measuring the Pi 5's power and in tools that parse it), e.g.::

     VDD_CORE_A current(7)=1.54489000A
     VDD_CORE_V volt(15)=0.88725180V

Power is the sum of V × I over the rails that report both a current (``NAME_A``) and a voltage
(``NAME_V``). These are the PMIC's output rails, so the figure leaves out conversion losses and the
USB/peripheral 5 V load (``EXT5V_V`` has no current channel): it is below the wall power.
Each reading runs the command (a few milliseconds), so the sampler runs at 5 Hz, not 50 Hz.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from device_agent.meters.base import MeterLost, SampledPowerMeter

NAME = "pi5-pmic"
SOURCE = "measured:pi5-pmic"
TIMEOUT_S = 2.0
_LINE = re.compile(r"^\s*(?P<rail>\S+)_(?P<unit>[AV])\s+(?:current|volt)\(\d+\)=(?P<value>[-+0-9.eE]+)[AV]\s*$")


def parse_pmic_read_adc(text: str) -> dict[str, float]:
    """Watts per rail that reports both a current and a voltage."""
    amps: dict[str, float] = {}
    volts: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            (amps if match["unit"] == "A" else volts)[match["rail"]] = float(match["value"])
    return {rail: volts[rail] * amps[rail] for rail in amps if rail in volts}


class Pi5PmicMeter(SampledPowerMeter):
    name = NAME
    label = SOURCE
    rate_hz = 5.0

    def __init__(self, vcgencmd: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.vcgencmd = vcgencmd
        self.detail = f"sum of V×I over the PMIC rails ({Path(vcgencmd).name} pmic_read_adc)"

    def rails_w(self) -> dict[str, float]:
        try:
            done = subprocess.run([self.vcgencmd, "pmic_read_adc"], capture_output=True, text=True,
                                  timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise MeterLost(f"vcgencmd did not answer in {TIMEOUT_S} s") from exc
        if done.returncode != 0:
            raise MeterLost(f"vcgencmd pmic_read_adc exited with {done.returncode}: {done.stderr.strip()[:200]}")
        rails = parse_pmic_read_adc(done.stdout)
        if not rails:
            raise MeterLost("vcgencmd pmic_read_adc printed no rail with both a current and a voltage")
        return rails

    def power_w(self) -> float:
        return sum(self.rails_w().values())


def detect(sysfs_root: str | Path = "/", path: str | None = None, **kwargs) -> Pi5PmicMeter | None:
    vcgencmd = shutil.which("vcgencmd", path=path)
    if vcgencmd is None:
        return None
    try:
        meter = Pi5PmicMeter(vcgencmd, **kwargs)
        meter.power_w()
        return meter
    except (MeterLost, OSError):
        return None
