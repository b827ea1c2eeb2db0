"""The board's facts: cgroup memory limits (fake cgroup trees and this machine's), sizes, meters, RSS."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest

from device_agent.agent import facts
from device_agent.agent.credentials import CertError, channel_credentials, load_bundle


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> dict:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc)
    return {"proc_cgroup": tmp_path / "proc_cgroup", "cgroup_root": root}


def test_cgroup_v2_own_limit_and_max(tmp_path):
    paths = _tree(tmp_path, "0::/system.slice/poet-agent.service\n", {
        "cgroup.controllers": "cpu memory",
        "system.slice/poet-agent.service/memory.max": "536870912\n",
        "system.slice/memory.max": "max\n",
    })
    limit, source = facts.cgroup_memory_limit(**paths)
    assert limit == 512 * 1024**2
    assert source.endswith("system.slice/poet-agent.service/memory.max")
    (paths["cgroup_root"] / "system.slice/poet-agent.service/memory.max").write_text("max\n")
    assert facts.cgroup_memory_limit(**paths) == (None, "")


def test_cgroup_v2_parent_limit_binds(tmp_path):
    paths = _tree(tmp_path, "0::/a/b\n", {"cgroup.controllers": "memory", "a/memory.max": "1000000",
                                          "a/b/memory.max": "5000000"})
    assert facts.cgroup_memory_limit(**paths)[0] == 1000000


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    proc = "12:memory:/process_api/x\n4:cpu,cpuacct:/\n0::/\n"
    paths = _tree(tmp_path, proc, {"memory/process_api/x/memory.limit_in_bytes": "268435456",
                                   "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert facts.cgroup_memory_limit(**paths)[0] == 256 * 1024**2
    (paths["cgroup_root"] / "memory/process_api/x/memory.limit_in_bytes").write_text("9223372036854771712")
    assert facts.cgroup_memory_limit(**paths)[0] is None


def test_cgroup_namespace_path_not_visible_uses_mount_root(tmp_path):
    # In a container /proc/self/cgroup may name a host path; the mount's own top is this cgroup.
    paths = _tree(tmp_path, "0::/../../host/path\n", {"cgroup.controllers": "memory", "memory.max": "4096000"})
    assert facts.cgroup_memory_limit(**paths)[0] == 4096000


def test_cgroup_missing_files(tmp_path):
    assert facts.cgroup_memory_limit(tmp_path / "nope", tmp_path) == (None, "")


def test_memory_limit_takes_the_smaller_and_says_which(tmp_path):
    paths = _tree(tmp_path, "0::/a\n", {"cgroup.controllers": "memory", "a/memory.max": "2000000000"})
    cgroup = facts.memory_limit(None, **paths)
    assert cgroup.bytes == 2_000_000_000 and cgroup.source.startswith("cgroup ")
    smaller = facts.memory_limit(1_000_000_000, **paths)
    assert smaller.bytes == 1_000_000_000 and smaller.source.startswith("--memory-limit")
    assert "cgroup allows 2.0 GB" in smaller.source
    larger = facts.memory_limit(3_000_000_000, **paths)
    assert larger.bytes == 2_000_000_000 and "smaller than --memory-limit" in larger.source
    assert "memory limit 2.0 GB from cgroup" in larger.describe()
    none = facts.memory_limit(None, proc_cgroup=tmp_path / "nope", cgroup_root=tmp_path)
    assert none.bytes is None and none.describe() == "no memory limit"


def test_this_machine_matches_its_cgroup_files():
    limit, source = facts.cgroup_memory_limit()
    if limit is None:
        assert source == ""
    else:
        assert Path(source).read_text().strip() == str(limit)
        assert 0 < limit < 1 << 60


@pytest.mark.parametrize("text, expected", [
    ("536870912", 536870912), ("512M", 512 * 1024**2), ("2G", 2 * 1024**3), ("512MiB", 512 * 1024**2),
    ("1.5GB", 1_500_000_000), ("64k", 65536), (" 1 GiB ", 1024**3), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert facts.parse_bytes(text) == expected


@pytest.mark.parametrize("text, why", [
    ("0", "more than 0"), ("-5M", "negative"), ("nan", "not a number"), ("inf", "not a number"),
    ("12 parsecs", "unknown unit"), ("lots", "not a size"), (float("nan"), "finite"), ("", "not a size"),
])
def test_parse_bytes_refuses(text, why):
    with pytest.raises(ValueError, match=why):
        facts.parse_bytes(text)


def test_meters_registry(tmp_path):
    """RegisterRequest.meters comes from the meters' registry: names best first, "modelled" when none."""
    fixtures = Path(__file__).parents[1] / "meters" / "fixtures"
    assert facts.detect_meters(tmp_path, path=str(tmp_path)) == ["modelled"]
    assert facts.detect_meters(fixtures / "rapl", path=str(tmp_path)) == ["rapl"]
    assert facts.detect_meters(fixtures / "jetson_jp4", path=str(tmp_path)) == ["ina3221"]
    both = tmp_path / "both"
    shutil.copytree(fixtures / "rapl", both)
    shutil.copytree(fixtures / "jetson_jp5", both, dirs_exist_ok=True)
    assert facts.detect_meters(both, path=str(fixtures / "pi5" / "bin")) == ["ina3221", "pi5-pmic", "rapl"]
    (tmp_path / "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0").mkdir(parents=True)  # a driver, no rails
    assert facts.detect_meters(tmp_path, path=str(tmp_path)) == ["modelled"]


