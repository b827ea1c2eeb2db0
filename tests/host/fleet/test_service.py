"""The coordinator over real mutual-TLS gRPC on loopback: this test plays the boards and the operator."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from device_agent import protos
from host.fleet import certs, service
from host.fleet.server import start_coordinator
from host.fleet.store import RunStore, sqlite_url
from tests.host.fleet.helpers import solved_runs

fleet_pb2 = protos.load("poet.v1.fleet_pb2")
fleet_pb2_grpc = protos.load("poet.v1.fleet_pb2_grpc")
TIMEOUT_S = 120
MIB = 1024 * 1024
MODEL = "mlp"


def _channel(cert_dir, name, port):
    return grpc.secure_channel(f"127.0.0.1:{port}", certs.channel_credentials(cert_dir / name))


def node(cert_dir, name, port):
    return fleet_pb2_grpc.FleetStub(_channel(cert_dir, name, port))


def admin(cert_dir, port, name="alice"):
    return fleet_pb2_grpc.FleetAdminStub(_channel(cert_dir, name, port))


def facts(**overrides):
    values = dict(protocol_version=fleet_pb2.PROTOCOL_VERSION_1, platform="a72", ram_total_bytes=4096 * MIB,
                  ram_available_bytes=2048 * MIB, memory_limit_bytes=0, flash_capacity_bytes=32 * 1024 * MIB,
                  flash_free_bytes=16 * 1024 * MIB, cpu_count=4, torch_version="2.13.0", meters=["modelled"],
                  runtime_rss_bytes=300 * MIB, agent_version="test")
    values.update(overrides)
    return fleet_pb2.RegisterRequest(**values)


def register(cert_dir, port, name, **overrides):
    stub = node(cert_dir, name, port)
    reply = stub.Register(facts(**overrides), timeout=TIMEOUT_S)
    assert reply.agent_name == name
    return stub


def submit(cert_dir, port, *, agents=(), all_agents=False, budget=None, kind=fleet_pb2.JOB_KIND_TRAIN, steps=3,
           collect=fleet_pb2.COLLECT_NONE, **fields):
    request = fleet_pb2.SubmitRunRequest(model=MODEL, dataset="digits", steps=steps, agents=list(agents),
                                         all_agents=all_agents, kind=kind, optimizer=fleet_pb2.OPTIMIZER_SGD, lr=0.05,
                                         collect=collect, seed=0,
                                         ram_budget=budget or fleet_pb2.RamBudget(fraction_of_peak=1.0), **fields)
    stub = admin(cert_dir, port)
    return solved_runs(stub, stub.SubmitRun(request, timeout=TIMEOUT_S).runs)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


# ------------------------------------------------------------------------------------------ identity
def test_a_node_may_not_call_fleet_admin_and_an_operator_may_not_call_fleet(cert_dir, coordinator):
    port = coordinator.port
    as_node = fleet_pb2_grpc.FleetAdminStub(_channel(cert_dir, "pi-1", port))
    error = refused(lambda: as_node.ListAgents(fleet_pb2.ListAgentsRequest(), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "node 'pi-1'" in error.details() and "--operator" in error.details()
    as_operator = fleet_pb2_grpc.FleetStub(_channel(cert_dir, "alice", port))
    error = refused(lambda: as_operator.Register(facts(), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "operator 'alice'" in error.details() and "--node" in error.details()
    assert coordinator.store.list_agents() == []  # the operator was not registered as a board


def test_a_removed_node_is_refused(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-gone")
    ops = admin(cert_dir, coordinator.port)
    assert ops.RemoveAgent(fleet_pb2.RemoveAgentRequest(name="pi-gone"), timeout=TIMEOUT_S).removed
    assert not ops.RemoveAgent(fleet_pb2.RemoveAgentRequest(name="nobody"), timeout=TIMEOUT_S).removed
    for call in (lambda: stub.Register(facts(), timeout=TIMEOUT_S),
                 lambda: stub.Heartbeat(fleet_pb2.HeartbeatRequest(), timeout=TIMEOUT_S),
                 lambda: stub.PullJob(fleet_pb2.PullJobRequest(wait_s=0), timeout=TIMEOUT_S)):
        error = refused(call)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "poet fleet remove" in error.details() and "poet certs issue" in error.details()
    assert [a.name for a in ops.ListAgents(fleet_pb2.ListAgentsRequest(), timeout=TIMEOUT_S).agents] == []


def test_health_is_serving(cert_dir, coordinator):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(_channel(cert_dir, "alice", coordinator.port))
    for name in ("", "poet.v1.Fleet", "poet.v1.FleetAdmin"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_register_heartbeat_and_list_agents(cert_dir, coordinator):
    stub = node(cert_dir, "pi-1", coordinator.port)
    assert stub.Heartbeat(fleet_pb2.HeartbeatRequest(), timeout=TIMEOUT_S).register_again  # unknown yet
    reply = stub.Register(facts(memory_limit_bytes=512 * MIB), timeout=TIMEOUT_S)
    assert (reply.agent_name, reply.heartbeat_interval_s) == ("pi-1", service.HEARTBEAT_INTERVAL_S)
    assert reply.max_message_bytes == service.MAX_MESSAGE_BYTES and reply.model_chunk_bytes == MIB
    beat = stub.Heartbeat(fleet_pb2.HeartbeatRequest(), timeout=TIMEOUT_S)
    assert not beat.register_again and list(beat.cancel_job_ids) == []
    agents = admin(cert_dir, coordinator.port).ListAgents(fleet_pb2.ListAgentsRequest(), timeout=TIMEOUT_S).agents
    assert [(a.name, a.platform, a.online, a.memory_limit_bytes, list(a.meters)) for a in agents] == [
        ("pi-1", "a72", True, 512 * MIB, ["modelled"])]


# ------------------------------------------------------------------------------------------ submit
def test_unknown_agents_are_named_with_the_known_ones(cert_dir, coordinator):
    register(cert_dir, coordinator.port, "pi-1")
    error = refused(lambda: submit(cert_dir, coordinator.port, agents=["pi-1", "pi-9"]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pi-9" in error.details() and "known agents: pi-1" in error.details()


def test_identical_boards_cost_one_solve_and_get_the_same_schedule(cert_dir, coordinator):
    for name in ("pi-1", "pi-2"):
        register(cert_dir, coordinator.port, name)
    register(cert_dir, coordinator.port, "pi-3", platform="jetsontx2")
    runs = submit(cert_dir, coordinator.port, all_agents=True, budget=fleet_pb2.RamBudget(fraction_of_peak=0.8))
    by_agent = {r.agent: r for r in runs}
    assert sorted(by_agent) == ["pi-1", "pi-2", "pi-3"]
    assert coordinator.coordinator.solve_count == 2  # pi-1 and pi-2 share one schedule; pi-3's profile differs
    assert by_agent["pi-1"].schedule_fingerprint == by_agent["pi-2"].schedule_fingerprint
    for run in runs:
        assert run.status == fleet_pb2.RUN_STATUS_QUEUED and run.schedule_fingerprint
        assert run.predicted.step_s > 0 and run.predicted.peak_ram_bytes <= run.ram_budget_bytes
        assert run.predicted.energy_source == f"predicted:{'jetsontx2' if run.agent == 'pi-3' else 'a72'}"
    again = submit(cert_dir, coordinator.port, agents=["pi-1"], budget=fleet_pb2.RamBudget(fraction_of_peak=0.8))
    assert coordinator.coordinator.solve_count == 2 and again[0].schedule_fingerprint == by_agent["pi-1"].schedule_fingerprint


def test_a_run_may_forbid_paging_or_recomputation(cert_dir, coordinator):
    register(cert_dir, coordinator.port, "pi-1")
    tight = fleet_pb2.RamBudget(fraction_of_peak=0.8)  # the floor of this model is 75% of its peak
    [remat_only] = submit(cert_dir, coordinator.port, agents=["pi-1"], budget=tight, runtime_budget=4.0, no_paging=True)
    [paging_only] = submit(cert_dir, coordinator.port, agents=["pi-1"], budget=tight, runtime_budget=4.0, no_remat=True)
    assert remat_only.status == paging_only.status == fleet_pb2.RUN_STATUS_QUEUED
    assert remat_only.recomputes > 0 and remat_only.page_outs == 0
    assert paging_only.page_outs > 0 and paging_only.recomputes == 0
    assert coordinator.coordinator.solve_count == 2  # the cache tells the two apart
    error = refused(lambda: submit(cert_dir, coordinator.port, agents=["pi-1"], no_paging=True, no_remat=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--no-remat" in error.details()


def test_auto_budget_arithmetic_and_does_not_fit_with_the_minimum(cert_dir, coordinator):
    from host.costs import load_profile, price_graph
    from host.fleet.model_package import package_model
    from host.solver.solve import minimum_ram_bytes

    graph = package_model(MODEL, coordinator.coordinator.models_dir).graph
    floor = minimum_ram_bytes(price_graph(graph, load_profile("a72")))
    rss = 200 * MIB
    overhead = graph.with_optimizer("sgd").fixed_bytes + rss + service.AUTO_MARGIN_BYTES  # sgd: the default
    register(cert_dir, coordinator.port, "pi-1", memory_limit_bytes=overhead + floor + 1000, runtime_rss_bytes=rss)
    register(cert_dir, coordinator.port, "pi-small", memory_limit_bytes=overhead + floor // 2, runtime_rss_bytes=rss,
             ram_available_bytes=4096 * MIB)  # the limit wins over available RAM
    runs = {r.agent: r for r in submit(cert_dir, coordinator.port, agents=["pi-1", "pi-small"],
                                       budget=fleet_pb2.RamBudget(auto=True))}
    assert runs["pi-1"].status == fleet_pb2.RUN_STATUS_QUEUED
    assert runs["pi-1"].ram_budget_bytes == floor + 1000
    small = runs["pi-small"]
    assert small.status == fleet_pb2.RUN_STATUS_DOES_NOT_FIT
    assert small.min_ram_budget_bytes == floor and small.ram_budget_bytes == floor // 2
    assert "below the minimum" in small.error and str(floor) in small.error and "memory limit" in small.error
    assert not small.schedule_fingerprint
    # a board never handed a run that does not fit
    assert not node(cert_dir, "pi-small", coordinator.port).PullJob(
        fleet_pb2.PullJobRequest(wait_s=0), timeout=TIMEOUT_S).HasField("job")


# ------------------------------------------------------------------------------------------ the board's side
def _pull(stub, wait_s=5.0):
    reply = stub.PullJob(fleet_pb2.PullJobRequest(wait_s=wait_s), timeout=TIMEOUT_S)
    return reply.job if reply.HasField("job") else None


def test_pull_job_long_poll_wakes_on_submit_and_fetch_model_streams_the_archive(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    assert _pull(stub, wait_s=0.2) is None
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("job", _pull(stub, wait_s=25)))
    started = time.monotonic()
    waiter.start()
    time.sleep(0.5)
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    waiter.join(TIMEOUT_S)
    assert time.monotonic() - started < 20  # woken by the submit, not by the 25 s timeout
    job = got["job"]
    assert (job.run_id, job.kind, job.steps, job.dataset) == (run.run_id, fleet_pb2.JOB_KIND_TRAIN, 3, "digits")
    assert job.HasField("schedule") and job.HasField("grouping") and len(job.model_digest) == 64
    assert admin(cert_dir, coordinator.port).GetRun(fleet_pb2.GetRunRequest(run_id=run.run_id),
                                                    timeout=TIMEOUT_S).status == fleet_pb2.RUN_STATUS_RUNNING
    archive = (coordinator.coordinator.models_dir / f"{job.model_digest}.pt2").read_bytes()
    chunks = list(stub.FetchModel(fleet_pb2.FetchModelRequest(digest=job.model_digest), timeout=TIMEOUT_S))
    assert b"".join(c.data for c in chunks) == archive and len(archive) == job.model_size_bytes
    assert all(c.chunk_sha256 == hashlib.sha256(c.data).hexdigest() for c in chunks)
    tail = list(stub.FetchModel(fleet_pb2.FetchModelRequest(digest=job.model_digest, offset_bytes=100),
                                timeout=TIMEOUT_S))
    assert tail[0].offset_bytes == 100 and b"".join(c.data for c in tail) == archive[100:]
    error = refused(lambda: list(stub.FetchModel(fleet_pb2.FetchModelRequest(digest="0" * 64), timeout=TIMEOUT_S)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    other = register(cert_dir, coordinator.port, "pi-2")  # not assigned that model
    error = refused(lambda: list(other.FetchModel(fleet_pb2.FetchModelRequest(digest=job.model_digest),
                                                  timeout=TIMEOUT_S)))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def _events(run_id, seqs, job_id="job"):
    out = []
    for seq in seqs:
        event = fleet_pb2.TelemetryEvent(seq=seq, job_id=job_id, unix_time_s=1.0)
        if seq % 2:
            event.step.CopyFrom(fleet_pb2.StepTelemetry(step=seq, loss=1.0 / seq, duration_s=0.01))
        else:
            event.rss.CopyFrom(fleet_pb2.RssSample(rss_bytes=1000 + seq))
        out.append(event)
    return fleet_pb2.TelemetryBatch(stream_id="s1", run_id=run_id, events=out)


def test_telemetry_is_acknowledged_through_the_contiguous_prefix_and_duplicates_dropped(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    batches = [_events(run.run_id, [1, 2, 3]), _events(run.run_id, [2, 3, 5]), _events(run.run_id, [4])]
    acks = list(stub.StreamTelemetry(iter(batches), timeout=TIMEOUT_S))
    assert [(a.stream_id, a.run_id, a.stored_through_seq) for a in acks] == [
        ("s1", run.run_id, 3), ("s1", run.run_id, 3), ("s1", run.run_id, 5)]
    info = admin(cert_dir, coordinator.port).GetRun(fleet_pb2.GetRunRequest(run_id=run.run_id), timeout=TIMEOUT_S)
    assert info.events_stored == 5 and info.steps_done == 5 and info.last_loss == pytest.approx(1 / 5)
    assert [seq for seq, _ in coordinator.store.get_events(run.run_id)] == [1, 2, 3, 4, 5]
    other = register(cert_dir, coordinator.port, "pi-2")
    error = refused(lambda: list(other.StreamTelemetry(iter([_events(run.run_id, [6])]), timeout=TIMEOUT_S)))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "not assigned" in error.details()
    assert coordinator.store.acked_seq(run.run_id) == 5


def test_report_result_is_idempotent_and_stores_collected_weights(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"], collect=fleet_pb2.COLLECT_WEIGHTS)[0]
    job = _pull(stub)
    weights = _safetensors()
    result = fleet_pb2.RunResult(
        job_id=job.job_id, run_id=run.run_id, status=fleet_pb2.RUN_STATUS_DONE, loss_per_step=[2.0, 1.5, 1.25],
        accuracy_before=0.1, accuracy_after=0.6, param_digest="ab" * 32, events_emitted=42,
        measured=fleet_pb2.StepFigures(step_s=0.02, peak_ram_bytes=9000, energy_j=0.5, energy_source="modelled:x"),
        weights=fleet_pb2.WeightsRef(collect=fleet_pb2.COLLECT_WEIGHTS, digest=hashlib.sha256(weights).hexdigest(),
                                     size_bytes=len(weights), safetensors=weights))
    stub.ReportResult(result, timeout=TIMEOUT_S)
    again = fleet_pb2.RunResult()
    again.CopyFrom(result)
    again.loss_per_step[:] = [9.0]
    stub.ReportResult(again, timeout=TIMEOUT_S)  # a resend after a reconnect: accepted, changes nothing
    info = admin(cert_dir, coordinator.port).GetRun(fleet_pb2.GetRunRequest(run_id=run.run_id), timeout=TIMEOUT_S)
    assert info.status == fleet_pb2.RUN_STATUS_DONE and info.final_loss == 1.25
    assert (info.accuracy_before, info.accuracy_after, info.events_emitted) == (0.1, 0.6, 42)
    assert (info.measured.step_s, info.measured.energy_j, info.measured.energy_source) == (0.02, 0.5, "modelled:x")
    assert (coordinator.coordinator.results_dir / f"{run.run_id}.safetensors").read_bytes() == weights
    assert _pull(stub, wait_s=0) is None  # done: never handed out again
    other = register(cert_dir, coordinator.port, "pi-2")
    assert refused(lambda: other.ReportResult(result, timeout=TIMEOUT_S)).code() == grpc.StatusCode.PERMISSION_DENIED


def test_bad_weights_digest_is_refused_and_nothing_written(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"], collect=fleet_pb2.COLLECT_WEIGHTS)[0]
    _pull(stub)
    result = fleet_pb2.RunResult(run_id=run.run_id, status=fleet_pb2.RUN_STATUS_DONE,
                                 weights=fleet_pb2.WeightsRef(digest="0" * 64, safetensors=_safetensors()))
    assert refused(lambda: stub.ReportResult(result, timeout=TIMEOUT_S)).code() == grpc.StatusCode.DATA_LOSS
    assert not (coordinator.coordinator.results_dir / f"{run.run_id}.safetensors").exists()
    assert coordinator.store.get_run(run.run_id).status == "running"


def _safetensors() -> bytes:
    import numpy as np
    from safetensors.numpy import save

    return save({"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3)})


# ------------------------------------------------------------------------------------------ what a board sends
@pytest.mark.parametrize("field,value,message", [
    ("memory_limit_bytes", (1 << 64) - 1, r"memory_limit_bytes = 18446744073709551615 is over \d+ bytes \(1 PiB\)"),
    ("cpu_count", 1 << 20, r"cpu_count = 1048576 is over 4096"),
    ("ram_available_bytes", 8192 * MIB, r"ram_available_bytes = \d+ is more than ram_total_bytes"),
    ("torch_version", "2" * (5 * MIB), r"torch_version is 5242880 characters long; at most 256"),
    ("board", "pi\x1b[2J", r"board contains control characters"),
    ("meters", ["modelled"] * 17, r"17 meters reported; at most 16"),
])
def test_out_of_range_facts_are_refused_at_register_and_nothing_stored(cert_dir, coordinator, field, value, message):
    stub = node(cert_dir, "pi-1", coordinator.port)
    error = refused(lambda: stub.Register(facts(**{field: value}), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.details()), error.details()
    assert "node 'pi-1'" in error.details()
    assert coordinator.store.list_agents() == []
    register(cert_dir, coordinator.port, "pi-1")  # the same board with sane facts is welcome
    assert [a.name for a in coordinator.store.list_agents()] == ["pi-1"]


def _result(run, **fields):
    return fleet_pb2.RunResult(run_id=run.run_id, status=fleet_pb2.RUN_STATUS_DONE, **fields)


@pytest.mark.parametrize("fields,message", [
    (dict(loss_per_step=[1.0] * 6), r"loss_per_step has 6 losses for a job of 3 steps"),
    (dict(events_emitted=(1 << 64) - 1), r"events_emitted = 18446744073709551615 is over"),
    (dict(accuracy_after=1.5), r"accuracy_after = 1.5 is outside \[0, 1\]"),
    (dict(measured=fleet_pb2.StepFigures(step_s=float("nan"))), r"measured figures must be finite"),
    (dict(param_digest="xyz"), r"param_digest is not a sha256"),
    (dict(weights=fleet_pb2.WeightsRef(digest="ab" * 32, safetensors=b"7" * 100)),
     r"the job collects no weights \(collect none\), but the result carries 100 bytes"),
])
def test_a_result_is_checked_against_its_job_before_anything_is_stored(cert_dir, coordinator, fields, message):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    _pull(stub)
    error = refused(lambda: stub.ReportResult(_result(run, **fields), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.details()), error.details()
    stored = coordinator.store.get_run(run.run_id)  # failed, not running: the agent drops a refused result, and
    assert stored.status == "failed"  # a running run would be handed out and re-run forever
    assert "the coordinator refused the board's result" in stored.detail and re.search(message, stored.detail)
    assert stored.metrics.get("loss_per_step") is None  # nothing of the result was stored
    assert not (coordinator.coordinator.results_dir / f"{run.run_id}.safetensors").exists()
    assert _pull(stub, wait_s=0) is None


def test_weights_that_are_not_safetensors_are_refused_and_a_result_needs_a_pulled_job(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    garbage = b"garbage not safetensors"
    weights = fleet_pb2.WeightsRef(digest=hashlib.sha256(garbage).hexdigest(), safetensors=garbage)
    for bad, says in ((weights, "not a safetensors file"),
                      (fleet_pb2.WeightsRef(safetensors=_safetensors()), "weights.digest must be the sha256")):
        run = submit(cert_dir, coordinator.port, agents=["pi-1"], collect=fleet_pb2.COLLECT_WEIGHTS)[0]
        result = _result(run, weights=bad)
        error = refused(lambda r=result: stub.ReportResult(r, timeout=TIMEOUT_S))  # never handed out
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "is queued, not running" in error.details()
        _pull(stub)
        error = refused(lambda r=result: stub.ReportResult(r, timeout=TIMEOUT_S))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and says in error.details()
        assert not (coordinator.coordinator.results_dir / f"{run.run_id}.safetensors").exists()


def test_bf16_weights_and_an_infinite_verify_difference_are_taken(cert_dir, coordinator):
    import torch
    from safetensors.torch import save

    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"], collect=fleet_pb2.COLLECT_DELTA)[0]
    _pull(stub)
    data = save({"fc.weight": torch.ones(2, 3, dtype=torch.bfloat16)})
    stub.ReportResult(_result(run, loss_per_step=[1.0], max_rel_param_diff=float("inf"),
                              weights=fleet_pb2.WeightsRef(digest=hashlib.sha256(data).hexdigest(),
                                                           safetensors=data)), timeout=TIMEOUT_S)
    stored = coordinator.store.get_run(run.run_id)
    assert stored.status == "done" and stored.metrics["max_rel_param_diff"] is None
    assert "max_rel_param_diff is infinite" in stored.detail
    assert (coordinator.coordinator.results_dir / f"{run.run_id}.safetensors").read_bytes() == data
    json.loads(json.dumps(stored.metrics, allow_nan=False))


def test_a_diverged_loss_fails_the_run_and_its_json_stays_strict(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    _pull(stub)
    stub.ReportResult(_result(run, loss_per_step=[2.0, float("nan"), float("inf")], error="x" * (5 * MIB)),
                      timeout=TIMEOUT_S)
    stored = coordinator.store.get_run(run.run_id)
    assert stored.status == "failed"
    assert stored.metrics["loss_per_step"] == [2.0, None, None] and stored.metrics["final_loss"] is None
    assert stored.detail.startswith("the loss is nan from step 2 (it diverged); lower the learning rate")
    assert len(stored.detail) < 5000 and "more characters cut by the coordinator" in stored.detail
    json.loads(json.dumps(stored.metrics, allow_nan=False))  # strict JSON: no NaN anywhere


def test_a_profile_result_becomes_the_boards_measured_profile(cert_dir, coordinator):
    from host.costs import load_profile

    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"], kind=fleet_pb2.JOB_KIND_PROFILE)[0]
    job = _pull(stub)
    assert job.kind == fleet_pb2.JOB_KIND_PROFILE and not job.HasField("schedule")
    measured = load_profile("a72").to_dict() | {"name": "pi-1-measured", "energy_source": "measured:test"}
    bad = fleet_pb2.RunResult(run_id=run.run_id, status=fleet_pb2.RUN_STATUS_DONE, profile_json='{"name": "x"}')
    assert refused(lambda: stub.ReportResult(bad, timeout=TIMEOUT_S)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert coordinator.store.latest_profile("pi-1") is None
    result = fleet_pb2.RunResult(run_id=run.run_id, status=fleet_pb2.RUN_STATUS_DONE, profile_json=json.dumps(measured))
    stub.ReportResult(result, timeout=TIMEOUT_S)
    stub.ReportResult(result, timeout=TIMEOUT_S)
    assert coordinator.store.latest_profile("pi-1").version == 1  # the resend added no second version
    train = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    assert train.predicted.energy_source == "predicted:pi-1-measured"


def test_heartbeat_cancels_a_job_whose_run_failed(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    job = _pull(stub)
    beat = stub.Heartbeat(fleet_pb2.HeartbeatRequest(running_job_id=job.job_id), timeout=TIMEOUT_S)
    assert list(beat.cancel_job_ids) == []
    coordinator.store.update_run(run.run_id, status="failed", detail="stopped")
    beat = stub.Heartbeat(fleet_pb2.HeartbeatRequest(running_job_id=job.job_id), timeout=TIMEOUT_S)
    assert list(beat.cancel_job_ids) == [job.job_id]


# ------------------------------------------------------------------------------------------ restart
_SERVE_AND_SUBMIT = textwrap.dedent("""
    import sys
    from host.fleet.server import start_coordinator
    running = start_coordinator("127.0.0.1:0", sys.argv[1], state_dir=sys.argv[2])
    print(running.port, flush=True)
    sys.stdin.readline()  # killed before this returns
