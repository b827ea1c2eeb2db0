"""The real `poet serve` in a subprocess, driven by the real `poet fleet|run|runs` commands; this test plays the boards."""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
import threading

import grpc
import pytest

from device_agent import protos
from host.fleet import certs
from tests.host.cli.helpers import POET, one_json_object, test_env

fleet_pb2 = protos.load("poet.v1.fleet_pb2")
fleet_pb2_grpc = protos.load("poet.v1.fleet_pb2_grpc")
TIMEOUT_S = 120
MIB = 1024 * 1024
FIGURES = {"step_s", "peak_ram_bytes", "energy_j", "energy_source"}
RUN_FIELDS = {"run_id", "agent", "status", "ram_budget_bytes", "schedule_fingerprint", "predicted", "measured",
              "events_emitted", "events_stored", "final_loss", "accuracy_before", "accuracy_after", "param_digest",
              "max_rel_param_diff"}


class Served:
    """`poet serve` as a subprocess; stderr drained into ``lines`` so the pipe never fills."""

    def __init__(self, cert_dir, state_dir, env_extra=None):
        self.process = subprocess.Popen(
            [str(POET), "serve", "--listen", "127.0.0.1:0", "--certs", str(cert_dir), "--state-dir", str(state_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env() | (env_extra or {}))
        self.lines: list[str] = []
        self.listening: list[str] = []
        ready = threading.Event()

        def drain():
            for line in self.process.stderr:
                self.lines.append(line)
                if line.startswith("listening on "):
                    self.listening.append(line)
                    ready.set()
            ready.set()

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        assert ready.wait(TIMEOUT_S) and self.listening, "".join(self.lines)
        self.address = self.listening[0].split()[-1]
        self.port = int(self.address.rsplit(":", 1)[1])

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(TIMEOUT_S)
        self._drain.join(TIMEOUT_S)
        return code


@pytest.fixture
def served(cert_dir, tmp_path):
    server = Served(cert_dir, tmp_path / "state")
    yield server
    server.stop()


def operator(cert_dir, served, *argv, env_extra=None, timeout=TIMEOUT_S):
    env = test_env() | {"POET_COORDINATOR": served.address, "POET_CERTS": str(cert_dir / "alice")}
    env.update(env_extra or {})
    return subprocess.run([str(POET), *argv], capture_output=True, text=True, timeout=timeout, env=env)


def board(cert_dir, port, name, **facts):
    stub = fleet_pb2_grpc.FleetStub(grpc.secure_channel(f"127.0.0.1:{port}", certs.channel_credentials(cert_dir / name)))
    values = dict(protocol_version=fleet_pb2.PROTOCOL_VERSION_1, platform="a72", ram_total_bytes=4096 * MIB,
                  ram_available_bytes=2048 * MIB, memory_limit_bytes=256 * MIB, flash_free_bytes=1024 * MIB,
                  cpu_count=4, meters=["modelled"], runtime_rss_bytes=200 * MIB)
    values.update(facts)
    stub.Register(fleet_pb2.RegisterRequest(**values), timeout=TIMEOUT_S)
    return stub


def play_board(stub, *, status=fleet_pb2.RUN_STATUS_DONE):
    """Pull one job, fetch its model, send step telemetry and report the result, as an agent does."""
    job = stub.PullJob(fleet_pb2.PullJobRequest(wait_s=25), timeout=TIMEOUT_S).job
    archive = b"".join(c.data for c in stub.FetchModel(fleet_pb2.FetchModelRequest(digest=job.model_digest),
                                                       timeout=TIMEOUT_S))
    assert hashlib.sha256(archive).hexdigest() == job.model_digest
    events = [fleet_pb2.TelemetryEvent(seq=s, job_id=job.job_id, step=fleet_pb2.StepTelemetry(step=s, loss=2.0 / s))
              for s in range(1, job.steps + 1)]
    batch = fleet_pb2.TelemetryBatch(stream_id="b", run_id=job.run_id, events=events)
    assert list(stub.StreamTelemetry(iter([batch]), timeout=TIMEOUT_S))[-1].stored_through_seq == job.steps
    stub.ReportResult(fleet_pb2.RunResult(
        job_id=job.job_id, run_id=job.run_id, status=status, error="" if status == fleet_pb2.RUN_STATUS_DONE else
        "flash full", loss_per_step=[2.0 / s for s in range(1, job.steps + 1)], accuracy_before=0.2,
        accuracy_after=0.7, param_digest="cd" * 32, events_emitted=job.steps,
        measured=fleet_pb2.StepFigures(step_s=0.01, peak_ram_bytes=12000, energy_j=0.1, energy_source="modelled:t"),
    ), timeout=TIMEOUT_S)
    return job


def test_serve_prints_one_listening_line_and_stops_cleanly_on_sigterm(cert_dir, tmp_path):
    server = Served(cert_dir, tmp_path / "state")
    assert len(server.listening) == 1 and server.address.startswith("127.0.0.1:") and server.port > 0
    assert server.stop() == 0  # SIGTERM: a graceful stop, exit 0
    assert server.process.stdout.read() == ""  # nothing on stdout: the address is on stderr
    assert any("stopped" in line for line in server.lines)
    assert (tmp_path / "state" / "poet.db").is_file()
    missing = operator(cert_dir, server, "fleet", "list")
    assert missing.returncode == 2
    assert f"coordinator not reachable at {server.address}" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_serve_refuses_too_few_threads_to_keep_some_for_the_operator(cert_dir, tmp_path):
    from host.fleet.limits import OPERATOR_RESERVED_WORKERS

    run = subprocess.run([str(POET), "serve", "--listen", "127.0.0.1:0", "--certs", str(cert_dir), "--state-dir",
                          str(tmp_path / "state"), "--max-workers", str(OPERATOR_RESERVED_WORKERS)],
                         capture_output=True, text=True, env=test_env(), timeout=TIMEOUT_S)
    assert run.returncode == 2, run.stderr
    assert f"--max-workers: the server needs more than {OPERATOR_RESERVED_WORKERS} threads" in run.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was created


def test_operator_commands_name_both_settings_when_they_are_missing(cert_dir, tmp_path):
    env = {k: v for k, v in test_env().items() if k not in ("POET_COORDINATOR", "POET_CERTS")}
    run = subprocess.run([str(POET), "fleet", "list"], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert run.returncode == 2 and "POET_COORDINATOR" in run.stderr and "POET_CERTS" in run.stderr


def test_a_node_certificate_is_refused_for_operator_commands(cert_dir, served):
    run = operator(cert_dir, served, "runs", "list", env_extra={"POET_CERTS": str(cert_dir / "pi-1")})
    assert run.returncode == 2 and "refused by the coordinator" in run.stderr and "--operator" in run.stderr


def test_fleet_list_json_contract(cert_dir, served):
    board(cert_dir, served.port, "pi-1")
    run = operator(cert_dir, served, "fleet", "list", "--json")
    assert run.returncode == 0, run.stderr
    agents = one_json_object(run.stdout)["agents"]
    assert len(agents) == 1
    agent = agents[0]
    assert {"name", "platform", "online", "ram_total_bytes", "memory_limit_bytes", "flash_free_bytes",
            "meters"} <= set(agent)
    assert (agent["name"], agent["platform"], agent["online"], agent["ram_total_bytes"], agent["memory_limit_bytes"],
            agent["flash_free_bytes"], agent["meters"]) == ("pi-1", "a72", True, 4096 * MIB, 256 * MIB, 1024 * MIB,
                                                             ["modelled"])
    human = operator(cert_dir, served, "fleet", "list")
    assert human.returncode == 0 and "pi-1" in human.stdout and "a72" in human.stdout


@pytest.mark.slow  # 11 s; the fast suite keeps its 5-minute margin
def test_run_json_and_runs_list_json_contract(cert_dir, served):
    stub = board(cert_dir, served.port, "pi-1")
    board(cert_dir, served.port, "pi-2", memory_limit_bytes=208 * MIB)  # auto: RSS + margin leave nothing
    run = operator(cert_dir, served, "run", "--model", "mlp", "--dataset", "digits", "--steps", "3",
                   "--ram-budget", "auto", "--all", "--json")
    assert run.returncode == 6, run.stderr  # pi-2 does not fit
    runs = {r["agent"]: r for r in one_json_object(run.stdout)["runs"]}
    assert sorted(runs) == ["pi-1", "pi-2"]
    for entry in runs.values():
        assert RUN_FIELDS <= set(entry) and FIGURES == set(entry["predicted"]) == set(entry["measured"])
    fits, small = runs["pi-1"], runs["pi-2"]
    assert fits["status"] == "queued" and fits["schedule_fingerprint"] and fits["ram_budget_bytes"] > 0
    assert fits["predicted"]["energy_source"] == "predicted:a72" and fits["predicted"]["step_s"] > 0
    assert fits["measured"] == dict.fromkeys(FIGURES) and fits["final_loss"] is None
    assert small["status"] == "does_not_fit" and small["min_ram_budget_bytes"] > 0 and "below the minimum" in small["error"]
    listed = operator(cert_dir, served, "runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {r["run_id"]: r["status"] for r in one_json_object(listed.stdout)["runs"]} == {
        fits["run_id"]: "queued", small["run_id"]: "does_not_fit"}
    assert all(r["telemetry_steps_missing"] is None for r in one_json_object(listed.stdout)["runs"])  # show only
    shown = operator(cert_dir, served, "runs", "show", fits["run_id"], "--json")
    assert one_json_object(shown.stdout)["run_id"] == fits["run_id"]
    assert one_json_object(shown.stdout)["telemetry_steps_missing"] == []
    # The board sends the step events of steps 1 and 3: step 2 has none, and `runs show` says so.
    job = stub.PullJob(fleet_pb2.PullJobRequest(wait_s=25), timeout=TIMEOUT_S).job
    events = [fleet_pb2.TelemetryEvent(seq=seq, job_id=job.job_id, step=fleet_pb2.StepTelemetry(step=step, loss=1.0))
              for seq, step in ((1, 1), (2, 3))]
    list(stub.StreamTelemetry(iter([fleet_pb2.TelemetryBatch(stream_id="b", run_id=job.run_id, events=events)]),
                              timeout=TIMEOUT_S))
    shown = operator(cert_dir, served, "runs", "show", fits["run_id"], "--json")
    assert one_json_object(shown.stdout)["telemetry_steps_missing"] == [[2, 2]], shown.stdout
    human = operator(cert_dir, served, "runs", "show", fits["run_id"])
    assert re.search(r"^telemetry_steps_missing +2$", human.stdout, re.M), human.stdout
    unknown = operator(cert_dir, served, "run", "--model", "mlp", "--dataset", "digits", "--steps", "3",
                       "--ram-budget", "80%", "--agents", "pi-1,pi-9")
    assert unknown.returncode == 2 and "pi-9" in unknown.stderr and "known agents: pi-1, pi-2" in unknown.stderr


@pytest.mark.slow  # about 7-18 s: the fast suite stays under 5 minutes
def test_run_wait_follows_the_boards_to_the_end_and_prints_the_table(cert_dir, served):
    stubs = {name: board(cert_dir, served.port, name) for name in ("pi-1", "pi-2")}
    outcome = {"pi-1": fleet_pb2.RUN_STATUS_DONE, "pi-2": fleet_pb2.RUN_STATUS_DONE}
    boards = [threading.Thread(target=play_board, args=(stubs[n],), kwargs={"status": outcome[n]}) for n in stubs]
    for thread in boards:
        thread.start()
    run = operator(cert_dir, served, "run", "--model", "mlp", "--dataset", "digits", "--steps", "4",
                   "--ram-budget", "90%", "--agents", "pi-1,pi-2", "--wait", "--json")
    for thread in boards:
        thread.join(TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    runs = one_json_object(run.stdout)["runs"]
    assert [(r["agent"], r["status"], r["final_loss"], r["events_stored"], r["events_emitted"]) for r in runs] == [
        ("pi-1", "done", 0.5, 4, 4), ("pi-2", "done", 0.5, 4, 4)]
    assert runs[0]["measured"] == {"step_s": 0.01, "peak_ram_bytes": 12000, "energy_j": 0.1, "energy_source": "modelled:t"}
    assert (runs[0]["accuracy_before"], runs[0]["accuracy_after"]) == (0.2, 0.7)
    # human mode with a failing board: the table on stdout, exit 6
    failing = threading.Thread(target=play_board, args=(stubs["pi-2"],), kwargs={"status": fleet_pb2.RUN_STATUS_FAILED})
    failing.start()
    human = operator(cert_dir, served, "run", "--model", "mlp", "--dataset", "digits", "--steps", "2",
                     "--ram-budget", "90%", "--agents", "pi-2", "--wait")
    failing.join(TIMEOUT_S)
    assert human.returncode == 6, human.stderr
    assert "pi-2" in human.stdout and "failed" in human.stdout and "flash full" in human.stdout
    assert "budget" in human.stdout and "peak RAM pred/meas" in human.stdout