def test_collect_facts_on_this_machine(tmp_path):
    from device_agent.protos import load

    fleet_pb2 = load("poet.v1.fleet_pb2")
    board = facts.collect_facts(platform="local", flash_dir=tmp_path, memory_limit_override=123_000_000)
    assert board.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < board.ram_available_bytes <= board.ram_total_bytes
    assert board.cpu_count == len(os.sched_getaffinity(0))
    assert 0 < board.flash_free_bytes <= board.flash_capacity_bytes
    assert board.memory_limit.bytes == 123_000_000  # no cgroup here is tighter than 123 MB
    import torch

    assert board.torch_version == torch.__version__
    assert board.runtime_rss_bytes > 50_000_000  # torch is loaded
    request = board.register_request(fleet_pb2)
    assert request.memory_limit_bytes == 123_000_000 and request.platform == "local"
    assert request.protocol_version == fleet_pb2.PROTOCOL_VERSION_1 and list(request.meters)
    assert request.agent_version == board.agent_version != ""


def test_bundle_errors_name_missing_files_and_the_fix(tmp_path):
    with pytest.raises(CertError, match="does not exist"):
        load_bundle(tmp_path / "absent")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(CertError, match=r"cert\.pem, key\.pem missing.*poet certs issue --dir DIR --node NAME"):
        load_bundle(tmp_path)
    (tmp_path / "cert.pem").write_text("garbage")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(CertError, match=r"cert\.pem is not a PEM file"):
        channel_credentials(tmp_path)


def test_host_certs_uses_the_same_bundle_code():
    from host.fleet import certs

    assert certs.load_bundle is load_bundle and certs.CertError is CertError
    assert certs.channel_credentials is channel_credentials


def test_a_board_trains_on_all_but_one_core_unless_omp_num_threads_says_otherwise():
    from device_agent.agent.facts import cpu_count, default_training_threads

    assert default_training_threads({}) == max(1, cpu_count() - 1)
    assert default_training_threads({"OMP_NUM_THREADS": "4"}) is None  # the operator's choice: torch reads it


def test_register_reports_the_data_dirs_usable_datasets(tmp_path):
    """A board tells the coordinator what it can train on (name, sample shape, samples, classes); a broken dataset
    is left out, and a board started without a data dir reports nothing (so nothing is checked at submit)."""
    pytest.importorskip("sklearn")
    from device_agent._generated.poet.v1 import fleet_pb2
    from device_agent.agent.demo_data import make_demo

    made = make_demo(tmp_path, "digits")
    (tmp_path / "broken").mkdir()  # no shards: `poet-agent datasets list` flags it
    board = facts.collect_facts(platform="local", flash_dir=tmp_path, measure_rss=False, data_dir=tmp_path)
    request = board.register_request(fleet_pb2)
    assert request.datasets_reported
    assert [(d.name, list(d.item_shape), d.item_count, d.classes) for d in request.datasets] == [
        ("digits", [64], len(made), 10)]
    silent = facts.collect_facts(platform="local", flash_dir=tmp_path, measure_rss=False)
    assert not silent.register_request(fleet_pb2).datasets_reported