""")


@pytest.mark.slow  # a coordinator killed and restarted, ~5 s
def test_a_running_run_is_handed_out_again_after_the_coordinator_is_killed(cert_dir, tmp_path):
    from tests.host.cli.helpers import test_env

    state = tmp_path / "state"
    first = subprocess.Popen([sys.executable, "-c", _SERVE_AND_SUBMIT, str(cert_dir), str(state)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=test_env())
    try:
        port = int(first.stdout.readline())
        stub = register(cert_dir, port, "pi-1")
        run = submit(cert_dir, port, agents=["pi-1"])[0]
        job = _pull(stub)
        assert job.run_id == run.run_id
        acks = list(stub.StreamTelemetry(iter([_events(run.run_id, [1, 2])]), timeout=TIMEOUT_S))
        assert acks[-1].stored_through_seq == 2
    finally:
        first.kill()  # SIGKILL: no shutdown code runs
        first.wait(TIMEOUT_S)
    with RunStore(sqlite_url(state)) as store:
        assert store.get_run(run.run_id).status == "running"
    second = start_coordinator("127.0.0.1:0", cert_dir, state_dir=state)
    try:
        stub = register(cert_dir, second.port, "pi-1")  # the board reconnects
        again = _pull(stub)
        assert (again.run_id, again.job_id, again.model_digest) == (job.run_id, job.job_id, job.model_digest)
        assert again.schedule == job.schedule and again.grouping == job.grouping
        chunks = list(stub.FetchModel(fleet_pb2.FetchModelRequest(digest=again.model_digest), timeout=TIMEOUT_S))
        assert sum(len(c.data) for c in chunks) == again.model_size_bytes
        acks = list(stub.StreamTelemetry(iter([_events(run.run_id, [2, 3])]), timeout=TIMEOUT_S))
        assert acks[-1].stored_through_seq == 3 and second.store.events_stored(run.run_id) == 3
    finally:
        second.stop(grace_s=0)


@pytest.mark.parametrize("events,message", [
    (lambda run_id: _events(run_id, [1 << 63]).events, r"telemetry seq 9223372036854775808 is outside 1\.\.9223372036854775807"),
    (lambda run_id: _events(run_id, range(1, 5002)).events, r"a telemetry batch of 5001 events; at most 5000"),
    (lambda run_id: [fleet_pb2.TelemetryEvent(seq=1, job_id="x" * (7 * MIB))], r"seq 1 is \d+ bytes; at most 16384"),
])
def test_out_of_range_telemetry_is_invalid_argument_and_nothing_stored(cert_dir, coordinator, events, message):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    _pull(stub)
    batch = fleet_pb2.TelemetryBatch(stream_id="s1", run_id=run.run_id, events=events(run.run_id))
    error = refused(lambda: list(stub.StreamTelemetry(iter([batch]), timeout=TIMEOUT_S)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.details()), error.details()
    assert coordinator.store.acked_seq(run.run_id) == 0 and coordinator.store.get_events(run.run_id) == []
    assert run.run_id in error.details()  # the agent parks the run named and streams its others


def test_a_nan_loss_in_telemetry_is_stored_as_null(cert_dir, coordinator):
    stub = register(cert_dir, coordinator.port, "pi-1")
    run = submit(cert_dir, coordinator.port, agents=["pi-1"])[0]
    _pull(stub)
    batch = _events(run.run_id, [1])
    batch.events[0].step.loss = float("nan")
    assert [a.stored_through_seq for a in stub.StreamTelemetry(iter([batch]), timeout=TIMEOUT_S)] == [1]
    metrics = coordinator.store.get_run(run.run_id).metrics
    assert metrics["steps_done"] == 1 and metrics["last_loss"] is None


def test_lists_come_in_pages_by_count_and_by_bytes(cert_dir, coordinator, monkeypatch):
    for name in ("pi-1", "pi-2", "pi-3"):
        register(cert_dir, coordinator.port, name)
    ops = admin(cert_dir, coordinator.port)
    first = ops.ListAgents(fleet_pb2.ListAgentsRequest(page_size=2), timeout=TIMEOUT_S)
    assert [a.name for a in first.agents] == ["pi-1", "pi-2"] and first.next_page_token
    last = ops.ListAgents(fleet_pb2.ListAgentsRequest(page_size=2, page_token=first.next_page_token),
                          timeout=TIMEOUT_S)
    assert [a.name for a in last.agents] == ["pi-3"] and last.next_page_token == ""
    error = refused(lambda: ops.ListAgents(fleet_pb2.ListAgentsRequest(page_token="x" * 1000), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "start again without one" in error.details()
    monkeypatch.setattr(service, "LIST_PAGE_BYTES", 1)  # every page ends after its first entry
    names = []
    request = fleet_pb2.ListAgentsRequest()
    while True:
        reply = ops.ListAgents(request, timeout=TIMEOUT_S)
        assert len(reply.agents) == 1
        names.append(reply.agents[0].name)
        if not reply.next_page_token:
            break
        request.page_token = reply.next_page_token
    assert names == ["pi-1", "pi-2", "pi-3"]
    submit(cert_dir, coordinator.port, agents=["pi-1", "pi-2"])
    runs = ops.ListRuns(fleet_pb2.ListRunsRequest(), timeout=TIMEOUT_S)
    assert len(runs.runs) == 1 and runs.next_page_token == "1"


def test_the_operator_client_gathers_every_page(cert_dir, coordinator, monkeypatch):
    from host.fleet.client import OperatorClient

    for name in ("pi-1", "pi-2", "pi-3"):
        register(cert_dir, coordinator.port, name)
    monkeypatch.setattr(service, "LIST_PAGE_BYTES", 1)  # one agent per page
    op = OperatorClient(f"127.0.0.1:{coordinator.port}", cert_dir / "alice")
    agents = op.call_pages("ListAgents", op.pb.ListAgentsRequest(), "agents")
    assert [a.name for a in agents] == ["pi-1", "pi-2", "pi-3"]


def test_calibration_and_validation_do_not_import_the_service():
    """One way: the service drives calibration and validation, never the other way (refusals live in refusal.py)."""
    import ast
    from pathlib import Path

    import host.fleet

    folder = Path(host.fleet.__file__).parent
    for name in ("calibration", "validation", "admission", "refusal"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "host.fleet.service" not in imported, name


# ------------------------------------------------------------------------------------------ datasets
DIGITS = fleet_pb2.DatasetFacts(name="digits", item_shape=[64], item_count=1437, classes=10)


def _submit_model(cert_dir, port, model, agents, dataset="digits"):
    request = fleet_pb2.SubmitRunRequest(model=model, dataset=dataset, steps=2, agents=list(agents),
                                         kind=fleet_pb2.JOB_KIND_TRAIN, optimizer=fleet_pb2.OPTIMIZER_SGD, lr=0.05,
                                         ram_budget=fleet_pb2.RamBudget(fraction_of_peak=1.0))
    stub = admin(cert_dir, port)
    return solved_runs(stub, stub.SubmitRun(request, timeout=TIMEOUT_S).runs)


def test_a_dataset_a_board_lacks_or_of_the_wrong_shape_is_refused_at_submit(cert_dir, coordinator):
    port = coordinator.port
    register(cert_dir, port, "pi-1", datasets=[DIGITS], datasets_reported=True)
    register(cert_dir, port, "pi-2", datasets_reported=True)  # a data dir without datasets
    register(cert_dir, port, "pi-3")  # an agent that does not report its datasets: not checked
    wrong_shape = refused(lambda: _submit_model(cert_dir, port, "resnet18_cifar", ["pi-1"]))
    assert wrong_shape.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pi-1's 'digits' has samples of shape (64,), but the model takes (3, 32, 32)" in wrong_shape.details()
    missing = refused(lambda: _submit_model(cert_dir, port, "mlp", ["pi-1", "pi-2"]))
    assert "pi-2 has no dataset 'digits' (it has: none)" in missing.details()
    assert "pi-1" not in missing.details()
    assert coordinator.store.list_runs() == []  # all or nothing: pi-1's run was not created either
    runs = _submit_model(cert_dir, port, "mlp", ["pi-1", "pi-3"])
    assert sorted(r.agent for r in runs) == ["pi-1", "pi-3"]
    more_classes = fleet_pb2.DatasetFacts(name="digits", item_shape=[64], item_count=100, classes=12)
    register(cert_dir, port, "pi-2", datasets=[more_classes], datasets_reported=True)
    labels = refused(lambda: _submit_model(cert_dir, port, "mlp", ["pi-2"]))
    assert "labels up to 11, but the model has 10 classes" in labels.details()


@pytest.mark.parametrize("dataset,message", [
    (fleet_pb2.DatasetFacts(name="../etc", item_shape=[64], item_count=1, classes=2), r"invalid dataset name"),
    (fleet_pb2.DatasetFacts(name="d", item_shape=[64, 0], item_count=1, classes=2), r"item shape \[64, 0\]"),
    (fleet_pb2.DatasetFacts(name="d", item_shape=[2] * 9, item_count=1, classes=2), r"at most 8 dimensions"),
])
def test_malformed_dataset_facts_are_refused_at_register(cert_dir, coordinator, dataset, message):
    stub = node(cert_dir, "pi-1", coordinator.port)
    error = refused(lambda: stub.Register(facts(datasets=[dataset], datasets_reported=True), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.details()), error.details()
    assert coordinator.store.list_agents() == []


def test_a_run_at_block_granularity_with_compile_reaches_the_board_so(cert_dir, coordinator):
    board = register(cert_dir, coordinator.port, "pi-1")
    [run] = submit(cert_dir, coordinator.port, agents=["pi-1"], granularity="block", compile=True)
    job = board.PullJob(fleet_pb2.PullJobRequest(wait_s=5), timeout=TIMEOUT_S).job
    assert job.run_id == run.run_id and job.compile and job.grouping.granularity == "block"
    layer = submit(cert_dir, coordinator.port, agents=["pi-1"])  # the default: layer nodes, uncompiled
    spec = coordinator.coordinator.spec(coordinator.store.get_run(layer[0].run_id).job_id)
    assert (spec["granularity"], spec["compile"]) == ("layer", False)
    assert coordinator.coordinator.spec(coordinator.store.get_run(run.run_id).job_id)["granularity"] == "block"
    error = refused(lambda: submit(cert_dir, coordinator.port, agents=["pi-1"], kind=fleet_pb2.JOB_KIND_VERIFY,
                                   compile=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "bitwise" in error.details()
    error = refused(lambda: submit(cert_dir, coordinator.port, agents=["pi-1"], granularity="neuron"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "layer, block, block:N" in error.details()
    error = refused(lambda: submit(cert_dir, coordinator.port, agents=["pi-1"], granularity="block:0"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'block:0'" in error.details()
