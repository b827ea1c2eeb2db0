"""The agent loop against a Fleet test double on real mutual TLS: register, jobs, results, reconnects, refusals."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from device_agent.agent import facts as board_facts
from device_agent.agent.client import EXIT_OK, EXIT_REFUSED, Agent, AgentConfig, Backoff
from device_agent.agent.results import RESULT_FILE
from device_agent.agent.telemetry import BUFFER_FILE, TelemetrySink
from tests.device_agent.agent.fleet_double import FakeFleet, Server, fleet_pb2, make_certs, wait_until

AGENT_BIN = Path(sys.executable).parent / "poet-agent"


@pytest.fixture(scope="module")
def cert_root(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs") / "fleet", "node-a", "node-b")


@pytest.fixture
def server(cert_root):
    srv = Server(cert_root, FakeFleet(heartbeat_interval_s=0.1)).start()
    yield srv
    srv.stop()


class FakeRunner:
    """Stands in for the lead's JobRunner: steps, telemetry, progress, cancel; records what it was given."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.calls: list[tuple[str, Path | None]] = []
        self.started = threading.Event()

    def run(self, job, model_path, telemetry, cancel, progress=None):
        self.calls.append((job.job_id, model_path))
        if model_path is not None:
            assert model_path.is_file()
        self.started.set()
        for step in range(job.steps):
            if cancel.is_set():
                return fleet_pb2.RunResult(job_id=job.job_id, run_id=job.run_id, status=fleet_pb2.RUN_STATUS_FAILED,
                                           error=f"cancelled at step {step}", events_emitted=telemetry.emitted)
            telemetry.emit(fleet_pb2.TelemetryEvent(job_id=job.job_id, step=fleet_pb2.StepTelemetry(step=step)))
            if progress:
                progress(step + 1)
            time.sleep(self.step_s)
        return fleet_pb2.RunResult(job_id=job.job_id, run_id=job.run_id, status=fleet_pb2.RUN_STATUS_DONE,
                                   loss_per_step=[1.0 / (s + 1) for s in range(job.steps)],
                                   events_emitted=telemetry.emitted)


class Running:
    """An Agent on a thread, its stderr captured."""

    def __init__(self, cert_root, target, tmp, *, node="node-a", runner=None, max_backoff_s=0.3, max_events=10**5):
        for name in ("flash", "data", "state"):
            (tmp / name).mkdir(exist_ok=True)
        self.stderr = io.StringIO()
        config = AgentConfig(coordinator=target, certs=cert_root / node, flash_dir=tmp / "flash",
                             data_dir=tmp / "data", state_dir=tmp / "state", max_backoff_s=max_backoff_s,
                             pull_wait_s=1.0, max_events_per_run=max_events)
        facts = board_facts.collect_facts(platform="local", flash_dir=tmp / "flash",
                                          memory_limit_override=64 * 1024**2, measure_rss=False)
        self.runner = runner or FakeRunner()
        self.agent = Agent(config, runner=self.runner, stderr=self.stderr, facts=facts)
        self.code = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.code = self.agent.run()

    @property
    def log(self) -> str:
        return self.stderr.getvalue()

    def stop(self, code=EXIT_OK) -> int:
        self.agent.request_stop(code)
        self.thread.join(15)
        assert not self.thread.is_alive(), self.log
        return self.code


def _job(fleet: FakeFleet, job_id="job-1", run_id="run-1", steps=5, data: bytes | None = b"", kind=None):
    job = fleet_pb2.Job(job_id=job_id, run_id=run_id, kind=kind or fleet_pb2.JOB_KIND_TRAIN, steps=steps)
    if data is not None:
        data = data or os.urandom(5000)
        job.model_digest = fleet.add_model(data)
        job.model_size_bytes = len(data)
    return job


# ------------------------------------------------------------------------------------------- backoff
def test_backoff_full_jitter_doubles_to_the_cap():
    class Top(random.Random):
        def uniform(self, a, b):
            return b

    top = Backoff(base_s=1.0, max_s=20.0, rng=Top())
    assert [top.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 20, 20, 20]
    top.reset()
    assert top.next_delay() == 1
    jitter = Backoff(base_s=1.0, max_s=20.0, rng=random.Random(7))
    draws = [(jitter.cap_s(), jitter.next_delay()) for _ in range(400)]
    assert all(0 <= delay <= cap for cap, delay in draws)
    late = [delay for cap, delay in draws[10:]]
    assert max(late) > 15 and min(late) < 5  # uniform over [0, 20], not bunched at the cap
    assert Backoff(base_s=1.0, max_s=0.25, rng=Top()).next_delay() == 0.25  # a short cap wins over the base
    with pytest.raises(ValueError):
        Backoff(max_s=0)


