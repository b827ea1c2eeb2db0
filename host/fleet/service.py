"""The coordinator's gRPC services, thin: `Fleet` for boards (node certificates) and `FleetAdmin` for operators.

As Flower keeps thin servicers over request handlers over a state interface, each servicer method here identifies
the caller (host/fleet/auth.py) and hands the request to the role that answers it:

- host/fleet/jobs.py: long polls, model downloads, heartbeats' cancellations, removing a board;
- host/fleet/planning.py: models, profiles, budgets and schedules of a submission;
- host/fleet/ingestion.py: what boards send (facts, telemetry, results), checked at the door;
- host/fleet/uploads.py: archives operators traced and uploaded; host/fleet/calibration.py: `poet calibrate`;

over host/fleet/state.py (the run store, the state dir, the job specs, the work signal). Refusals
(host/fleet/refusal.py), limit errors and store errors become gRPC statuses here, in :func:`_handler`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from device_agent import protos
from host.fleet import serde
from host.fleet.admission import CallLimitError, IdleWatch
from host.fleet.auth import NODE, OPERATOR, Authorizer
from host.fleet.ingestion import Ingestion
from host.fleet.jobs import Jobs
from host.fleet.limits import (
    AUTO_MARGIN_BYTES,  # noqa: F401  (part of this module's face: tests and host/flower read it here)
    DEFAULT_SOLVER_WORKERS,
    DOWNLOAD_IDLE_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    LIST_PAGE_BYTES,
    LIST_PAGE_SIZE,
    MAX_LIST_PAGE_SIZE,
    MAX_MESSAGE_BYTES,
    MODEL_CHUNK_BYTES,
    SOLVE_TIME_LIMIT_S,
)
from host.fleet.planning import (  # noqa: F401  (re-exported: host/flower and tests import them from here)
    DEFAULT_RUNTIME_FACTOR,
    UPLOAD_STATUS,
    BoardPlan,
    Planner,
    auto_budget_bytes,
    auto_budget_text,
    fixed_bytes,
    profile_digest,
)
from host.fleet.refusal import Refused
from host.fleet.state import FleetState
from host.fleet.store import AgentRemovedError, RunStore, StoreError, UnknownRunError
from host.fleet.uploads import UploadError

fleet_pb2 = serde.fleet_pb2
fleet_pb2_grpc = protos.load("poet.v1.fleet_pb2_grpc")

log = logging.getLogger("poet.fleet")


class Coordinator:
    """The coordinator's roles over one shared state: ``auth``, ``jobs``, ``planning`` and ``ingestion``.

    ``packager`` is :func:`host.fleet.model_package.package_model` (injectable for tests);
    ``local_profile`` measures this machine once, for boards whose platform is neither measured nor shipped.
    ``solver_workers``: threads solving queued schedules (host/fleet/solving.py; 0: only other processes solve, e.g.
    ``poet solver-worker``). Stop them with :meth:`close`.
    ``refine_profiles``: done TRAIN and VERIFY runs refine calibrated boards' profiles (host.fleet.calibration.Refiner).
    The methods below are the roles' entry points that calibration (which drives submissions like an operator),
    host/flower (planning) and tests use.
    """

    def __init__(self, store: RunStore, state_dir: str | Path, *, packager: Callable[..., Any] | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 solve_time_limit_s: float = SOLVE_TIME_LIMIT_S, local_profile: Callable[[], Any] | None = None,
                 refine_profiles: bool = True, download_idle_s: float = DOWNLOAD_IDLE_S,
                 board_calls: int | None = None, solver_workers: int = DEFAULT_SOLVER_WORKERS):
        self.state = FleetState(store, state_dir, heartbeat_interval_s=heartbeat_interval_s,
                                heartbeat_timeout_s=heartbeat_timeout_s, download_idle_s=download_idle_s,
                                board_calls=board_calls)
        self.auth = Authorizer(store)
        self.jobs = Jobs(self.state)
        self.planning = Planner(self.state, packager=packager, solve_time_limit_s=solve_time_limit_s,
                                local_profile=local_profile)
        self.ingestion = Ingestion(self.state, self.jobs)
        self.refiner = None
        if refine_profiles:
            from host.fleet.calibration import Refiner

            self.refiner = Refiner(self.planning)
        self.ingestion.refiner = self.refiner
        self.solvers = None
        if solver_workers:
            from host.fleet.solving import SolverPool

            self.solvers = SolverPool(store, solver_workers, solve=self.planning.solve,
                                      on_solved=lambda runs: self.state.notify_work())
            self.state.solvers = self.solvers.start()
        # PostgreSQL: runs queued by another coordinator or solver worker wake this one's long polls at once
        self._listening = threading.Event()
        store.listen_for_work(self.state.notify_work, self._listening)

    def close(self) -> None:
        """Stop listening to the store and the solver workers (solves in progress go back to the queue); the store
        stays open."""
        self._listening.set()
        if self.solvers is not None:
            self.state.solvers = None
            self.solvers.stop()

    # ------------------------------------------------------------------------------------ the shared state
    @property
    def store(self) -> RunStore:
        return self.state.store

    @property
    def state_dir(self) -> Path:
        return self.state.state_dir

    @property
    def models_dir(self) -> Path:
        return self.state.models_dir

    @property
    def results_dir(self) -> Path:
        return self.state.results_dir

    @property
    def uploads(self):
        return self.state.uploads

    @property
    def slots(self):
        return self.state.slots

    @property
    def heartbeat_interval_s(self) -> float:
        return self.state.heartbeat_interval_s

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.state.heartbeat_timeout_s

    @property
    def calibrations(self) -> dict[str, Any]:
        return self.state.calibrations

    @property
    def solve_count(self) -> int:
        return self.planning.solve_count

    def spec(self, job_id: str) -> dict[str, Any]:
        return self.state.spec(job_id)

    def notify_work(self) -> None:
        self.state.notify_work()

    # ------------------------------------------------------------------------------------ the roles' entry points
    def caller(self, context, role: str) -> str:
        return self.auth.caller(context, role)

    def pull(self, agent: str, wait_s: float, context):
        return self.jobs.pull(agent, wait_s, context)

    def submit(self, request) -> list:
        return self.planning.submit(request)

    def plan_board(self, agent, graph, request, optimizer: str, runtime_factor: float):
        return self.planning.plan_board(agent, graph, request, optimizer, runtime_factor)

    def board_profile(self, agent, pinned_version: int = 0):
        return self.planning.board_profile(agent, pinned_version)

    def package(self, model: str, batch_size: int | None, seed: int, granularity: str = "layer"):
        return self.planning.package(model, batch_size, seed, granularity)

    def job_graph(self, spec: dict[str, Any]):
        return self.planning.job_graph(spec)

    def report(self, agent: str, result) -> None:
        self.ingestion.report(agent, result)

    def telemetry(self, agent: str, batch):
        return self.ingestion.telemetry(agent, batch)


# ------------------------------------------------------------------------------------------ servicers
def _page(records: list, request, to_message: Callable[[Any], Any]) -> tuple[list, str]:
    """One page of ``records`` (in the store's stable order) as messages, and the token of the next page ("" after
    the last): at most the request's page_size (default LIST_PAGE_SIZE, at most MAX_LIST_PAGE_SIZE) entries and at
    most LIST_PAGE_BYTES of them (one entry at least), so a reply stays far below the message limit."""
    token = request.page_token or "0"
    if not (token.isascii() and token.isdigit() and len(token) <= 12) or int(token) > len(records):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                       f"page_token {request.page_token[:64]!r} is not one this coordinator gave (or the list "
                       "shrank since); start again without one")
    start = int(token)
    size = min(request.page_size or LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE)
    page, total_bytes = [], 0
    for record in records[start:start + size]:
        message = to_message(record)
        total_bytes += message.ByteSize()
        if page and total_bytes > LIST_PAGE_BYTES:
            break
        page.append(message)
    end = start + len(page)
    return page, (str(end) if end < len(records) else "")


def _handler(role: str):
    """Wrap a servicer method: identify the caller (``name`` argument), turn refusals and store errors into statuses."""

    def wrap(method):
        def handle(self, request, context):
            try:
                name = self.coordinator.caller(context, role)
                if role != NODE:
                    return method(self, request, context, name)
                with self.coordinator.slots.hold(name):
                    return method(self, request, context, name)
            except CallLimitError as error:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            except Refused as refused:
                context.abort(refused.code, refused.message)
            except AgentRemovedError as error:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
            except UnknownRunError as error:
                context.abort(grpc.StatusCode.NOT_FOUND, str(error))
            except StoreError as error:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))

        handle.__name__ = method.__name__
        handle.__doc__ = method.__doc__
        return handle

    return wrap


class FleetServicer(fleet_pb2_grpc.FleetServicer):
    """What boards call (node certificates only)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    @_handler(NODE)
    def Register(self, request, context, name):
        c = self.coordinator
        c.ingestion.register(name, request)
        log.info("agent %s registered (%s)", name, request.platform)
        return fleet_pb2.RegisterReply(agent_name=name, protocol_version=fleet_pb2.PROTOCOL_VERSION_1,
                                       heartbeat_interval_s=c.heartbeat_interval_s, max_message_bytes=MAX_MESSAGE_BYTES,
                                       model_chunk_bytes=MODEL_CHUNK_BYTES)

    @_handler(NODE)
    def Heartbeat(self, request, context, name):
        return self.coordinator.jobs.heartbeat(name, request)

    @_handler(NODE)
    def PullJob(self, request, context, name):
        job = self.coordinator.pull(name, request.wait_s, context)
        if job is None:
            return fleet_pb2.PullJobReply(retry_after_s=0.0)
        log.info("job %s (run %s) handed to %s", job.job_id, job.run_id, name)
        return fleet_pb2.PullJobReply(job=job)

    def FetchModel(self, request, context):
        c = self.coordinator
        try:
            name = c.caller(context, NODE)
            path = c.jobs.model_path(name, request.digest)
        except Refused as refused:
            context.abort(refused.code, refused.message)
        total = path.stat().st_size
        if request.offset_bytes > total:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"offset {request.offset_bytes} is past the end of model {request.digest} ({total} bytes); "
                          "fetch from 0")
        try:
            with c.slots.hold(name, "download"), open(path, "rb") as archive:
                watch = IdleWatch(c.state.download_idle_s, context.cancel)  # chunks nobody reads free the thread
                try:
                    archive.seek(request.offset_bytes)
                    offset = request.offset_bytes
                    while context.is_active():
                        data = archive.read(MODEL_CHUNK_BYTES)
                        if not data:
                            return
                        yield fleet_pb2.ModelChunk(offset_bytes=offset, data=data, total_size_bytes=total,
                                                   chunk_sha256=hashlib.sha256(data).hexdigest())
                        watch.progress()
                        offset += len(data)
                finally:
                    watch.stop()
        except CallLimitError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    def StreamTelemetry(self, request_iterator, context):
        c = self.coordinator
        try:
            name = c.caller(context, NODE)
        except Refused as refused:
            context.abort(refused.code, refused.message)
        try:
            # an agent keeps its stream open while it has nothing to send: no idle deadline here; the per-board cap
            # (MAX_STREAMS_PER_NODE) bounds the threads a board's streams hold
            with c.slots.hold(name, "stream"):
                for batch in request_iterator:
                    try:
                        ack = c.telemetry(name, batch)
                    except Refused as refused:
                        context.abort(refused.code, refused.message)
                    except StoreError as error:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
                    yield ack
        except CallLimitError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    @_handler(NODE)
    def ReportResult(self, request, context, name):
        self.coordinator.report(name, request)
        log.info("run %s reported by %s", request.run_id, name)
        return fleet_pb2.ReportResultReply()


