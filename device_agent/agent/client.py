"""The agent's gRPC client (`poet-agent run`): register, heartbeat, pull jobs, run them, stream telemetry, report.

The agent only dials out (boards sit behind NAT). One channel to the coordinator carries every call;
gRPC reconnects it underneath, and the agent retries failed calls with exponential backoff and full
jitter (as Flower's SuperNode: 1 s doubling to 20 s, a uniform draw below that cap), forever.

Threads: the main loop (register, re-send pending results, long-poll PullJob, wait for the job); a
worker running the job (one at a time); the heartbeat; the telemetry sender. Every event is one
line on stderr, ``[agent NAME] ...``.

Exit codes (also in ``poet-agent run --help``):

- 0: stopped by SIGTERM (the running job was cancelled after its checkpoint; it resumes on restart)
- 1: internal error
- 2: bad input: flags, directories, certificate bundle, coordinator address
- 3: refused by the coordinator (PERMISSION_DENIED: this node was removed, or its certificate is not
  accepted); not retried, since retrying cannot help
- 130: stopped by SIGINT (Ctrl-C), otherwise as SIGTERM
"""

from __future__ import annotations

import random
import shutil
import ssl
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from device_agent.agent import facts as board_facts
from device_agent.agent.buffer import DEFAULT_MAX_EVENTS
from device_agent.agent.credentials import channel_credentials
from device_agent.agent.results import PendingResults
from device_agent.agent.telemetry import TelemetryClosed, TelemetrySender, TelemetrySink
from device_agent.agent.transfer import FetchCancelled, ModelFetchError, ModelStore
from device_agent.protos import load

__all__ = [
    "CHANNEL_OPTIONS", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE",
    "SERVER_KEEPALIVE_OPTIONS", "Agent", "AgentConfig", "Backoff", "channel_options",
]

fleet_pb2 = load("poet.v1.fleet_pb2")
fleet_pb2_grpc = load("poet.v1.fleet_pb2_grpc")

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DEFAULT_BACKOFF_BASE_S = 1.0
DEFAULT_MAX_BACKOFF_S = 20.0
PULL_WAIT_S = 20.0
CALL_TIMEOUT_S = 15.0
DEFAULT_HEARTBEAT_S = 5.0
KEEPALIVE_S = 60


def channel_options(max_backoff_s: float = DEFAULT_MAX_BACKOFF_S) -> list[tuple[str, int]]:
    """Message size bounds, keepalive pings, and gRPC's own reconnect backoff held to ours."""
    max_ms = max(100, int(max_backoff_s * 1000))
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 0),  # the telemetry stream and PullJob are always open
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", min(1000, max_ms)),
        ("grpc.min_reconnect_backoff_ms", min(1000, max_ms)),
        ("grpc.max_reconnect_backoff_ms", max_ms),
    ]


CHANNEL_OPTIONS = channel_options()
# What a server must allow so the agents' keepalive pings are not answered with GOAWAY (too_many_pings).
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", (KEEPALIVE_S // 2) * 1000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", (KEEPALIVE_S // 2) * 1000),
]


class Backoff:
    """Exponential backoff with full jitter: attempt k waits uniform(0, min(max_s, base_s * 2**k))."""

    def __init__(self, base_s: float = DEFAULT_BACKOFF_BASE_S, max_s: float = DEFAULT_MAX_BACKOFF_S,
                 rng: random.Random | None = None) -> None:
        if not (max_s > 0) or not (base_s > 0):
            raise ValueError(f"backoff needs positive times, got base {base_s} s, max {max_s} s")
        self.base_s = min(base_s, max_s)
        self.max_s = max_s
        self.rng = rng or random.Random()
        self.attempt = 0

    def cap_s(self) -> float:
        return min(self.max_s, self.base_s * 2 ** min(self.attempt, 60))

    def next_delay(self) -> float:
        cap = self.cap_s()
        self.attempt += 1
        return self.rng.uniform(0, cap)

    def reset(self) -> None:
        self.attempt = 0