# ------------------------------------------------------------------------------------------- the loop
def test_job_runs_and_its_telemetry_and_result_arrive(cert_root, server, tmp_path):
    fleet = server.fleet
    job = _job(fleet, steps=6)
    fleet.jobs.append(job)
    runner = FakeRunner(step_s=0.05)
    agent = Running(cert_root, server.target, tmp_path, runner=runner)
    try:
        wait_until(lambda: fleet.results, what="the result")
        result = fleet.results[0]
        assert result.status == fleet_pb2.RUN_STATUS_DONE and result.run_id == "run-1" and result.events_emitted == 6
        wait_until(lambda: fleet.stored("run-1") == list(range(1, 7)), what="six events stored")
        assert runner.calls == [("job-1", tmp_path / "state/models" / f"{job.model_digest}.pt2")]
        name, request = fleet.registrations[0]
        assert name == "node-a" and request.platform == "local" and request.memory_limit_bytes == 64 * 1024**2
        assert any(h.running_job_id == "job-1" and h.running_step > 0 for h in fleet.heartbeats)
        assert "[agent node-a] registered with 127.0.0.1:" in agent.log
        assert "(platform local, memory limit 67.1 MB)" in agent.log
        wait_until(lambda: "reported the result of run run-1 (DONE)" in agent.log, what="the report logged")
        wait_until(lambda: not (tmp_path / "state/runs/run-1/telemetry.db").exists(), what="the buffer retired")
        assert not (tmp_path / "state/runs/run-1" / RESULT_FILE).exists()
    finally:
        assert agent.stop() == EXIT_OK
    assert all(line.startswith("[agent node-a] ") for line in agent.log.splitlines())


def test_reconnects_after_the_coordinator_restarts_on_the_same_port(cert_root, server, tmp_path):
    agent = Running(cert_root, server.target, tmp_path)
    try:
        wait_until(lambda: "registered with" in agent.log, what="registration")
        server.stop()
        wait_until(lambda: "unreachable" in agent.log, what="the outage noticed")
        assert "retrying in" in agent.log
        server.fleet.jobs.append(_job(server.fleet, steps=2))
        server.start()
        wait_until(lambda: agent.log.count("registered with") >= 2, what="registering again")
        wait_until(lambda: server.fleet.results, what="the job after the restart")
    finally:
        agent.stop()


def test_pending_result_is_sent_after_a_restart_before_pulling(cert_root, server, tmp_path):
    fleet = server.fleet
    fleet.jobs.append(_job(fleet, steps=3))
    fleet.fail_reports = 10**6
    first = Running(cert_root, server.target, tmp_path)
    wait_until(lambda: (tmp_path / "state/runs/run-1" / RESULT_FILE).exists(), what="the result saved")
    assert first.stop() == EXIT_OK
    assert fleet.results == []
    assert (tmp_path / "state/runs/run-1" / RESULT_FILE).exists()  # survived the agent
    fleet.fail_reports = 0
    fleet.calls.clear()
    second = Running(cert_root, server.target, tmp_path)
    try:
        wait_until(lambda: fleet.results, what="the saved result re-sent")
        assert fleet.results[0].run_id == "run-1" and fleet.results[0].status == fleet_pb2.RUN_STATUS_DONE
        wait_until(lambda: "PullJob" in fleet.calls, what="a pull")
        assert fleet.calls.index("ReportResult") < fleet.calls.index("PullJob")  # re-sent before pulling
        assert not (tmp_path / "state/runs/run-1" / RESULT_FILE).exists()
        assert "1 result(s) from before the restart" in second.log
        assert fleet.stored("run-1") == [1, 2, 3]
    finally:
        second.stop()


