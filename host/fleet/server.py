"""Start the coordinator: a gRPC server with mutual TLS (always), the fleet services and grpc.health.v1.

The thread pool has :data:`MAX_WORKERS` threads: each PullJob long poll (up to 30 s) and each open
telemetry stream holds one for its whole duration. Boards together never hold more than the pool
minus OPERATOR_RESERVED_WORKERS (host/fleet/admission.py), so the operator's calls and health checks
are answered however many boards connect; boards over the limit are refused RESOURCE_EXHAUSTED and
retry. The pool bounds how many boards are served at once (about 56 / 2 with one poll and one stream
per board); raise it with ``max_workers``.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from device_agent.agent.client import SERVER_KEEPALIVE_OPTIONS
from host.fleet import service
from host.fleet.certs import server_credentials
from host.fleet.limits import DEFAULT_STATE_DIR, MAX_WORKERS, STOP_GRACE_S
from host.fleet.store import RunStore, sqlite_url

log = logging.getLogger("poet.fleet")

# Message bounds, and the keepalive pings the agents send allowed (else GOAWAY "too_many_pings").
SERVER_OPTIONS = tuple(SERVER_KEEPALIVE_OPTIONS)


@dataclass
class RunningCoordinator:
    """A started coordinator: its server, bound port, store and health servicer."""

    server: grpc.Server
    host: str
    port: int
    store: RunStore
    coordinator: service.Coordinator
    health: object

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = STOP_GRACE_S) -> None:
        """Stop taking calls, let those in flight finish within ``grace_s``, close the store."""
        from grpc_health.v1 import health_pb2

        self.health.enter_graceful_shutdown()
        for name in ("", *service.SERVICE_NAMES):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.coordinator.notify_work()
        self.coordinator.close()
        self.server.stop(grace_s).wait()
        self.store.close()


def split_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets) -> (host, port); ValueError naming the expected form."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{listen!r} is not HOST:PORT (e.g. 0.0.0.0:50051, or 127.0.0.1:0 for a free port)")
    return host, int(port)


def start_coordinator(listen: str, certs_dir: str | Path, *, store_url: str | None = None,
                      state_dir: str | Path = DEFAULT_STATE_DIR, max_workers: int = MAX_WORKERS,
                      **coordinator_options) -> RunningCoordinator:
    """Open the store, bind ``listen`` (port 0: a free port) with mutual TLS, start serving; health SERVING."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from host.fleet.admission import board_calls_for

    host, _ = split_listen(listen)
    board_calls = board_calls_for(max_workers)  # ValueError before anything is opened
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    credentials = server_credentials(Path(certs_dir) / "coordinator" if (Path(certs_dir) / "coordinator").is_dir()
                                     else certs_dir)
    store = RunStore(store_url or sqlite_url(state))
    coordinator = None
    try:
        coordinator = service.Coordinator(store, state, board_calls=board_calls, **coordinator_options)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="poet-rpc"),
                             options=SERVER_OPTIONS)
        service.add_services(server, coordinator)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_secure_port(listen, credentials)
        if port == 0:
            raise OSError(f"cannot listen on {listen}: the address is in use or not local")
        server.start()
    except BaseException:
        if coordinator is not None:
            coordinator.close()
        store.close()
        raise
    for name in ("", *service.SERVICE_NAMES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningCoordinator(server, host, port, store, coordinator, health_servicer)
