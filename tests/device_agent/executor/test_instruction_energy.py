"""Instrumented, every instruction event carries the meter's energy over the instruction and the meter's label;
uninstrumented (training's default), only the page transfers do, and computes cost no meter reading.

The energy is the meter's figure between a reading just before and one just after the instruction
(page_out/page_in: the modelled meter adds storage power over the transfer), labelled with the meter's
source at the after reading; the intervals are disjoint and inside the step's, so a step's instructions
sum to at most its own figure, which stays the step's reading.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from device_agent import protos, serde
from device_agent.executor import EventStream, InstructionEvent, ScheduleExecutor
from device_agent.meters import ina2xx
from device_agent.meters.modelled import SOURCE, ModelledEnergyMeter
from tests.device_agent.executor.helpers import case, schedule_for

FIXTURES = Path(__file__).parents[1] / "meters" / "fixtures"
fleet = protos.load("poet.v1.fleet_pb2")


def _run(schedule, meter, tmp_path, steps: int = 2, events: EventStream | None = None,
         instrumented: bool = True) -> EventStream:
    current = case("mlp")
    events = events if events is not None else EventStream()
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path), events=events,
                          energy_meter=meter, instrumented=instrumented) as executor:
        for _ in range(steps):
            executor.train_step(current.bundle.inputs, current.bundle.labels)
    return events


def test_modelled_instruction_energy_is_its_cpu_time_plus_storage_power_over_paging(tmp_path):
    schedule, _ = schedule_for("mlp", "mixed")
    meter = ModelledEnergyMeter(compute_power_w=15.0, memory_power_w=3.0, threads=2)
    events = _run(schedule, meter, tmp_path)
    instructions = events.instructions()
    assert {e.kind for e in instructions} == {"compute", "page_out", "page_in", "free"}
    for event in instructions:
        assert event.energy_source == SOURCE
        paging = event.duration_s if event.kind in ("page_out", "page_in") else 0.0
        assert event.energy_j == pytest.approx(event.cpu_s * 15.0 / 2 + paging * 3.0, rel=1e-12, abs=1e-15)
        assert event.energy_j >= 0
    assert any(e.energy_j > 0 for e in instructions if e.kind == "compute")
    for summary in events.steps():
        own = [e for e in instructions if e.step == summary.step]
        assert len(own) == len(schedule.instructions)
        # the step's figure is its own reading (optimizer, bookkeeping and all), not the instructions' sum
        assert sum(e.energy_j for e in own) <= summary.energy_j * (1 + 1e-9)
        assert sum(e.cpu_s for e in own) <= summary.cpu_s + 1e-9


def test_without_a_meter_instructions_have_no_energy_and_no_label(tmp_path):
    schedule, _ = schedule_for("mlp", "none")
    events = _run(schedule, None, tmp_path, steps=1)
    assert events.instructions()
    for event in events.instructions():
        assert event.energy_j is None and event.energy_source == ""
        assert event.cpu_s >= 0
    assert events.steps()[0].energy_j is None


def _ina2xx(tmp_path, clock=None, logged=None):
    root = Path(shutil.copytree(FIXTURES / "ina2xx", tmp_path / "ina2xx"))
    kwargs = {} if clock is None else {"clock": clock}
    meter = ina2xx.detect(root, fallback=ModelledEnergyMeter(8.0, 2.0, 2), start_thread=False,
                          log=(logged.append if logged is not None else lambda message: None), **kwargs)
    assert meter is not None
    return root, meter


def test_a_measured_meter_charges_each_instruction_its_readings_interval(tmp_path):
    # A clock that advances 1 s per call: one 2.5 W sample held, so every reading interval is 2.5 J.
    ticks = itertools.count(0.0, 1.0)
    _, meter = _ina2xx(tmp_path, clock=lambda: next(ticks))
    schedule, _ = schedule_for("mlp", "paging")
    (tmp_path / "flash").mkdir()
    events = _run(schedule, meter, tmp_path / "flash", steps=2)
    meter.close()
    instructions = events.instructions()
    assert {e.kind for e in instructions} >= {"compute", "page_out", "page_in", "free"}
    for event in instructions:
        assert event.energy_source == "measured:ina2xx"
        assert event.energy_j == pytest.approx(2.5)  # paging_s is ignored: the measurement includes storage
    for summary in events.steps():
        own = [e for e in instructions if e.step == summary.step]
        # start, then a reading before and after each instruction, then the end: 2n + 1 intervals
        assert summary.energy_j == pytest.approx(2.5 * (2 * len(own) + 1))
        assert sum(e.energy_j for e in own) <= summary.energy_j


def test_instruction_labels_follow_a_meter_lost_mid_step(tmp_path):
    logged = []
    root, meter = _ina2xx(tmp_path, logged=logged)
    schedule, _ = schedule_for("mlp", "none")
    events = EventStream()
    lose_after = 2

    def lose_the_meter(event):
        if isinstance(event, InstructionEvent) and event.position == lose_after:
            (root / "sys/class/hwmon/hwmon0/power1_input").unlink()
            (root / "sys/class/hwmon/hwmon0/curr1_input").unlink()
            meter.tick()  # the sampler finds the meter gone

    events.subscribe(lose_the_meter)
    _run(schedule, meter, tmp_path, steps=1, events=events)
    instructions = events.instructions()
    for event in instructions[: lose_after + 1]:
        assert event.energy_source == "measured:ina2xx"
        assert event.energy_j == pytest.approx(2.5 * event.duration_s, rel=0.5, abs=5e-4)
    for event in instructions[lose_after + 1:]:
        assert event.energy_source.startswith("modelled:cpu-time×power (ina2xx lost at ")
        assert event.energy_j == pytest.approx(event.cpu_s * 8.0 / 2)
    summary = events.steps()[0]
    assert summary.energy_source.startswith("modelled:cpu-time×power (ina2xx lost at ")
    assert summary.energy_j == pytest.approx(summary.cpu_s * 8.0 / 2)  # started before the loss: modelled whole
    assert len(logged) == 1


def _instruction(**energy) -> InstructionEvent:
    return InstructionEvent(3, 7, "page_out", 4, "layer4", "fwd", "flash", 0.002, 4096, 1 << 20, 50 << 20,
                            False, 0.001, **energy)


def test_instruction_energy_and_label_cross_the_protocol():
    event = _instruction(energy_j=0.0125, energy_source="measured:ina2xx")
    message = serde.telemetry_event_to_proto(event, job_id="j1", unix_time_s=1.5)
    decoded = fleet.TelemetryEvent.FromString(message.SerializeToString())
    assert decoded.WhichOneof("event") == "instruction"
    instruction = decoded.instruction
    assert instruction.HasField("energy_j")
    assert instruction.energy_j == 0.0125 and instruction.energy_source == "measured:ina2xx"
    assert (instruction.step, instruction.position, instruction.node_name, instruction.cpu_s) == (3, 7, "layer4", 0.001)

    zero = serde.telemetry_event_to_proto(_instruction(energy_j=0.0, energy_source=SOURCE), job_id="j1",
                                          unix_time_s=1.5)
    assert zero.instruction.HasField("energy_j") and zero.instruction.energy_j == 0.0  # zero is a figure

    unmetered = serde.telemetry_event_to_proto(_instruction(), job_id="j1", unix_time_s=1.5)
    decoded = fleet.TelemetryEvent.FromString(unmetered.SerializeToString())
    assert not decoded.instruction.HasField("energy_j")
    assert decoded.instruction.energy_source == ""


class _CountingMeter(ModelledEnergyMeter):
    """The modelled meter, counting its readings."""

    readings = 0

    def read(self):
        type(self).readings += 1
        return super().read()


def test_uninstrumented_training_reads_the_meter_around_page_transfers_only(tmp_path):
    schedule, _ = schedule_for("mlp", "mixed")
    meter = _CountingMeter(compute_power_w=15.0, memory_power_w=3.0, threads=2)
    _CountingMeter.readings = 0
    events = _run(schedule, meter, tmp_path, steps=2, instrumented=False)
    instructions = events.instructions()
    transfers = [e for e in instructions if e.kind in ("page_in", "page_out")]
    assert transfers and all(e.cpu_s is not None and e.energy_j > 0 and e.energy_source == SOURCE for e in transfers)
    others = [e for e in instructions if e.kind not in ("page_in", "page_out")]
    assert others and all(e.cpu_s is None and e.energy_j is None and e.energy_source == "" for e in others)
    assert all(e.duration_s > 0 for e in instructions if e.kind == "compute")
    assert _CountingMeter.readings == 2 * len(transfers) + 2 * 2  # the transfers' pairs and each step's own pair
    step = events.steps()[-1]
    assert step.energy_j > 0 and step.energy_source == SOURCE  # the step's figure is still the meter's
    message = serde.telemetry_event_to_proto(others[0], job_id="j", unix_time_s=0.0)  # None is left unset
    assert message.instruction.cpu_s == 0.0 and not message.instruction.HasField("energy_j")
