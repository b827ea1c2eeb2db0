"""Fixtures for the fleet's end-to-end tests: real `poet serve` and `poet-agent run` processes on loopback.

Every process is started from the installed console scripts, its stderr drained into a list by a
thread (so a full pipe never blocks it), and stopped (SIGTERM, then SIGKILL) when the test ends.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.host.cli.helpers import one_json_object, test_env

BIN = Path(sys.executable).parent
POET, POET_AGENT = BIN / "poet", BIN / "poet-agent"
START_TIMEOUT_S = 60
CALL_TIMEOUT_S = 120
NODES = ("b1", "b2", "b3")
OPERATOR = "alice"


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Process:
    """A subprocess whose stderr lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str], label: str):
        self.label = label
        self.argv = argv
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._drains = [threading.Thread(target=self._drain, args=(self.process.stderr, True), daemon=True),
                        threading.Thread(target=self._drain, args=(self.process.stdout, False), daemon=True)]
        for thread in self._drains:
            thread.start()

    def _drain(self, stream, keep: bool) -> None:
        for line in stream:
            if keep:
                self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return "".join(self.lines)

    def has(self, pattern: str) -> re.Match | None:
        regex = re.compile(pattern)
        for line in list(self.lines):
            match = regex.search(line)
            if match:
                return match
        return None

    def wait_for(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            match = self.has(pattern)
            if match:
                return match
            if self.process.poll() is not None:
                for thread in self._drains:
                    thread.join(5)
                match = self.has(pattern)
                if match:
                    return match
                raise AssertionError(f"{self.label} exited ({self.process.returncode}) before printing "
                                     f"/{pattern}/:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.label} did not print /{pattern}/ within {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float = CALL_TIMEOUT_S) -> int:
        code = self.process.wait(timeout_s)
        for thread in self._drains:
            thread.join(5)
        return code

    def kill9(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.wait_exit()

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, and the exit code; SIGKILL when it does not stop in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.wait_exit(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.wait_exit()
            raise AssertionError(f"{self.label} ignored SIGTERM for {timeout_s} s:\n{self.log()}") from None


class Coordinator(Process):
    def __init__(self, cert_dir: Path, state_dir: Path, listen: str = "127.0.0.1:0"):
        self.cert_dir, self.state_dir = cert_dir, state_dir
        super().__init__([str(POET), "serve", "--listen", listen, "--certs", str(cert_dir),
                          "--state-dir", str(state_dir)], test_env(), f"poet serve ({listen})")
        self.address = self.wait_for(r"^listening on (\S+)$").group(1)
        self.port = int(self.address.rsplit(":", 1)[1])


class Agent(Process):
    def __init__(self, name: str, coordinator: str, bundle: Path, root: Path, *, extra: tuple[str, ...] = (),
                 flash_dir: Path | None = None):
        self.name, self.root = name, root
        self.flash_dir = flash_dir or root / "flash"
        self.data_dir, self.state_dir = root / "data", root / "state"
        env = test_env() | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "POET_AGENT_MAX_BACKOFF_S": "1"}
        super().__init__([str(POET_AGENT), "run", "--coordinator", coordinator, "--certs", str(bundle),
                          "--flash-dir", str(self.flash_dir), "--data-dir", str(self.data_dir),
                          "--state-dir", str(self.state_dir), "--max-backoff-s", "1", *extra], env, f"agent {name}")


class Fleet:
    """One test's fleet: a coordinator, agents, and the operator's commands against it."""

    def __init__(self, cert_dir: Path, shards: dict[str, Path], tmp: Path):
        self.cert_dir, self.shards, self.tmp = cert_dir, shards, tmp
        self.state_dir = tmp / "coordinator"
        self.coordinator: Coordinator | None = None
        self.processes: list[Process] = []

    # -- processes --------------------------------------------------------------------------------
    def serve(self, listen: str = "127.0.0.1:0") -> Coordinator:
        self.coordinator = Coordinator(self.cert_dir, self.state_dir, listen)
        self.processes.append(self.coordinator)
        return self.coordinator

    def board_dir(self, name: str, shard: str = "1/2") -> Path:
        """ROOT/NAME with data/ holding the `digits` shard (a copy of the session's `make-demo` output)."""
        root = self.tmp / "boards" / name
        if not (root / "data").exists():
            shutil.copytree(self.shards[shard], root / "data")
        return root

    def agent(self, name: str, shard: str = "1/2", *, bundle: Path | None = None, coordinator: str | None = None,
              extra: tuple[str, ...] = (), flash_dir: Path | None = None, registered: bool = True) -> Agent:
        root = self.board_dir(name, shard)
        agent = Agent(name, coordinator or self.coordinator.address, bundle or self.cert_dir / name, root,
                      extra=extra, flash_dir=flash_dir)
        self.processes.append(agent)
        if registered:
            agent.wait_for(r"registered with ")
        return agent

    def close(self) -> None:
        for process in reversed(self.processes):
            if process.process.poll() is None:
                try:
                    process.stop(15)
                except AssertionError:
                    pass

    # -- the operator ------------------------------------------------------------------------------
    def poet(self, *argv: str, timeout_s: float = CALL_TIMEOUT_S) -> subprocess.CompletedProcess:
        env = test_env() | {"POET_COORDINATOR": self.coordinator.address,
                            "POET_CERTS": str(self.cert_dir / OPERATOR)}
        return subprocess.run([str(POET), *argv], capture_output=True, text=True, timeout=timeout_s, env=env)

    def poet_json(self, *argv: str, ok_codes=(0,), timeout_s: float = CALL_TIMEOUT_S) -> dict:
        done = self.poet(*argv, "--json", timeout_s=timeout_s)
        assert done.returncode in ok_codes, f"poet {' '.join(argv)} exited {done.returncode}:\n{done.stderr}"
        return one_json_object(done.stdout)

    def submit(self, *agents: str, steps: int, kind: str = "train", budget: str = "80%", wait: bool = False,
               seed: int = 0, batch_size: int = 16, ok_codes=(0,), timeout_s: float = CALL_TIMEOUT_S) -> list[dict]:
        who = ("--agents", ",".join(agents)) if agents else ("--all",)
        argv = ["run", "--model", "mlp", "--dataset", "digits", "--steps", str(steps), "--ram-budget", budget,
                *who, "--kind", kind, "--batch-size", str(batch_size), "--seed", str(seed)]
        if wait:
            argv.append("--wait")
        return self.poet_json(*argv, ok_codes=ok_codes, timeout_s=timeout_s)["runs"]

    def show(self, run_id: str) -> dict:
        return self.poet_json("runs", "show", run_id)

    def wait_run(self, run_id: str, timeout_s: float = 90, until=("done", "failed", "does_not_fit")) -> dict:
        return wait_until(lambda: (run := self.show(run_id))["status"] in until and run, timeout_s,
                          f"run {run_id} to reach {until}", interval_s=0.3)

    def wait_settled(self, run_id: str, timeout_s: float = 120) -> dict:
        """The run once it ended and (when done) the coordinator stored every event the board emitted.

        The result and the telemetry travel apart: a result can arrive while its last events are in flight.
        """
        self.wait_run(run_id, timeout_s)
        return wait_until(lambda: ((run := self.show(run_id))["status"] != "done"
                                   or run["events_stored"] >= run["events_emitted"]) and run, 60,
                          f"the events of run {run_id} to be stored", interval_s=0.3)

    def wait_steps(self, run_id: str, at_least: int, timeout_s: float = 60) -> dict:
        """Poll the coordinator's store directly (every 20 ms; a `poet runs show` takes a second): runs of
        the small test model take a few ms per step, so a kill or a cut must land while the run is young."""
        from host.fleet.store import RunStore, sqlite_url

        with RunStore(sqlite_url(self.state_dir)) as store:
            def progressed():
                record = store.get_run(run_id)
                run = {**record.as_json(), "steps_done": int(record.metrics.get("steps_done") or 0)}
                assert run["status"] in ("queued", "running"), f"run ended before step {at_least}: {run}"
                return run["steps_done"] >= at_least and run
            return wait_until(progressed, timeout_s, f"run {run_id} to pass step {at_least}", interval_s=0.02)

    def fleet_list(self) -> list[dict]:
        return self.poet_json("fleet", "list")["agents"]


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory) -> Path:
    """A CA with the coordinator's certificate, nodes b1..b3 and the operator alice (what `poet certs` writes)."""
    from host.fleet import certs

    root = tmp_path_factory.mktemp("e2e-certs") / "ca"
    certs.init_certs(root)
    for name in NODES:
        certs.issue_cert(root, name, "node")
    certs.issue_cert(root, OPERATOR, "operator")
    return root


@pytest.fixture(scope="session")
def foreign_cert_dir(tmp_path_factory) -> Path:
    """Another CA, with a node named b1 like the real one."""
    from host.fleet import certs

    root = tmp_path_factory.mktemp("e2e-foreign-certs") / "ca"
    certs.init_certs(root)
    certs.issue_cert(root, "b1", "node")
    return root


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    """Shards 1/2 and 2/2 of digits (what `poet-agent datasets make-demo --shard I/2` writes), one data dir each."""
    from device_agent.agent.demo_data import make_demo, parse_shard

    made = {}
    for shard in ("1/2", "2/2"):
        data_dir = tmp_path_factory.mktemp(f"e2e-shard-{shard.replace('/', 'of')}")
        make_demo(data_dir, "digits", parse_shard(shard), 0, False)
        made[shard] = data_dir
    return made


@pytest.fixture
def fleet(cert_dir, shards, tmp_path):
    """A Fleet for this test (no coordinator yet: call fleet.serve()); every process stops at the end."""
    the_fleet = Fleet(cert_dir, shards, tmp_path)
    try:
        yield the_fleet
    finally:
        the_fleet.close()


def dump(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)


class Proxy:
    """A TCP proxy on 127.0.0.1 to ``upstream``; :meth:`sever` closes every connection it carries."""

    def __init__(self, upstream: str):
        import socket

        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.severed = 0
        self._lock = threading.Lock()
        self._sockets: set = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.accepted += 1
                self._sockets |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source, sink) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._close(source)
            self._close(sink)

    def _close(self, sock) -> None:
        import socket

        with self._lock:
            self._sockets.discard(sock)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    def sever(self, wait_s: float = 30.0) -> int:
        """Cut every open connection (both directions); returns how many sockets were closed. With none open (the
        agent between a cut and its reconnect, backing off), waits up to ``wait_s`` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                sockets = list(self._sockets)
            if sockets or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for sock in sockets:
            self._close(sock)
        self.severed += 1
        return len(sockets)

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.sever()
