"""Detection in one place, best first; the agent's default meter; `poet-agent meters` as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from device_agent.meters.modelled import SOURCE as MODELLED_SOURCE
from device_agent.meters.modelled import ModelledEnergyMeter
from device_agent.meters.registry import best_meter, default_energy_meter, detect_meters, meter_names

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parents[3]


@pytest.fixture
def board(tmp_path):
    """A tree with RAPL and a Jetson's INA3221 (JetPack 5 layout)."""
    root = tmp_path / "board"
    shutil.copytree(FIXTURES / "rapl", root)
    shutil.copytree(FIXTURES / "jetson_jp5", root, dirs_exist_ok=True)
    return root


def test_board_total_meters_come_before_rapl(board, tmp_path):
    meters = detect_meters(board, path=str(FIXTURES / "pi5/bin"), start_thread=False)
    assert [m.name for m in meters] == ["ina3221", "pi5-pmic", "rapl"]
    assert [m.source for m in meters] == ["measured:ina3221", "measured:pi5-pmic", "measured:rapl"]
    assert meter_names(board, path=str(tmp_path)) == ["ina3221", "rapl"]
    assert meter_names(tmp_path, path=str(tmp_path)) == ["modelled"]
    best = best_meter(board, path=str(tmp_path), start_thread=False)
    assert best.name == "ina3221" and best.power_w() == pytest.approx(7.0)


def test_default_energy_meter_uses_the_best_meter_else_modelled(board, tmp_path):
    meter = default_energy_meter(threads=2, sysfs_root=str(board), path=str(tmp_path))
    try:
        assert meter.source == "measured:ina3221"
        assert isinstance(meter.fallback, ModelledEnergyMeter) and meter.fallback.threads == 2
        start = meter.read()
        assert start.energy_j is not None and meter._thread is not None  # sampling in the background
    finally:
        meter.close()
    modelled = default_energy_meter(threads=2, sysfs_root=str(tmp_path), path=str(tmp_path))
    assert isinstance(modelled, ModelledEnergyMeter) and modelled.source == MODELLED_SOURCE


def run_cli(*args: str, path_dir: Path) -> subprocess.CompletedProcess:
    """``python -m device_agent.cli meters ...`` with PATH = ``path_dir`` only (where vcgencmd is, or not)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=str(path_dir))
    return subprocess.run([sys.executable, "-m", "device_agent.cli", "meters", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120, check=False)


def test_poet_agent_meters_json_on_a_fixture_tree(board):
    done = run_cli("--sysfs-root", str(board), "--json", path_dir=FIXTURES / "pi5/bin")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [m["name"] for m in report["meters"]] == ["ina3221", "pi5-pmic", "rapl"]
    ina, pmic, rapl = report["meters"]
    assert ina["label"] == "measured:ina3221" and ina["power_w"] == pytest.approx(7.0) and "energy_j" not in ina
    assert pmic["label"] == "measured:pi5-pmic" and pmic["power_w"] > 0
    assert rapl["label"] == "measured:rapl" and rapl["energy_j"] == pytest.approx(3000.0) and "power_w" not in rapl
    assert report["fallback"] == MODELLED_SOURCE


def test_poet_agent_meters_table_and_nothing_found(tmp_path):
    done = run_cli("--sysfs-root", str(FIXTURES / "jetson_jp4"), path_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "measured:ina3221" in done.stdout and "5.000 W" in done.stdout and "POM_5V_IN" in done.stdout
    empty = run_cli("--sysfs-root", str(tmp_path), "--json", path_dir=tmp_path)
    assert empty.returncode == 0 and json.loads(empty.stdout) == {"meters": [], "fallback": MODELLED_SOURCE}


def test_the_meters_never_import_the_profiling_that_uses_them():
    """One way: device_agent.profiling imports the meters (and their power assumptions), never the reverse."""
    import ast
    from pathlib import Path

    import device_agent.meters

    for path in Path(device_agent.meters.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "device_agent.profiling" not in modules, path.name