def test_a_run_resumed_after_a_restart_numbers_on_even_with_every_event_acknowledged(cert_root, server, tmp_path):
    """Issue 17, part 2: the agent died mid-run after every event was acknowledged. Its restart used to delete the
    drained buffer; the resumed run then numbered from 1 again and the coordinator dropped those seqs unseen."""
    (tmp_path / "state").mkdir()
    before = TelemetrySink(tmp_path / "state", log=lambda _m: None)
    run = before.for_run("run-k")
    run.emit_many([fleet_pb2.TelemetryEvent(job_id="job-k", step=fleet_pb2.StepTelemetry(step=s)) for s in (1, 2, 3)])
    stream = run.buffer.stream_id
    before.apply_ack("run-k", stream, 3)
    before.close()  # kill -9
    fleet = server.fleet
    fleet.events[(stream, "run-k")] = {seq: fleet_pb2.TelemetryEvent(seq=seq) for seq in (1, 2, 3)}  # stored before
    fleet.jobs.append(_job(fleet, job_id="job-k", run_id="run-k", steps=4))
    agent = Running(cert_root, server.target, tmp_path)
    try:
        wait_until(lambda: fleet.results, what="the resumed run's result")
        assert fleet.results[0].events_emitted == 3 + 4
        wait_until(lambda: fleet.stored("run-k") == [1, 2, 3, 4, 5, 6, 7],
                   what="seqs 4..7 stored after 1..3")
        assert {b.stream_id for b in fleet.batches if b.run_id == "run-k"} == {stream}
        # Retired once the result is reported and every event acknowledged.
        wait_until(lambda: not (tmp_path / "state/runs/run-k" / BUFFER_FILE).exists(), what="the buffer retired")
    finally:
        agent.stop()


def test_coordinator_cancel_is_reported_and_stop_is_not(cert_root, server, tmp_path):
    fleet = server.fleet
    fleet.jobs.append(_job(fleet, job_id="job-c", run_id="run-c", steps=1000))
    runner = FakeRunner(step_s=0.02)
    agent = Running(cert_root, server.target, tmp_path, runner=runner)
    try:
        assert runner.started.wait(10)
        fleet.cancel_job_ids.add("job-c")
        wait_until(lambda: fleet.results, what="the cancelled job's result")
        assert fleet.results[0].status == fleet_pb2.RUN_STATUS_FAILED and "cancelled" in fleet.results[0].error
        assert "the coordinator cancelled job job-c" in agent.log
        fleet.cancel_job_ids.clear()
        runner.started.clear()
        fleet.jobs.append(_job(fleet, job_id="job-s", run_id="run-s", steps=1000))
        assert runner.started.wait(10)
    finally:
        code = agent.stop()
    assert code == EXIT_OK
    assert [r.run_id for r in fleet.results] == ["run-c"]  # the job stopped by the agent's own shutdown resumes later
    assert "job job-s interrupted; it resumes from its checkpoint" in agent.log
    assert not (tmp_path / "state/runs/run-s" / RESULT_FILE).exists()


def test_stop_while_training_waits_on_a_full_telemetry_buffer(cert_root, server, tmp_path):
    fleet = server.fleet
    fleet.hold_acks.set()
    fleet.jobs.append(_job(fleet, steps=1000))
    agent = Running(cert_root, server.target, tmp_path, max_events=5)
    wait_until(lambda: "telemetry buffer full for run run-1" in agent.log, what="back-pressure")
    assert agent.stop() == EXIT_OK  # does not hang on the blocked emit
    assert "job job-1 interrupted" in agent.log and fleet.results == []


def test_register_again_when_the_coordinator_asks(cert_root, server, tmp_path):
    agent = Running(cert_root, server.target, tmp_path)
    try:
        wait_until(lambda: server.fleet.heartbeats, what="a heartbeat")
        server.fleet.register_again_once = True
        wait_until(lambda: len(server.fleet.registrations) >= 2, what="a second registration")
    finally:
        agent.stop()


def test_model_failures_become_failed_results(cert_root, server, tmp_path):
    fleet = server.fleet
    fleet.corrupt_calls = 100
    fleet.jobs.append(_job(fleet, steps=2))
    runner = FakeRunner()
    agent = Running(cert_root, server.target, tmp_path, runner=runner)
    try:
        wait_until(lambda: fleet.results, what="the failed result")
        result = fleet.results[0]
        assert result.status == fleet_pb2.RUN_STATUS_FAILED and "arrived corrupted 3 times" in result.error
        assert runner.calls == []  # never trained on a corrupted model
        assert list((tmp_path / "state/models").iterdir()) == []
    finally:
        agent.stop()


