"""A real Flower deployment on loopback: a SuperLink and SuperNodes as processes, TLS as Flower configures it.

Flower's TLS is server-side: the SuperLink presents a certificate (made here with poet-edge's fleet CA tooling,
naming localhost and 127.0.0.1) and the SuperNodes and the ``flwr`` CLI check it against the CA. Runs are started
with ``flwr run APP_DIR poet --stream`` against a ``config.toml`` in a private ``FLWR_HOME``, as a user would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from host.fleet.certs import init_certs
from host.fleet.demo import Process, console_script

__all__ = ["APP_PYPROJECT", "Deployment", "free_port", "toml_value", "write_app"]

STARTUP_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 3600.0

APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "poet-flower-app"
version = "1.0.0"
description = "poet-edge inside Flower: every node trains under its own POET schedule"
license = "Apache-2.0"
dependencies = []  # poet-edge and flwr are installed on every machine already

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "poet-edge"

[tool.flwr.app.components]
serverapp = "host.flower.app:app"
clientapp = "device_agent.flower.client:app"

[tool.flwr.app.config]
{config}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: Process, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until 127.0.0.1:``port`` accepts connections (uvicorn logs its readiness on stdout, which is not kept)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise SystemExit(f"{process.label} exited with {process.proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{process.label} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_app(app_dir: str | Path, config: Mapping[str, Any]) -> Path:
    """A Flower App directory whose components are poet-edge's ServerApp and ClientApp: its run config is the
    ServerApp's defaults (host.flower.app.RUN_CONFIG; `flwr run --run-config` overrides only keys listed) with
    ``config`` over them."""
    from host.flower.app import RUN_CONFIG

    config = {**RUN_CONFIG, **config}
    app_dir = Path(app_dir)
    app_dir.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(f"{key} = {toml_value(value)}" for key, value in config.items())
    (app_dir / "pyproject.toml").write_text(APP_PYPROJECT.format(config=lines))
    return app_dir


class Deployment:
    """SuperLink + SuperNodes on 127.0.0.1 under ``root``; a context manager that stops them all on exit."""

    def __init__(self, root: str | Path, node_configs: list[Mapping[str, Any]], *, echo: bool = True) -> None:
        self.root = Path(root).resolve()
        self.node_configs = node_configs
        self.echo = echo
        self.home = self.root / "flwr-home"
        self.processes: list[Process] = []
        bin_dir = str(Path(sys.executable).parent)
        # The SuperLink starts flower-superexec and flwr-serverapp by name: the venv's must come first on PATH.
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "PATH": bin_dir + os.pathsep + os.environ["PATH"],
                    "PYTHONUNBUFFERED": "1"}

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        certs_dir = self.root / "certs"
        bundle = certs_dir / "coordinator"
        if not (bundle / "cert.pem").is_file():
            bundle = init_certs(certs_dir)
        self.ca = bundle / "ca.pem"
        self.port = free_port()
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "poet"\n\n[superlink.poet]\naddress = "127.0.0.1:{self.port}"\n'
            f"root-certificates = {toml_value(self.ca)}\n")
        link = Process("superlink", [
            console_script("flower-superlink"), "--ssl-ca-certfile", str(self.ca),
            "--ssl-certfile", str(bundle / "cert.pem"), "--ssl-keyfile", str(bundle / "key.pem"),
            "--host", "127.0.0.1", "--port", str(self.port), "--database", str(self.root / "superlink.db"),
        ], self.env, echo=self.echo)
        self.processes.append(link)
        link.wait_for("SuperLinkLifespan: start", STARTUP_TIMEOUT_S)
        _wait_for_port(self.port, link)
        for index, node_config in enumerate(self.node_configs):
            pairs = " ".join(f"{key}={toml_value(value)}" for key, value in node_config.items())
            node = Process(f"supernode-{index + 1}", [
                console_script("flower-supernode"), "--root-certificates", str(self.ca),
                "--superlink", f"127.0.0.1:{self.port}", "--port", str(free_port()), "--node-config", pairs,
            ], self.env, echo=self.echo)
            self.processes.append(node)
        for node in self.processes[1:]:
            node.wait_for("Starting Flower SuperNode", STARTUP_TIMEOUT_S)

    def run(self, app_dir: str | Path, run_config: Mapping[str, Any], timeout_s: float = RUN_TIMEOUT_S) -> str:
        """``flwr run APP_DIR poet --stream`` with ``run_config`` overrides; its output (CalledProcessError on failure)."""
        overrides = " ".join(f"{key}={toml_value(value)}" for key, value in run_config.items())
        argv = [console_script("flwr"), "run", str(app_dir), "poet", "--stream", "--run-config", overrides]
        done = subprocess.run(argv, env=self.env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
        if self.echo:
            for line in done.stdout.splitlines():
                print(f"  {'flwr run':<11}| {line}", file=sys.stderr, flush=True)
        if done.returncode != 0 or "Exit Code" in done.stdout:
            raise subprocess.CalledProcessError(done.returncode or 1, argv, done.stdout)
        return done.stdout

    def stop(self) -> list[int]:
        codes = [process.stop() for process in reversed(self.processes)]
        self.processes.clear()
        return codes
