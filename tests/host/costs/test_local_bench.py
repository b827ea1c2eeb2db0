"""Local machine benchmark (``poet profile --local``): quick mode, clean-up, clear errors."""

from __future__ import annotations

import os
import time

import pytest

from device_agent import profiling as local_bench
from device_agent.profiling import LocalBenchError, fit_latency_throughput
from host.costs.local_bench import profile_local_machine
from host.costs.pricing import price_graph
from host.costs.profile import OP_CLASSES, PlatformProfile, load_profile, save_profile
from host.graph.training_graph import GraphBuilder


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    flash_dir = tmp_path_factory.mktemp("flash")
    messages: list[str] = []
    start = time.perf_counter()
    profile = profile_local_machine(str(flash_dir), name="bench-test", quick=True, progress=messages.append)
    elapsed_s = time.perf_counter() - start
    return profile, flash_dir, messages, elapsed_s


def test_quick_mode_produces_a_valid_profile(quick_profile, tmp_path):
    profile, _, messages, elapsed_s = quick_profile
    assert elapsed_s < 10.0  # budget ~5 s; slack for a loaded CI machine
    assert profile.name == "bench-test"
    for op_class in ("default", "matmul", "conv", "elementwise", "norm", "pool"):
        assert profile.flops_per_s[op_class] > 0
    assert set(profile.flops_per_s) <= {"default", *OP_CLASSES}
    assert profile.page_in_latency_s >= 0 and profile.page_out_latency_s >= 0
    assert profile.page_in_throughput_bytes_per_s > 0 and profile.page_out_throughput_bytes_per_s > 0
    assert profile.energy_per_flop_j is None
    assert profile.energy_source == "modelled:cpu-time×power"
    assert profile.compute_power_w > 0 and profile.memory_power_w > 0
    assert "ASSUMPTION" in profile.sources["compute.compute_power_w"]
    assert "modelled" in profile.description and "CPUs" in profile.description
    assert any("compute matmul" in m for m in messages) and any("paging" in m for m in messages)
    # Saved and reloaded like any user profile, then usable for pricing.
    target = tmp_path / "local.json"
    save_profile(profile, target)
    loaded = load_profile(str(target))
    assert loaded.flops_per_s == profile.flops_per_s
    builder = GraphBuilder("g")
    builder.add("x", "fwd", 4096, 10**6, op_class="matmul")
    priced = price_graph(builder.build(), loaded)
    assert priced.compute_j[0] == pytest.approx(priced.compute_s[0] * profile.compute_power_w)


def test_flash_dir_is_left_empty(quick_profile):
    _, flash_dir, _, _ = quick_profile
    assert os.listdir(flash_dir) == []


def test_power_overrides_are_used(tmp_path, monkeypatch):
    monkeypatch.setattr(local_bench, "measure_compute_flops_per_s", lambda **_: ({"default": 1e9}, {}))
    profile = profile_local_machine(str(tmp_path), quick=True, compute_power_w=2.5, memory_power_w=0.5)
    assert (profile.compute_power_w, profile.memory_power_w, profile.board_power_w) == (2.5, 0.5, 2.5)
    assert profile.sources["compute.compute_power_w"] == "given by the user (compute_power_w)"
    assert os.listdir(tmp_path) == []


def test_missing_flash_dir_fails_clearly_and_fast(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    start = time.perf_counter()
    with pytest.raises(LocalBenchError) as info:
        profile_local_machine(missing, quick=True)
    assert time.perf_counter() - start < 1.0  # checked before the compute benchmark
    message = str(info.value)
    assert missing in message and "does not exist" in message and "mkdir -p" in message and "--flash-dir" in message
    assert not os.path.exists(missing)


def test_flash_dir_that_is_a_file_fails_clearly(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(LocalBenchError, match="is not a directory"):
        profile_local_machine(str(not_a_dir), quick=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_flash_dir_fails_clearly(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        with pytest.raises(LocalBenchError, match="not writable"):
            profile_local_machine(str(read_only), quick=True)
    finally:
        read_only.chmod(0o700)


def test_non_writable_flash_dir_message_names_it_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(local_bench.os, "access", lambda path, mode: False)
    with pytest.raises(LocalBenchError) as info:
        profile_local_machine(str(tmp_path), quick=True)
    message = str(info.value)
    assert str(tmp_path) in message and "not writable" in message and "chmod u+w" in message
    assert "--flash-dir" in message


def test_files_are_removed_even_when_the_benchmark_fails(tmp_path, monkeypatch):
    def broken_read(path, size_bytes):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local_bench, "_read_file_s", broken_read)
    with pytest.raises(LocalBenchError, match="paging benchmark in flash dir .* failed"):
        local_bench.measure_paging(str(tmp_path), quick=True)
    assert os.listdir(tmp_path) == []


def test_fit_recovers_latency_and_throughput():
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    latency_s, throughput = fit_latency_throughput(sizes, [2e-4 + s / 5e7 for s in sizes])
    assert latency_s == pytest.approx(2e-4, rel=1e-6)
    assert throughput == pytest.approx(5e7, rel=1e-9)


def test_fit_clamps_negative_latency_and_handles_flat_data():
    sizes = [1000, 2000, 3000]
    latency_s, throughput = fit_latency_throughput(sizes, [0.0, 1.5e-3, 3.0e-3])  # intercept -1.5e-3
    assert latency_s == 0.0 and throughput > 0
    latency_s, throughput = fit_latency_throughput(sizes, [1e-3, 1e-3, 1e-3])  # slope 0
    assert latency_s == 0.0 and throughput == pytest.approx(6000 / 3e-3)


def test_profile_validates_like_a_file(quick_profile):
    profile = quick_profile[0]
    assert PlatformProfile.from_dict(profile.to_dict()) == profile


def test_the_board_writes_the_profile_schema_the_host_reads():
    from device_agent.profiling import PROFILE_SCHEMA_VERSION
    from host.costs.profile import SCHEMA_VERSION

    assert PROFILE_SCHEMA_VERSION == SCHEMA_VERSION
