"""A real PostgreSQL server for the run store's tests, started with pg_ctl in a temporary directory.

The server (one per test session) listens on a free loopback port with its unix socket in the
same temporary directory, trusts local connections, and is stopped and deleted at the end. The
PostgreSQL binaries are found on PATH or under /usr/lib/postgresql/<N>/bin (Debian's
`postgresql` package, which `make setup` installs). PostgreSQL refuses to run as root, so as root
the cluster is created and run as the `postgres` user the package creates (through runuser or
setpriv). Where that is impossible the PostgreSQL tests skip with the reason.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

PG_USER = "poet"


@dataclass
class PostgresServer:
    port: int
    socket_dir: Path
    _databases = itertools.count(1)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"store_test_{os.getpid()}_{next(self._databases)}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=PG_USER, dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _find_binaries() -> tuple[str, str] | None:
    for directory in [None, *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]:
        initdb = shutil.which("initdb", path=directory)
        pg_ctl = shutil.which("pg_ctl", path=directory)
        if initdb and pg_ctl:
            return initdb, pg_ctl
    return None


def _as_user_prefix() -> tuple[list[str], pwd.struct_passwd | None] | str:
    """The command prefix that runs a PostgreSQL binary unprivileged, or why there is none."""
    if os.geteuid() != 0:
        return [], None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        return "running as root and there is no unprivileged 'postgres' user to run the server as"
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--"], user
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"], user
    return "running as root and neither runuser nor setpriv is available to drop to the 'postgres' user"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_server():
    binaries = _find_binaries()
    if binaries is None:
        pytest.skip("PostgreSQL tests: no initdb/pg_ctl on PATH or in /usr/lib/postgresql/*/bin "
                    "(install Debian's `postgresql` package; `make setup` does)")
    prefix = _as_user_prefix()
    if isinstance(prefix, str):
        pytest.skip(f"PostgreSQL tests: {prefix}")
    command_prefix, user = prefix
    initdb, pg_ctl = binaries
    # Not pytest's tmp_path: its parents are 0700 root, which the postgres user cannot enter.
    root = Path(tempfile.mkdtemp(prefix="poet-pg-"))
    data, log = root / "data", root / "server.log"
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*command_prefix, *args], capture_output=True, text=True, timeout=120, cwd=root)

    started = False
    try:
        result = run(initdb, "-D", str(data), "-U", PG_USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        if result.returncode != 0:
            pytest.fail(f"initdb failed:\n{result.stdout}\n{result.stderr}")
        for _attempt in range(3):  # another process may take the free port between choosing and binding it
            port = _free_port()
            options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
            result = run(pg_ctl, "-D", str(data), "-o", options, "-l", str(log), "-w", "-t", "60", "start")
            if result.returncode == 0:
                started = True
                break
        if not started:
            text = log.read_text() if log.exists() else ""
            pytest.fail(f"pg_ctl start failed:\n{result.stdout}\n{result.stderr}\n{text}")
        yield PostgresServer(port=port, socket_dir=root)
    finally:
        if started:
            run(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------ coordinator
@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    """A CA with the coordinator's certificate, nodes pi-1, pi-2, pi-3, pi-gone and pi-small, operator alice."""
    from host.fleet import certs

    root = tmp_path_factory.mktemp("certs") / "fleet"
    certs.init_certs(root)
    for name in ("pi-1", "pi-2", "pi-3", "pi-gone", "pi-small"):
        certs.issue_cert(root, name, "node")
    certs.issue_cert(root, "alice", "operator")
    return root


@pytest.fixture
def coordinator(cert_dir, tmp_path):
    """A coordinator started in this process on a free loopback port, with its own state dir."""
    from host.fleet.server import start_coordinator

    running = start_coordinator("127.0.0.1:0", cert_dir, state_dir=tmp_path / "state")
    yield running
    running.stop(grace_s=0)
