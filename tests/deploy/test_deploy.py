"""deploy/: the systemd units (checked with `systemd-analyze verify`) and install-agent.sh, run for
real against a scratch prefix with a wheel of this repository.

`systemd-analyze verify` loads a unit the way systemd would and also checks that ExecStart's
binary exists and is executable. The shipped units point at /opt/...; the tests verify each unit
with ExecStart moved to a real executable in a temporary directory (so every *other* complaint
still fails the test), and verify the unit install-agent.sh renders, whose ExecStart is the
poet-agent it has just installed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCRIPT = DEPLOY / "install-agent.sh"
UNITS = ("poet-agent.service", "poet-coordinator.service")

needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed here")


def _verify(unit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)


@needs_systemd_analyze
@pytest.mark.parametrize("name", UNITS)
def test_unit_verifies(name, tmp_path):
    text = (DEPLOY / name).read_text()
    exec_lines = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert len(exec_lines) == 1
    binary = exec_lines[0].removeprefix("ExecStart=").split()[0]
    assert binary.startswith("/opt/") and binary.endswith(("/bin/poet-agent", "/bin/poet"))
    fake = tmp_path / Path(binary).name
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    unit = tmp_path / name
    unit.write_text(text.replace(f"ExecStart={binary} ", f"ExecStart={fake} "))
    result = _verify(unit)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


@needs_systemd_analyze
def test_shipped_agent_unit_only_lacks_its_binary():
    # As shipped, the one complaint allowed is that /opt/poet-agent/venv/bin/poet-agent is absent here.
    result = _verify(DEPLOY / "poet-agent.service")
    problems = [line for line in result.stderr.splitlines() if line.strip()]
    assert all("is not executable" in line and "/opt/poet-agent/venv/bin/poet-agent" in line
               for line in problems), result.stderr


@pytest.mark.parametrize("name", UNITS)
def test_unit_contract(name):
    text = (DEPLOY / name).read_text()
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    for wanted in ("Restart=on-failure", "User=poet", "ProtectSystem=strict", "ProtectHome=yes",
                   "PrivateTmp=yes", "NoNewPrivileges=yes", "KillSignal=SIGTERM"):
        assert wanted in settings, wanted
    assert any(s.startswith("RestartSec=") for s in settings)
    assert any(s.startswith("TimeoutStopSec=") for s in settings)
    exec_start = next(s for s in settings if s.startswith("ExecStart="))
    if name == "poet-agent.service":
        assert "EnvironmentFile=/etc/poet-agent/agent.env" in settings
        for flag, var in (("--coordinator", "POET_COORDINATOR"), ("--certs", "POET_CERTS"),
                          ("--flash-dir", "POET_FLASH_DIR"), ("--data-dir", "POET_DATA_DIR"),
                          ("--state-dir", "POET_STATE_DIR")):
            assert f"{flag} ${{{var}}}" in exec_start
        assert " run " in exec_start
        assert "MemoryMax=" in text  # documented in the comments
        # The energy meters read /sys: nothing may hide it.
        assert "PrivateDevices=yes" not in settings and "ProtectKernelTunables=yes" in settings
    else:
        assert " serve --listen ${POET_LISTEN} --certs ${POET_CERTS} --state-dir ${POET_STATE_DIR}" in exec_start
        assert "StateDirectory=poet" in settings


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed here")
def test_script_shellcheck():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ---- the install script, for real ---------------------------------------------------------------------

def _run(*args, check=False):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=600, check=check)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(REPO)], check=True, capture_output=True, timeout=300)
    (found,) = out.glob("poet_edge-*.whl")
    return found


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    # A bundle shaped like `poet certs issue` writes; the script checks files, not their contents.
    d = tmp_path_factory.mktemp("certs") / "pi-01"
    d.mkdir()
    for name in ("ca.pem", "cert.pem"):
        (d / name).write_text(f"-----BEGIN CERTIFICATE-----\n{name}\n-----END CERTIFICATE-----\n")
    (d / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n")
    (d / "key.pem").chmod(0o644)  # the script must tighten it
    return d


def _user() -> str:
    import pwd

    # Running as root, the script chowns to the service user: name the current one, so the test
    # creates no account and changes no groups on this machine.
    return pwd.getpwuid(os.getuid()).pw_name


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line and not line.startswith("#"))


@pytest.mark.slow  # 10 s of pip: the fast suite stays under 5 minutes
def test_install_into_a_prefix(tmp_path, wheel, bundle):
    prefix = tmp_path / "root"
    args = ("--wheel", wheel, "--certs", bundle, "--coordinator", "coord.lan:50051", "--prefix", prefix,
            "--flash-dir", "/mnt/nvme/poet-flash", "--memory-max", "1500M", "--platform", "a72",
            "--no-systemd", "--pip-args", "--no-deps", "--user", _user(), "--python", "python3")
    first = _run(*args)
    assert first.returncode == 0, first.stderr
    assert "skipping systemd (--no-systemd)" in first.stdout

    venv = prefix / "opt/poet-agent/venv"
    agent = venv / "bin/poet-agent"
    assert agent.is_file() and os.access(agent, os.X_OK)
    assert "poet-agent 0.1.0" in subprocess.run([str(agent), "version"], capture_output=True,
                                                  text=True, check=True).stdout
    # Installed without extras: no solver in the venv.
    assert not list((venv / "lib").glob("python*/site-packages/highspy*"))

    etc = prefix / "etc/poet-agent"
    env = _env(etc / "agent.env")
    assert env == {
        "POET_COORDINATOR": "coord.lan:50051",
        "POET_CERTS": str(etc / "certs"),
        "POET_FLASH_DIR": f"{prefix}/mnt/nvme/poet-flash",
        "POET_DATA_DIR": f"{prefix}/var/lib/poet-agent/data",
        "POET_STATE_DIR": f"{prefix}/var/lib/poet-agent",
        "POET_AGENT_ARGS": "--platform a72",
    }
    for key in ("POET_FLASH_DIR", "POET_DATA_DIR", "POET_STATE_DIR"):
        assert Path(env[key]).is_dir()
    for name in ("ca.pem", "cert.pem", "key.pem"):
        assert (etc / "certs" / name).read_bytes() == (bundle / name).read_bytes()
    assert stat.S_IMODE((etc / "certs/key.pem").stat().st_mode) == 0o600

    unit = prefix / "etc/systemd/system/poet-agent.service"
    text = unit.read_text()
    assert f"ExecStart={agent} run " in text and f"EnvironmentFile={etc}/agent.env" in text
    dropins = prefix / "etc/systemd/system/poet-agent.service.d"
    assert "MemoryMax=1500M" in (dropins / "memory.conf").read_text()
    assert f"-{prefix}/mnt/nvme/poet-flash" in (dropins / "paths.conf").read_text()
    if shutil.which("systemd-analyze"):
        result = _verify(unit)  # the rendered unit, with the poet-agent just installed
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr

    # A second run changes nothing (and keeps --platform from the first when omitted).
    snapshot = {p: p.read_bytes() for p in (etc / "agent.env", unit, dropins / "memory.conf",
                                            dropins / "paths.conf", etc / "certs/key.pem")}
    second = _run(*[a for a in args if a not in ("--platform", "a72")])
    assert second.returncode == 0, second.stderr
    assert "exists; reusing it" in second.stdout
    assert {p: p.read_bytes() for p in snapshot} == snapshot
    assert stat.S_IMODE((etc / "certs/key.pem").stat().st_mode) == 0o600
    assert sorted(p.name for p in etc.iterdir()) == ["agent.env", "certs"]  # no temp files left


@pytest.mark.slow  # ~14 s: importing torch twice, a second venv
def test_system_torch_is_reused(tmp_path, wheel, bundle):
    # A python that imports torch (this environment's) gets a venv with --system-site-packages.
    pytest.importorskip("torch")
    prefix = tmp_path / "root"
    result = _run("--wheel", wheel, "--certs", bundle, "--coordinator", "10.0.0.5:50051",
                  "--prefix", prefix, "--no-systemd", "--pip-args", "--no-deps", "--user", _user(),
                  "--python", sys.executable)
    assert result.returncode == 0, result.stderr
    assert "--system-site-packages" in result.stdout
    cfg = (prefix / "opt/poet-agent/venv/pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg


@pytest.mark.parametrize("change, message", [
    ({"--wheel": "missing.whl"}, "wheel not found"),
    ({"--wheel": "README.md"}, "not a wheel"),
    ({"--certs": "nowhere"}, "certificate bundle not found"),
    ({"--certs": "EMPTY"}, "lacks ca.pem"),
    ({"--coordinator": "coord.lan"}, "expected HOST:PORT"),
    ({"--coordinator": "coord.lan:0"}, "port must be 1-65535"),
    ({"--coordinator": "coord.lan:70000"}, "port must be 1-65535"),
    ({"--coordinator": "http://coord:1"}, "expected HOST:PORT"),
    ({"--memory-max": "lots"}, "bad --memory-max"),
    ({"--flash-dir": "relative/flash"}, "must be absolute"),
    ({"--wheel": None}, "--wheel FILE is required"),
    ({"--bogus": "x"}, "unknown argument: --bogus"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, change, message):
    wheel = tmp_path / "poet_edge-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"not used: the checks fail first")
    certs = tmp_path / "bundle"
    certs.mkdir()
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (certs / name).write_text("x")
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "README.md").write_text("x")
    options = {"--wheel": str(wheel), "--certs": str(certs), "--coordinator": "[fd00::5]:50051",
               "--prefix": str(tmp_path / "root")}
    for key, value in change.items():
        if value is None:
            options.pop(key)
        else:
            options[key] = value if key in ("--coordinator", "--memory-max", "--flash-dir", "--bogus") \
                else str(tmp_path / value)
    args = [x for kv in options.items() for x in kv] + ["--no-systemd"]
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr and "error:" in result.stderr, result.stderr
    assert not (tmp_path / "root").exists()