@dataclass
class AgentConfig:
    coordinator: str  # HOST:PORT
    certs: Path
    flash_dir: Path
    data_dir: Path
    state_dir: Path
    platform: str = "local"
    memory_limit_bytes: int | None = None
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    pull_wait_s: float = PULL_WAIT_S
    max_events_per_run: int = DEFAULT_MAX_EVENTS  # telemetry held per run before training pauses
    training_threads: int | None = None  # torch threads for jobs (PROFILE included); None: torch's own choice


class _Refused(Exception):
    """PERMISSION_DENIED from the coordinator: stop, do not retry."""


def describe_rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    details = " ".join(str(details or "").split())
    name = getattr(code, "name", "ERROR")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the coordinator did not accept this agent's credentials (UNAUTHENTICATED: {details})"
    if "handshake" in details.lower() or "CERTIFICATE_VERIFY_FAILED" in details:
        return f"TLS handshake failed (check that --certs holds a bundle from the coordinator's CA): {name}: {details}"
    return f"{name}: {details}"


def certificate_name(bundle_dir: Path) -> str | None:
    """The CN of the bundle's certificate, for log lines before the coordinator names us."""
    try:
        subject = ssl._ssl._test_decode_cert(str(bundle_dir / "cert.pem"))["subject"]  # no cryptography on a board
        return next(value for rdn in subject for key, value in rdn if key == "commonName")
    except Exception:  # noqa: BLE001
        return None