class FleetAdminServicer(fleet_pb2_grpc.FleetAdminServicer):
    """What operators call (operator certificates only)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    @_handler(OPERATOR)
    def ListAgents(self, request, context, name):
        c, now = self.coordinator, time.time()
        agents, token = _page(c.store.list_agents(), request,
                              lambda a: serde.agent_info(a, online=a.online(now, c.heartbeat_timeout_s)))
        return fleet_pb2.ListAgentsReply(agents=agents, next_page_token=token)

    @_handler(OPERATOR)
    def RemoveAgent(self, request, context, name):
        removed = self.coordinator.jobs.remove_agent(request.name, operator=name)
        if removed:
            log.info("agent %s removed by %s", request.name, name)
        return fleet_pb2.RemoveAgentReply(removed=removed)

    @_handler(OPERATOR)
    def SubmitRun(self, request, context, name):
        runs = self.coordinator.submit(request)
        log.info("%s submitted %s on %d board(s)", name, request.model or "a profile", len(runs))
        return fleet_pb2.SubmitRunReply(runs=runs)

    @_handler(OPERATOR)
    def ListRuns(self, request, context, name):
        c = self.coordinator
        runs, token = _page(c.store.list_runs(), request, lambda r: serde.run_info(r, c.spec(r.job_id)))
        return fleet_pb2.ListRunsReply(runs=runs, next_page_token=token)

    @_handler(OPERATOR)
    def GetRun(self, request, context, name):
        c = self.coordinator
        run = c.store.get_run(request.run_id)
        missing = c.store.telemetry_steps_missing(run.run_id, run.run_metrics.steps_done)
        return serde.run_info(run, c.spec(run.job_id), telemetry_steps_missing=missing)


    @_handler(OPERATOR)
    def ListProfiles(self, request, context, name):
        versions = self.coordinator.store.list_profile_versions(request.agent or None)
        return fleet_pb2.ListProfilesReply(profiles=[serde.profile_info(v) for v in versions])

    @_handler(OPERATOR)
    def GetProfile(self, request, context, name):
        store = self.coordinator.store
        if request.version:
            version = store.get_profile_version(request.agent, request.version)
        else:
            version = store.latest_profile(request.agent)
        if version is None:
            have = [v.version for v in store.list_profile_versions(request.agent)]
            which = f"version {request.version}" if request.version else "stored profile"
            raise Refused(grpc.StatusCode.NOT_FOUND,
                           f"board {request.agent!r} has no {which} (stored versions: "
                           f"{', '.join(map(str, have)) or 'none'}); `poet run --kind profile` or `poet calibrate` "
                           f"stores one")
        return serde.profile_info(version)

    @_handler(OPERATOR)
    def Calibrate(self, request, context, name):
        from host.fleet.calibration import start_calibration

        info = start_calibration(self.coordinator.planning, request, operator=name)
        log.info("%s started calibration %s of %s", name, info.calibration_id, request.agent)
        return info

    @_handler(OPERATOR)
    def GetCalibration(self, request, context, name):
        from host.fleet.calibration import calibration_info

        return calibration_info(self.coordinator.planning, request.calibration_id)

    @_handler(OPERATOR)
    def StatModel(self, request, context, name):
        uploads = self.coordinator.uploads
        try:
            stored, received = uploads.stat(request.digest)
        except UploadError as error:
            raise Refused(UPLOAD_STATUS[error.kind], str(error)) from None
        return fleet_pb2.StatModelReply(stored=stored, received_bytes=received, max_size_bytes=uploads.max_size_bytes)

    @_handler(OPERATOR)
    def UploadModel(self, request_iterator, context, name):
        uploads = self.coordinator.uploads
        # an upload that sends nothing for download_idle_s is cancelled, freeing its thread (what arrived is kept)
        watch = IdleWatch(self.coordinator.state.download_idle_s, context.cancel)
        try:
            chunks = _progressing(request_iterator, watch)
            first = next(chunks, None)
            if first is None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "an upload without chunks: send the archive's chunks")
            try:
                stored, received = uploads.receive(first.digest, _chain(first, chunks))
            except UploadError as error:
                raise Refused(UPLOAD_STATUS[error.kind], str(error)) from None
        finally:
            watch.stop()
        if stored:
            log.info("%s uploaded model %s", name, first.digest)
        return fleet_pb2.StatModelReply(stored=stored, received_bytes=received, max_size_bytes=uploads.max_size_bytes)


def _progressing(chunks, watch: IdleWatch):
    for chunk in chunks:
        watch.progress()
        yield chunk


def _chain(first, rest):
    yield first
    yield from rest


def add_services(server: grpc.Server, coordinator: Coordinator) -> None:
    fleet_pb2_grpc.add_FleetServicer_to_server(FleetServicer(coordinator), server)
    fleet_pb2_grpc.add_FleetAdminServicer_to_server(FleetAdminServicer(coordinator), server)


SERVICE_NAMES = ("poet.v1.Fleet", "poet.v1.FleetAdmin")
