"""What a board gets: the wheel, installed without extras into a fresh virtual environment.

Builds the wheel from a copy of the checkout's tracked and unignored files (what a clean clone has),
installs it with `-c constraints.txt` (so pip takes the CPU torch build, not a CUDA one) and checks
that the agent runs, reads a schedule file the host wrote, and came without any solver.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from device_agent import protos
from device_agent.serde import read_schedule_file

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST_ONLY_DISTRIBUTIONS = ("highspy", "pulp", "matplotlib", "grpcio-tools", "transformers")

pytestmark = pytest.mark.slow


def _run(args: list, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert run.returncode == 0, f"{args} failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def _copy_checkout(target: Path) -> None:
    """The files a clean clone would have, plus untracked ones that are not ignored."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know which files a clone has")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is listed but absent
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point the new venv back at the dev one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def test_wheel_installs_the_agent_alone_and_reads_a_host_schedule(tmp_path):
    source, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    schedule_path = tmp_path / "mlp_a72.schedule.json"
    env = _clean_env()

    # The host writes a schedule (in the dev environment) while the wheel is built and installed.
    poet = Path(sys.executable).with_name("poet")
    host_solve = subprocess.Popen(
        [str(poet), "solve", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--out", str(schedule_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )
    try:
        _copy_checkout(source)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", dist, source], env=env)
        (wheel,) = dist.glob("poet_edge-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            shipped = set(archive.namelist())
        stubs = {f"device_agent/_generated/{name}" for name in protos.committed_stubs()}
        assert "device_agent/_generated/poet/v1/schedule_pb2.py" in stubs
        assert stubs <= shipped, f"the wheel lacks stubs: {sorted(stubs - shipped)}"
        assert "poet/__init__.py" in shipped  # the paper's face ships, and refuses to load without the host extra

        _run([sys.executable, "-m", "venv", venv], env=env)
        python = venv / "bin" / "python"
        _run([python, "-m", "pip", "install", "-c", source / "constraints.txt", wheel], env=env, cwd=tmp_path)
    finally:
        solve_output, _ = host_solve.communicate(timeout=600)
    assert host_solve.returncode == 0, solve_output

    agent_help = _run([venv / "bin" / "poet-agent", "--help"], env=env, cwd=tmp_path)
    assert "usage: poet-agent" in agent_help.stdout

    # Run from tmp_path so that nothing of the checkout is importable: only the installed wheel is.
    probe = textwrap.dedent(f"""
        import dataclasses, importlib.metadata, importlib.util, json
        import device_agent
        import device_agent.serial_bridge.bridge  # the serial bridge installs with the agent, without the solver
        from device_agent.serde import read_schedule_file

        try:
            import poet
            poet_import = "imported"
        except ImportError as error:
            poet_import = str(error)

        def installed(name):
            try:
                importlib.metadata.distribution(name)
                return True
            except importlib.metadata.PackageNotFoundError:
                return False

        print(json.dumps({{
            "agent_file": device_agent.__file__,
            "schedule": dataclasses.asdict(read_schedule_file({str(schedule_path)!r})),
            "present": [n for n in {HOST_ONLY_DISTRIBUTIONS!r} if installed(n)],
            "importable": [m for m in ("highspy", "pulp", "grpc_tools") if importlib.util.find_spec(m)],
            "cuda": [d.metadata["Name"] for d in importlib.metadata.distributions()
                     if d.metadata["Name"].lower().startswith("nvidia")],
            "torch": importlib.metadata.version("torch"),
            "poet_import": poet_import,
        }}))
    """)
    report = json.loads(_run([python, "-c", probe], env=env, cwd=tmp_path).stdout)

    assert Path(report["agent_file"]).is_relative_to(venv), report["agent_file"]
    expected = json.loads(json.dumps(dataclasses.asdict(read_schedule_file(schedule_path))))
    assert report["schedule"] == expected
    assert report["schedule"]["graph_name"] == "mlp" and report["schedule"]["instructions"]
    assert report["present"] == [], f"host-only packages came with the agent: {report['present']}"
    assert report["importable"] == [], f"solver or generator modules are importable: {report['importable']}"
    assert "pip install poet-edge[host]" in report["poet_import"], report["poet_import"]
    # constraints.txt held torch at the CPU build of 2.13.0: no CUDA libraries came with it.
    assert report["torch"].startswith("2.13.0") and report["cuda"] == [], (report["torch"], report["cuda"])
