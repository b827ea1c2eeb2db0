"""Profile versions through the coordinator: runs record the profile they were solved on, an operator can pin a
version, `poet profiles list|show|diff --json`, and a stored version with slow flash changes the next solve."""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest

from device_agent import protos
from host.fleet import certs
from tests.host.cli.helpers import POET, one_json_object, test_env

fleet_pb2 = protos.load("poet.v1.fleet_pb2")
fleet_pb2_grpc = protos.load("poet.v1.fleet_pb2_grpc")
TIMEOUT_S = 120
MIB = 1024 * 1024


def register(cert_dir, port, name):
    stub = fleet_pb2_grpc.FleetStub(grpc.secure_channel(f"127.0.0.1:{port}", certs.channel_credentials(cert_dir / name)))
    stub.Register(fleet_pb2.RegisterRequest(
        protocol_version=fleet_pb2.PROTOCOL_VERSION_1, platform="a72", ram_total_bytes=4096 * MIB,
        ram_available_bytes=2048 * MIB, flash_free_bytes=1024 * MIB, cpu_count=4, meters=["modelled"],
        runtime_rss_bytes=200 * MIB), timeout=TIMEOUT_S)
    return stub


def poet(cert_dir, coordinator, *argv):
    env = test_env() | {"POET_COORDINATOR": f"127.0.0.1:{coordinator.port}", "POET_CERTS": str(cert_dir / "alice")}
    return subprocess.run([str(POET), *argv], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def poet_json(cert_dir, coordinator, *argv):
    done = poet(cert_dir, coordinator, *argv, "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    return one_json_object(done.stdout)


def a72(**changes) -> dict:
    from host.costs import load_profile

    return load_profile("a72").to_dict() | changes


def slow_flash() -> dict:
    """a72 whose flash is 1,000 times slower each way: paging costs more than recomputing anything."""
    profile = a72(name="a72-slow-flash")
    for direction in ("page_in", "page_out"):
        profile[direction] = {"latency_s": profile[direction]["latency_s"] * 1000,
                              "throughput_bytes_per_s": profile[direction]["throughput_bytes_per_s"] / 1000}
    return profile


RUN = ("run", "--model", "mlp", "--dataset", "digits", "--steps", "3", "--batch-size", "16")


@pytest.mark.slow  # about 7-18 s: the fast suite stays under 5 minutes
def test_runs_record_their_profile_and_a_pinned_version_is_used_or_refused(cert_dir, coordinator):
    register(cert_dir, coordinator.port, "pi-1")
    store = coordinator.store
    shipped = poet_json(cert_dir, coordinator, *RUN, "--ram-budget", "100%", "--agents", "pi-1")["runs"][0]
    assert shipped["profile"] == {"name": "a72", "version": "shipped:a72"}
    store.add_profile_version("pi-1", a72(name="pi-1-v1"), provenance={"source": "test"})
    store.add_profile_version("pi-1", a72(name="pi-1-v2"))
    latest = poet_json(cert_dir, coordinator, *RUN, "--ram-budget", "100%", "--agents", "pi-1")["runs"][0]
    assert latest["profile"] == {"name": "pi-1-v2", "version": 2}
    assert latest["predicted"]["energy_source"] == "predicted:pi-1-v2"
    pinned = poet_json(cert_dir, coordinator, *RUN, "--ram-budget", "100%", "--agents", "pi-1",
                       "--profile-version", "1")["runs"][0]
    assert pinned["profile"] == {"name": "pi-1-v1", "version": 1}
    assert poet_json(cert_dir, coordinator, "runs", "show", pinned["run_id"])["profile"] == pinned["profile"]
    assert store.get_run(pinned["run_id"]).metrics["profile_version"] == 1
    refused = poet(cert_dir, coordinator, *RUN, "--ram-budget", "100%", "--agents", "pi-1", "--profile-version", "9")
    assert refused.returncode == 2 and "no profile version 9" in refused.stderr and "1, 2" in refused.stderr
    # pinning through the RPC: INVALID_ARGUMENT when a board has no such version
    admin = fleet_pb2_grpc.FleetAdminStub(grpc.secure_channel(f"127.0.0.1:{coordinator.port}",
                                                              certs.channel_credentials(cert_dir / "alice")))
    with pytest.raises(grpc.RpcError) as error:
        admin.SubmitRun(fleet_pb2.SubmitRunRequest(model="mlp", dataset="digits", steps=1, agents=["pi-1"],
                                                   ram_budget=fleet_pb2.RamBudget(fraction_of_peak=1.0),
                                                   profile_version=3), timeout=TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow  # 17 s of real `poet profiles` commands; the fast suite keeps its 5-minute margin
def test_profiles_list_show_and_diff_json(cert_dir, coordinator):
    register(cert_dir, coordinator.port, "pi-1")
    register(cert_dir, coordinator.port, "pi-2")
    assert poet_json(cert_dir, coordinator, "profiles", "list") == {"profiles": []}
    store = coordinator.store
    store.add_profile_version("pi-1", a72(name="pi-1"), provenance={"source": "profile-job", "run_id": "run-x"})
    faster = a72(name="pi-1")
    faster["compute"] = dict(faster["compute"], flops_per_s={"default": 3e9, "matmul": 5e9})
    store.add_profile_version("pi-1", faster, provenance={"source": "calibration", "step_mape_before": 40.0,
                                                          "step_mape_after": 5.0})
    store.add_profile_version("pi-2", a72(name="pi-2"))

    listed = poet_json(cert_dir, coordinator, "profiles", "list")["profiles"]
    assert [(p["agent"], p["version"], p["name"]) for p in listed] == [("pi-1", 1, "pi-1"), ("pi-1", 2, "pi-1"),
                                                                       ("pi-2", 1, "pi-2")]
    assert set(listed[0]) == {"agent", "version", "name", "created_unix_s", "provenance"}
    assert listed[0]["provenance"] == {"source": "profile-job", "run_id": "run-x"}
    only = poet_json(cert_dir, coordinator, "profiles", "list", "--agent", "pi-2")["profiles"]
    assert [(p["agent"], p["version"]) for p in only] == [("pi-2", 1)]

    shown = poet_json(cert_dir, coordinator, "profiles", "show", "pi-1")
    assert set(shown) == {"agent", "version", "name", "created_unix_s", "provenance", "profile"}
    assert shown["version"] == 2 and shown["profile"]["compute"]["flops_per_s"]["matmul"] == 5e9
    assert shown["provenance"]["step_mape_after"] == 5.0
    first = poet_json(cert_dir, coordinator, "profiles", "show", "pi-1", "--version", "1")
    assert first["version"] == 1 and first["profile"] == a72(name="pi-1")
    missing = poet(cert_dir, coordinator, "profiles", "show", "pi-1", "--version", "7")
    assert missing.returncode == 2 and "no version 7" in missing.stderr

    diff = poet_json(cert_dir, coordinator, "profiles", "diff", "pi-1", "1", "2")
    assert (diff["agent"], diff["a"], diff["b"]) == ("pi-1", 1, 2)
    by_field = {c["field"]: c for c in diff["changes"]}
    assert set(by_field) == {"compute.flops_per_s.default", "compute.flops_per_s.matmul"}
    assert by_field["compute.flops_per_s.default"] == {"field": "compute.flops_per_s.default", "a": 2e9, "b": 3e9,
                                                       "rel_change": pytest.approx(0.5)}
    assert by_field["compute.flops_per_s.matmul"]["a"] is None and by_field["compute.flops_per_s.matmul"]["rel_change"] is None
    text = poet(cert_dir, coordinator, "profiles", "diff", "pi-1", "1", "2")
    assert text.returncode == 0 and "+50.0%" in text.stdout


def test_a_stored_version_with_slow_flash_changes_the_next_solve(cert_dir, coordinator):
    """The issue's evidence: when a board's measured costs differ from the shipped profile (here its flash is
    1,000x slower than a72's), the next solve on that board pages less than on the shipped profile."""
    register(cert_dir, coordinator.port, "pi-1")
    register(cert_dir, coordinator.port, "pi-2")
    coordinator.store.add_profile_version("pi-1", slow_flash(), provenance={"source": "test"})
    runs = poet_json(cert_dir, coordinator, *RUN, "--ram-budget", "80%", "--agents", "pi-1,pi-2",
                     "--runtime-budget", "3")["runs"]
    by_agent = {r["agent"]: r for r in runs}
    slow, shipped = by_agent["pi-1"], by_agent["pi-2"]
    assert slow["status"] == shipped["status"] == "queued", json.dumps(runs, indent=1)
    assert slow["profile"] == {"name": "a72-slow-flash", "version": 1}
    assert shipped["profile"] == {"name": "a72", "version": "shipped:a72"}
    assert shipped["page_outs"] > 0, json.dumps(shipped, indent=1)
    assert slow["page_outs"] < shipped["page_outs"], json.dumps(runs, indent=1)
    assert slow["recomputes"] > shipped["recomputes"], json.dumps(runs, indent=1)