def test_profile_jobs_need_no_model_and_runner_errors_are_one_line(cert_root, server, tmp_path):
    class Broken(FakeRunner):
        def run(self, job, model_path, telemetry, cancel, progress=None):
            self.calls.append((job.job_id, model_path))
            raise RuntimeError("the board\nexploded")

    fleet = server.fleet
    fleet.jobs.append(_job(fleet, data=None, kind=fleet_pb2.JOB_KIND_PROFILE))
    runner = Broken()
    agent = Running(cert_root, server.target, tmp_path, runner=runner)
    try:
        wait_until(lambda: fleet.results, what="the failed result")
        assert runner.calls == [("job-1", None)]
        assert fleet.results[0].error == "RuntimeError: the board exploded"
    finally:
        agent.stop()


# ------------------------------------------------------------------------------------------- the command
def _agent_cmd(cert_root, target, tmp_path, node="node-a", *extra):
    for name in ("flash", "data", "state"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
    return [str(AGENT_BIN), "run", "--coordinator", target, "--certs", str(cert_root / node),
            "--flash-dir", str(tmp_path / "flash"), "--data-dir", str(tmp_path / "data"),
            "--state-dir", str(tmp_path / "state"), "--max-backoff-s", "0.5", *extra]


def _wait_line(proc, needle: str, timeout_s: float = 30.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    proc.kill()
    raise AssertionError(f"no {needle!r} in: {''.join(lines)}")


@pytest.mark.slow  # two agent processes, ~5 s
def test_removed_node_exits_with_code_3_and_sigterm_exits_0(cert_root, server, tmp_path):
    server.fleet.denied.add("node-b")
    refused = subprocess.run(_agent_cmd(cert_root, server.target, tmp_path / "b", "node-b"), capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert "agent node-b was removed from the fleet" in refused.stderr
    assert "exiting with code 3" in refused.stderr
    assert refused.stderr.count("refused by the coordinator") == 1  # no retry loop

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the agent's own default threads
    proc = subprocess.Popen(_agent_cmd(cert_root, server.target, tmp_path / "a", "node-a", "--memory-limit", "1G"),
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = _wait_line(proc, "registered with")
        assert lines[-1].startswith(f"[agent node-a] registered with {server.target} (platform local, memory limit")
        cores = len(os.sched_getaffinity(0))  # one core stays for the agent's own threads
        assert f"training on {max(1, cores - 1)} of {cores} core(s)" in "".join(lines)
        proc.terminate()
        assert proc.wait(30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        proc.kill()


def test_wrong_ca_is_logged_on_every_retry(tmp_path_factory, server, tmp_path):
    other = make_certs(tmp_path_factory.mktemp("other") / "fleet", "node-a")
    proc = subprocess.Popen(_agent_cmd(other, server.target, tmp_path), stderr=subprocess.PIPE, text=True)
    try:
        _wait_line(proc, "retrying in")
        lines = _wait_line(proc, "retrying in")
        assert "unreachable (TLS handshake failed" in lines[-1] and "CERTIFICATE_VERIFY_FAILED" in lines[-1]
        assert all(line.startswith("[agent node-a] ") for line in lines), lines  # gRPC's own logging stays quiet
        proc.send_signal(2)
        assert proc.wait(30) == 130
    finally:
        proc.kill()


@pytest.mark.parametrize("change, message", [
    ({"--coordinator": "no-port"}, "is not HOST:PORT"),
    ({"--certs": "MISSING"}, "does not exist or is not a directory"),
    ({"--data-dir": "MISSING"}, "--data-dir"),
    ({"--memory-limit": "-1G"}, "negative"),
    ({"--max-backoff-s": "0"}, "--max-backoff-s must be a positive"),
    ({"--threads": "0"}, "--threads must be between 1 and 1024"),
])
def test_bad_input_exits_2_with_a_clear_error(cert_root, tmp_path, change, message):
    cmd = _agent_cmd(cert_root, "127.0.0.1:1", tmp_path)
    for flag, value in change.items():
        value = str(tmp_path / "missing") if value == "MISSING" else value
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = value
        else:
            cmd.append(f"{flag}={value}")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr
