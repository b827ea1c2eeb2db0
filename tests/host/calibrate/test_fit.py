"""Calibration from executor telemetry: fitted profiles price what the executor measured."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

from device_agent.executor import EventStream, ScheduleExecutor
from host.calibrate import CalibrationError, calibrate_profile
from host.costs import load_profile, price_graph
from host.graph.partition import partition_from_traced
from host.graph.trace import trace_model
from host.graph.zoo import get_model_spec
from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """mlp (batch 64), a schedule that pages, 21 steps of telemetry (10 fitted, 10 held out after a warm-up step:
    with 5 and 5, one run under `make test-fast` on a loaded 2-core machine fitted rates 24x off)."""
    torch.manual_seed(0)
    bundle = get_model_spec("mlp").bundle(64, seed=0)
    traced = trace_model(bundle, granularity="layer")
    priced = price_graph(traced.graph, load_profile("m0"))
    budget = 0.8 * no_remat_peak_bytes(priced)
    schedule = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, remat=False, time_limit_s=30)).schedule
    assert schedule.counts()["page_outs"] > 0
    events = EventStream()
    flash = tmp_path_factory.mktemp("flash")
    with ScheduleExecutor(partition_from_traced(traced), schedule, flash_dir=str(flash), events=events) as executor:
        for _ in range(21):
            executor.train_step(bundle.inputs, bundle.labels)
    return traced.graph, events.instructions()


def _forward_seconds(profile, graph, events) -> tuple[float, float]:
    """(predicted, measured) seconds of the forward computes in ``events``, predicted as the solver prices them
    (the profile's rates, and the fixed cost per compute and the tensor traffic calibration fits)."""
    from host.costs import price_graph

    compute_s = price_graph(graph, profile).compute_s
    predicted = measured = 0.0
    for event in events:
        node = graph.nodes[event.node]
        if event.kind == "compute" and node.kind != "bwd" and node.flops > 0:
            predicted += float(compute_s[event.node])
            measured += event.duration_s
    return predicted, measured


def _median_forward_ratio(profile, graph, events) -> float:
    """The median over steps of predicted / measured forward seconds: a step slowed by another process on a
    shared machine moves one ratio, not the median."""
    ratios = []
    for step in sorted({e.step for e in events}):
        predicted, actual = _forward_seconds(profile, graph, [e for e in events if e.step == step])
        ratios.append(predicted / actual)
    return statistics.median(ratios)


def test_calibrated_rates_price_the_measured_forward(measured):
    graph, events = measured
    wrong = load_profile("m0")  # a Cortex-M0's rates: orders of magnitude off for this machine
    # step 0 warms up; fitted and held-out steps alternate, so a burst of load elsewhere hits both alike
    fit_events = [e for e in events if e.step >= 1 and e.step % 2 == 1]
    held_out = [e for e in events if e.step >= 2 and e.step % 2 == 0]
    calibrated = calibrate_profile(wrong, graph, fit_events)
    ratio = _median_forward_ratio(calibrated, graph, held_out)
    before = _median_forward_ratio(wrong, graph, held_out)
    # Uncalibrated, the ratio was 1e3-6e4 here; calibrated 0.6-1.0 on a quiet machine, but 0.079, 0.92, 5.3 and 24 in
    # runs on a loaded 2-core machine (load bursts hit fitted and held-out steps unevenly). So the bound is a factor
    # of 50 either way: a fit whose rates are 100x off (tried) fails it, a loaded machine does not.
    assert before > 100, "the Cortex-M0 profile should misprice this machine by orders of magnitude"
    assert abs(math.log(ratio)) < math.log(50)
    assert "calibrated from executor telemetry" in calibrated.sources["compute.flops_per_s.matmul"]
    assert calibrated.path is None


def test_paging_costs_scale_to_the_measured_transfers(measured):
    graph, events = measured
    profile = load_profile("m0")
    calibrated = calibrate_profile(profile, graph, events)
    for kind in ("page_in", "page_out"):
        transfers = [e for e in events if e.kind == kind and e.step >= 1]
        assert transfers
        latency = getattr(calibrated, f"{kind}_latency_s")
        throughput = getattr(calibrated, f"{kind}_throughput_bytes_per_s")
        predicted = sum(latency + e.bytes_moved / throughput for e in transfers)
        assert predicted == pytest.approx(sum(e.duration_s for e in transfers), rel=1e-9)
        # the lowered steps also timed each transfer's part on the compute thread: priced apart, as its median
        timed = [e.compute_thread_s for e in transfers if e.compute_thread_s is not None]
        assert len(timed) == len(transfers)  # step 0, the first of its shape, ran interpreted and is skipped
        assert getattr(calibrated, f"{kind}_compute_thread_s") == pytest.approx(statistics.median(timed))
        assert getattr(calibrated, f"{kind}_compute_thread_s") > 0


def test_events_of_another_graph_are_rejected(measured):
    graph, events = measured
    renamed = [dataclasses.replace(e, node_name="not-" + e.node_name) for e in events]
    with pytest.raises(CalibrationError, match="does not match graph"):
        calibrate_profile(load_profile("m0"), graph, renamed)


def test_warm_up_only_telemetry_is_rejected(measured):
    graph, events = measured
    with pytest.raises(CalibrationError, match="train more steps"):
        calibrate_profile(load_profile("m0"), graph, [e for e in events if e.step == 0])


def test_cpu_time_of_page_transfers_is_priced_into_paging_power(measured):
    graph, events = measured
    profile = load_profile("m0")
    transfers = [e for e in events if e.kind in ("page_in", "page_out") and e.step >= 1]
    cpu_s = sum(e.cpu_s for e in transfers)
    wall_s = sum(e.duration_s for e in transfers)
    assert cpu_s > 0  # the executor checksums and copies every page: that is CPU work
    calibrated = calibrate_profile(profile, graph, events, cpu_power_w_per_thread=5.0)
    assert calibrated.memory_power_w == pytest.approx(profile.memory_power_w + cpu_s / wall_s * 5.0)
    assert "CPU busy" in calibrated.sources["memory_power_w"]
    assert calibrate_profile(profile, graph, events).memory_power_w == profile.memory_power_w
