"""Telemetry events: one per instruction with its measurements, a summary per step, JSON lines."""

from __future__ import annotations

import json

import psutil
import pytest

from device_agent.executor import EventStream, InstructionEvent, JsonLinesWriter, ScheduleExecutor
from device_agent.meters.memory import PeakRssSampler, RssSampler
from device_agent.meters.modelled import SOURCE, ModelledEnergyMeter
from tests.device_agent.executor.helpers import case, schedule_for


def test_every_instruction_reports_kind_node_time_bytes_ram_and_rss(tmp_path):
    current = case("mlp")
    schedule, budget = schedule_for("mlp", "mixed")
    events = EventStream()
    lines = tmp_path / "events.jsonl"
    writer = JsonLinesWriter(lines)
    events.subscribe(writer)
    meter = ModelledEnergyMeter(compute_power_w=15.0, memory_power_w=3.0, threads=2)
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path), events=events,
                          energy_meter=meter) as executor:
        for _ in range(2):
            executor.train_step(current.bundle.inputs, current.bundle.labels)
    writer.close()

    instructions = events.instructions()
    assert [(e.kind, e.node, e.location) for e in instructions[: len(schedule.instructions)]] == [
        (i.kind, i.node, i.location) for i in schedule.instructions
    ]
    nodes = current.partition.nodes
    for event in instructions:
        assert event.duration_s >= 0
        assert event.node_name == nodes[event.node].name
        assert 0 <= event.ram_in_use_bytes <= budget
        assert event.rss_bytes > 0
        if event.kind in ("page_out", "page_in"):
            assert event.bytes_moved > nodes[event.node].output_bytes  # the file: header, payload, checksum
    pages_out = [e for e in instructions if e.kind == "page_out"]
    pages_in = [e for e in instructions if e.kind == "page_in"]
    assert pages_out and pages_in
    summaries = events.steps()
    assert [s.step for s in summaries] == [0, 1]
    for summary in summaries:
        assert summary.energy_source == SOURCE == "modelled:cpu-time×power"
        assert summary.energy_j > 0 and summary.cpu_s > 0
        assert summary.page_outs == schedule.counts()["page_outs"]
        assert summary.bytes_paged_out == sum(e.bytes_moved for e in pages_out) / 2
        assert summary.peak_tracked_bytes == max(e.ram_in_use_bytes for e in instructions if e.step == summary.step)
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(records) == len(instructions) + len(summaries)
    assert {r["type"] for r in records} == {"instruction", "step"}
    assert records[-1]["energy_source"] == "modelled:cpu-time×power"


def test_rss_sampler_agrees_with_psutil():
    sampler = RssSampler()
    ours, theirs = sampler.rss_bytes(), psutil.Process().memory_info().rss
    assert abs(ours - theirs) <= 4 << 20  # the two reads are a few microseconds apart


def test_peak_sampler_sees_a_transient_allocation():
    import time

    import torch

    with PeakRssSampler(interval_s=0.0002) as sampler:
        big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        time.sleep(0.05)  # held 50 ms: on a loaded machine the sampler thread may wait that long for a core
        del big
    assert sampler.peak_bytes - sampler.start_bytes >= 32 << 20


def test_modelled_energy_is_cpu_time_times_power():
    meter = ModelledEnergyMeter(compute_power_w=8.0, memory_power_w=2.0, threads=4)
    start = meter.read()
    end = type(start)(cpu_s=start.cpu_s + 3.0, wall_s=start.wall_s + 1.0)
    energy_j, cpu_s = meter.energy_j(start, end, paging_s=0.5)
    assert cpu_s == pytest.approx(3.0)
    assert energy_j == pytest.approx(3.0 * 8.0 / 4 + 0.5 * 2.0)


def test_the_stream_holds_a_bounded_ring_while_the_file_gets_every_event(tmp_path):
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "mixed")
    capacity, steps = 40, 30
    events = EventStream(capacity=capacity)
    lines = tmp_path / "events.jsonl"
    writer = JsonLinesWriter(lines)
    events.subscribe(writer)
    held = []
    events.subscribe(lambda event: held.append(events.held))
    flash = tmp_path / "flash"
    flash.mkdir()
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(flash), events=events) as executor:
        for _ in range(steps):
            executor.train_step(current.bundle.inputs, current.bundle.labels)
    writer.close()

    per_step = len(schedule.instructions) + 1  # every instruction, then the step summary
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(records) == steps * per_step > 10 * capacity  # the file has every event
    assert max(held) == capacity == events.held  # memory held never grew past the ring
    assert events.emitted == len(records) and events.dropped == len(records) - capacity
    assert [e.to_dict() for e in events.events] == records[-capacity:]  # the ring holds the latest ones

    step_records = [r for r in records if r["type"] == "step"]
    totals = events.totals  # every step, aggregated, although most summaries were dropped
    assert len(events.steps()) < steps == totals.steps == len(step_records)
    assert totals.instructions == steps * len(schedule.instructions)
    for name in ("computes", "recomputes", "page_ins", "page_outs", "bytes_paged_out", "bytes_paged_in"):
        assert getattr(totals, name) == sum(r[name] for r in step_records)
    assert totals.computes > 0 and totals.page_outs > 0 and totals.bytes_paged_in > 0
    assert totals.duration_s == pytest.approx(sum(r["duration_s"] for r in step_records))
    assert totals.peak_tracked_bytes == max(r["peak_tracked_bytes"] for r in step_records)
    assert (totals.first_loss, totals.last_loss) == (step_records[0]["loss"], step_records[-1]["loss"])


def test_a_stream_that_keeps_nothing_still_feeds_its_subscribers():
    events = EventStream(keep=False)
    seen = []
    events.subscribe(seen.append)
    for position in range(5):
        events.emit(InstructionEvent(0, position, "free", 1, "n", "fwd", "ram", 0.0, 0, 0, 0))
    assert len(seen) == 5 and events.held == 0 and events.events == [] and events.dropped == 5