class Agent:
    """One board's agent. :meth:`run` blocks until stopped and returns the process's exit code."""

    def __init__(self, config: AgentConfig, *, runner=None, stderr=None, facts=None) -> None:
        self.config = config
        self.stderr = stderr or sys.stderr
        self.name = certificate_name(Path(config.certs)) or Path(config.certs).name
        self._runner = runner
        self._facts = facts
        self._log_lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_code = EXIT_OK
        self._refused: str | None = None
        self._need_register = True
        self._registered_once = False
        self._heartbeat_s = DEFAULT_HEARTBEAT_S
        self._job = None
        self._job_cancel: threading.Event | None = None
        self._cancelled_by_coordinator = False
        self._step = 0
        self._channel = None
        self._stub = None
        self._sink: TelemetrySink | None = None
        self._sender: TelemetrySender | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------------------------ plumbing
    def log(self, message: str) -> None:
        with self._log_lock:
            print(f"[agent {self.name}] {message}", file=self.stderr, flush=True)

    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        """Stop soon (a signal handler calls this): cancel the running job, close everything."""
        if not self._stop.is_set():
            self._stop_code = exit_code
            self._stop.set()
            cancel = self._job_cancel
            if cancel is not None:
                cancel.set()  # the runner checkpoints and returns; the sender stops in _shutdown

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _backoff(self) -> Backoff:
        return Backoff(max_s=self.config.max_backoff_s)

    # ------------------------------------------------------------------------------------ main
    @staticmethod
    def _torch_threads() -> int:
        import torch

        return torch.get_num_threads()

    def run(self) -> int:
        config = self.config
        try:
            credentials = channel_credentials(config.certs)
            board = self._facts or board_facts.collect_facts(
                platform=config.platform, flash_dir=config.flash_dir, memory_limit_override=config.memory_limit_bytes,
                data_dir=config.data_dir)
        except Exception as exc:  # noqa: BLE001
            self.log(f"cannot start: {exc}")
            return EXIT_USAGE
        self._facts = board
        if config.training_threads is not None:  # every job, the PROFILE job's micro-benchmarks included
            import torch

            torch.set_num_threads(config.training_threads)
        self.log(f"starting (poet-edge {board.agent_version}, torch {board.torch_version}); coordinator "
                 f"{config.coordinator}; {board.memory_limit.describe()}; runtime RSS "
                 f"{board_facts.format_bytes(board.runtime_rss_bytes)}; meters {', '.join(board.meters)}; "
                 f"training on {self._torch_threads()} of {board.cpu_count} core(s)")
        self._channel = grpc.secure_channel(config.coordinator, credentials,
                                            options=channel_options(config.max_backoff_s))
        self._stub = fleet_pb2_grpc.FleetStub(self._channel)
        self._sink = TelemetrySink(config.state_dir, config.max_events_per_run, log=self.log)
        self._results = PendingResults(config.state_dir)
        self._models = ModelStore(config.state_dir, log=self.log)
        self._tidy_state()
        try:
            self._main_loop()
        except _Refused as exc:
            self._refused = str(exc)
        except Exception as exc:  # noqa: BLE001
            self.log(f"internal error: {type(exc).__name__}: {exc}")
            self._shutdown()
            return EXIT_ERROR
        self._shutdown()
        if self._refused is not None:
            self.log(f"refused by the coordinator {config.coordinator}: {self._refused}; exiting with code "
                     f"{EXIT_REFUSED} (not retrying: ask the operator to re-admit this node or issue a new certificate)")
            return EXIT_REFUSED
        return self._stop_code

    def _main_loop(self) -> None:
        backoff = self._backoff()
        while not self._stop.is_set():
            try:
                if self._need_register:
                    self._register()
                    self._start_background()
                self._send_pending_results()
                if self._stop.is_set():
                    break
                job = self._pull()
                backoff.reset()
                if job is not None:
                    self._run_job(job)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise _Refused(exc.details()) from None
                self._need_register = True
                delay = backoff.next_delay()
                self.log(f"coordinator {self.config.coordinator} unreachable ({describe_rpc_error(exc)}); "
                         f"retrying in {delay:.1f} s")
                self._stop.wait(delay)

    def _register(self) -> None:
        with self._register_lock:
            request = self._facts.register_request(fleet_pb2)
            request.ram_available_bytes, request.flash_free_bytes = self._live_memory_and_flash()
            reply = self._stub.Register(request, timeout=CALL_TIMEOUT_S)
            self.name = reply.agent_name or self.name
            self._heartbeat_s = reply.heartbeat_interval_s or DEFAULT_HEARTBEAT_S
            self._need_register = False
            limit = self._facts.memory_limit
            memory = f"memory limit {board_facts.format_bytes(limit.bytes)}" if limit.bytes else "no memory limit"
            self._registered_once = True
            self.log(f"registered with {self.config.coordinator} (platform {self._facts.platform}, {memory})")

    def _live_memory_and_flash(self) -> tuple[int, int]:
        if self._facts is not None and self._facts.board:
            # the agent drives another board (the serial bridge): its memory and flash, not this machine's
            return int(self._facts.ram_available_bytes), int(self._facts.flash_free_bytes)
        import psutil

        try:
            flash_free = shutil.disk_usage(self.config.flash_dir).free
        except OSError:
            flash_free = 0
        return int(psutil.virtual_memory().available), int(flash_free)

    def _start_background(self) -> None:
        if self._threads:
            return
        self._sender = TelemetrySender(self._channel, self._sink, log=self.log)
        telemetry_backoff = self._backoff()

        def sender_wait(exc: grpc.RpcError) -> None:
            # Refusals here concern a run (the sender parks it), not this node: Register, Heartbeat and
            # PullJob are where a removed node learns it.
            delay = telemetry_backoff.next_delay()
            self.log(f"telemetry stream broke ({describe_rpc_error(exc)}); reconnecting in {delay:.1f} s")
            self._stop.wait(delay)

        def sender_main() -> None:
            while not self._stop.is_set():
                try:
                    self._sender.run(sender_wait)
                except Exception as exc:  # noqa: BLE001  (never let telemetry die silently)
                    self.log(f"telemetry sender error: {type(exc).__name__}: {exc}; restarting it")
                    self._stop.wait(1.0)

        for target, name in ((self._heartbeat_loop, "heartbeat"), (sender_main, "telemetry")):
            thread = threading.Thread(target=target, name=f"poet-agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _refuse(self, details: str) -> None:
        if self._refused is None:
            self._refused = details or "PERMISSION_DENIED"
        self._stop.set()
        if self._job_cancel is not None:
            self._job_cancel.set()

    # ------------------------------------------------------------------------------------ heartbeat
    def _heartbeat_loop(self) -> None:
        from device_agent.meters.memory import RssSampler

        sampler = RssSampler()
        failing = False
        try:
            while not self._stop.wait(self._heartbeat_s):
                ram, flash = self._live_memory_and_flash()
                job = self._job
                request = fleet_pb2.HeartbeatRequest(
                    ram_available_bytes=ram, flash_free_bytes=flash, rss_bytes=sampler.rss_bytes(),
                    running_job_id=job.job_id if job is not None else "", running_step=self._step)
                try:
                    reply = self._stub.Heartbeat(request, timeout=max(CALL_TIMEOUT_S, self._heartbeat_s))
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                        self._refuse(exc.details())
                        return
                    if not failing:
                        self.log(f"heartbeat failed ({describe_rpc_error(exc)})")
                    failing = True
                    self._need_register = True
                    continue
                if failing:
                    self.log("heartbeat ok again")
                    failing = False
                self._heartbeat_s = reply.heartbeat_interval_s or self._heartbeat_s
                for job_id in reply.cancel_job_ids:
                    job = self._job
                    if job is not None and job.job_id == job_id and self._job_cancel is not None \
                            and not self._job_cancel.is_set():
                        self.log(f"the coordinator cancelled job {job_id} (run {job.run_id}); stopping it")
                        self._cancelled_by_coordinator = True
                        self._job_cancel.set()
                if reply.register_again:
                    try:
                        self._register()
                    except grpc.RpcError as exc:
                        self._need_register = True
                        self.log(f"registering again failed ({describe_rpc_error(exc)})")
        finally:
            sampler.close()

    # ------------------------------------------------------------------------------------ jobs
    def _pull(self):
        future = self._stub.PullJob.future(fleet_pb2.PullJobRequest(wait_s=self.config.pull_wait_s),
                                           timeout=self.config.pull_wait_s + CALL_TIMEOUT_S)
        while True:
            try:
                reply = future.result(timeout=0.25)
                break
            except grpc.FutureTimeoutError:
                if self._stop.is_set():
                    future.cancel()
                    return None
            except grpc.FutureCancelledError:
                return None
        if reply.HasField("job"):
            return reply.job
        if reply.retry_after_s > 0:
            self._stop.wait(min(reply.retry_after_s, self.config.pull_wait_s))
        return None

    def _run_job(self, job) -> None:
        kind = fleet_pb2.JobKind.Name(job.kind)
        self.log(f"running job {job.job_id} (run {job.run_id}, {kind}, {job.steps} steps)")
        cancel = threading.Event()
        self._cancelled_by_coordinator = False
        self._step = 0
        self._job, self._job_cancel = job, cancel
        if self._stop.is_set():
            cancel.set()
        outcome: list = []
        worker = threading.Thread(target=lambda: outcome.append(self._execute(job, cancel)),
                                  name="poet-agent-job", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            if self._stop.is_set():
                cancel.set()
                self._sink.interrupt()  # a runner blocked on a full telemetry buffer would never see the cancel
        self._job = self._job_cancel = None
        result = outcome[0] if outcome else None
        interrupted = self._stop.is_set() and not self._cancelled_by_coordinator
        if result is None or (interrupted and result.status != fleet_pb2.RUN_STATUS_DONE):
            self.log(f"job {job.job_id} interrupted; it resumes from its checkpoint when the agent restarts")
            return
        self._results.save(result)
        status = fleet_pb2.RunStatus.Name(result.status).removeprefix("RUN_STATUS_")
        note = f": {result.error}" if result.error else ""
        self.log(f"job {job.job_id} finished: {status}{note}")
        if not self._stop.is_set():
            self._send_pending_results()

    def _get_runner(self):
        if self._runner is None:
            from device_agent.agent.facts import cgroup_memory_limit
            from device_agent.agent.jobs import JobRunner
            from device_agent.executor.allocator import keep_freed_memory

            under_cgroup = cgroup_memory_limit()[0] is not None
            if not under_cgroup:
                keep_freed_memory()  # process-wide; the same policy as `poet train` (host/run/train.py)
            self._runner = JobRunner(flash_dir=Path(self.config.flash_dir), data_dir=Path(self.config.data_dir),
                                     state_dir=Path(self.config.state_dir), platform=self.config.platform,
                                     log=self.log, return_freed_memory=under_cgroup)
        return self._runner

    def _execute(self, job, cancel: threading.Event):
        """The job's RunResult, or None when it was interrupted before finishing (it resumes later)."""
        telemetry = None
        try:
            telemetry = self._sink.for_run(job.run_id)
            model_path = None
            if job.kind != fleet_pb2.JOB_KIND_PROFILE:
                fetch_backoff = self._backoff()

                def wait_retry(exc: grpc.RpcError) -> None:
                    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                        raise exc
                    delay = fetch_backoff.next_delay()
                    self.log(f"model transfer interrupted ({describe_rpc_error(exc)}); resuming in {delay:.1f} s")
                    if cancel.wait(delay) or self._stop.is_set():
                        raise FetchCancelled("stopping")

                model_path = self._models.fetch(self._stub, job.model_digest, job.model_size_bytes, cancel=cancel,
                                                wait_retry=wait_retry)
            result = self._get_runner().run(job, model_path, telemetry, cancel, progress=self._progress)
        except (FetchCancelled, TelemetryClosed):
            return None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                self._refuse(exc.details())
                return None
            result = self._failed(job, f"model fetch failed: {describe_rpc_error(exc)}")
        except ModelFetchError as exc:
            result = self._failed(job, str(exc))
        except Exception as exc:  # noqa: BLE001  (a job's failure is reported, never the agent's end)
            if cancel.is_set() and self._stop.is_set() and not self._cancelled_by_coordinator:
                return None  # the runner stopped for the agent's shutdown (JobCancelled): it resumes later
            prefix = "cancelled by the coordinator: " if self._cancelled_by_coordinator and cancel.is_set() else ""
            result = self._failed(job, f"{prefix}{type(exc).__name__}: {exc}")
        if not result.job_id:
            result.job_id = job.job_id
        if not result.run_id:
            result.run_id = job.run_id
        if telemetry is not None and not result.events_emitted:
            try:
                result.events_emitted = telemetry.emitted
            except Exception:  # noqa: BLE001
                pass
        return result

    def _failed(self, job, error: str):
        one_line = " ".join(str(error).split())[:2000]
        return fleet_pb2.RunResult(job_id=job.job_id, run_id=job.run_id, status=fleet_pb2.RUN_STATUS_FAILED,
                                   error=one_line)

    def _progress(self, step: int) -> None:
        self._step = int(step)

    def _send_pending_results(self) -> None:
        for result in self._results.pending():
            if self._stop.is_set():
                return
            try:
                self._stub.ReportResult(result, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                code = exc.code()
                # The coordinator refuses a result it cannot take (unknown run, not ours, malformed): resending
                # cannot help. A removed node is told so by PullJob, Heartbeat or Register (exit code 3).
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                            grpc.StatusCode.PERMISSION_DENIED):
                    self.log(f"the coordinator refused the result of run {result.run_id} "
                             f"({describe_rpc_error(exc)}); dropping it")
                    self._sink.retire(result.run_id)
                    self._results.done(result.run_id)
                    continue
                raise
            self._sink.retire(result.run_id)  # first: a crash before done() re-sends the result, and retires again
            self._results.done(result.run_id)
            status = fleet_pb2.RunStatus.Name(result.status).removeprefix("RUN_STATUS_")
            self.log(f"reported the result of run {result.run_id} ({status})")

    # ------------------------------------------------------------------------------------ state, shutdown
    def _tidy_state(self) -> None:
        """Retire drained telemetry buffers of runs whose result is already reported (a crash in between).

        Only those: the buffer of an unfinished run stays even when every event is acknowledged, so the run
        resumes numbering after its last seq (a new buffer would number from 1 again, and the coordinator
        would drop every event at or below what it already stored: the re-run steps' telemetry, silently).
        """
        pending_results = {r.run_id for r in self._results.pending()}
        self._sink.retire_drained()  # opens every buffer left on disk; runs with unacknowledged events stay
        waiting = len(pending_results)
        if waiting:
            self.log(f"{waiting} result(s) from before the restart wait to be reported")

    def _shutdown(self) -> None:
        self._stop.set()
        if self._sender is not None:
            self._sender.stop()
        for thread in self._threads:
            thread.join(5)
        if self._sink is not None:
            self._sink.close()
        if self._channel is not None:
            self._channel.close()
        self.log("stopped")

