"""The executor's step summaries carry a fixture-backed meter's figure and label, and its loss."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from device_agent.executor import EventStream, ScheduleExecutor
from device_agent.meters import ina2xx
from device_agent.meters.modelled import ModelledEnergyMeter
from tests.device_agent.executor.helpers import case, schedule_for

FIXTURES = Path(__file__).parent / "fixtures"


def test_step_summary_carries_the_measured_label_then_the_fallback(tmp_path):
    root = Path(shutil.copytree(FIXTURES / "ina2xx", tmp_path / "ina2xx"))
    logged = []
    meter = ina2xx.detect(root, fallback=ModelledEnergyMeter(8.0, 2.0, 2), log=logged.append, start_thread=False)
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "none")
    events = EventStream()
    current.reset()
    with ScheduleExecutor(current.partition, schedule, events=events, energy_meter=meter) as executor:
        first = executor.train_step(current.bundle.inputs, current.bundle.labels).summary
        (root / "sys/class/hwmon/hwmon0/power1_input").unlink()
        (root / "sys/class/hwmon/hwmon0/curr1_input").unlink()
        meter.tick()  # the sampler finds the meter gone between the steps
        second = executor.train_step(current.bundle.inputs, current.bundle.labels).summary
    # one 2.5 W sample, held over the step: energy = 2.5 W x the time between the step's two readings
    assert first.energy_source == "measured:ina2xx"
    assert first.energy_j == pytest.approx(2.5 * first.duration_s, rel=0.05, abs=2.5e-4)
    assert second.energy_source.startswith("modelled:cpu-time×power (ina2xx lost at ")
    assert second.energy_j == pytest.approx(second.cpu_s * 8.0 / 2)  # mlp "none" schedule: no paging
    assert [s.energy_source for s in events.steps()] == [first.energy_source, second.energy_source]
    assert len(logged) == 1
