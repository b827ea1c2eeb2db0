"""bench/solver.py --hard --local-profile: a run's measured local profile is kept, and a second run prices on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _hard_local_row(profile_path: Path, cwd: Path) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "solver.py"), "--hard", "resnet18_cifar@50%:local", "--time-limit", "5",
         "--json", "--local-profile", str(profile_path)],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out.stdout)["rows"]
    return row, out.stderr


def test_a_saved_local_profile_prices_the_next_run(tmp_path):
    profile_path = tmp_path / "local.json"
    first, first_log = _hard_local_row(profile_path, tmp_path)
    assert "measured the local profile; saved it to" in first_log and profile_path.exists()
    second, second_log = _hard_local_row(profile_path, tmp_path)
    assert "reading the local profile from" in second_log and "measured" not in second_log
    # Each quick measurement differs; priced on the same file, computing every node once costs the same. (The
    # baselines' energies are no witness: their search stops at deadlines, so two runs may end it apart.)
    assert second["compute_once_energy_j"] == first["compute_once_energy_j"] > 0
    assert second["ram_budget_bytes"] == first["ram_budget_bytes"]


def test_a_malformed_local_profile_is_named_with_its_fix(tmp_path):
    profile_path = tmp_path / "local.json"
    profile_path.write_text('{"name": "local", "flash": ')
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "solver.py"), "--hard", "resnet18_cifar@50%:local", "--local-profile",
         str(profile_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"--local-profile: {profile_path}: invalid JSON" in out.stderr and "remove it to measure" in out.stderr
    assert not out.stdout


def test_a_local_profile_in_a_missing_directory_is_refused_before_any_work(tmp_path):
    profile_path = tmp_path / "missing" / "local.json"
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "solver.py"), "--hard", "resnet18_cifar@50%:local", "--local-profile",
         str(profile_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--local-profile: directory '{profile_path.parent}' does not exist" in out.stderr
    assert "measured the local profile" not in out.stderr and "resnet18_cifar@50%" not in out.stderr  # no work done
    assert not out.stdout


@pytest.mark.slow  # ~30 s: traces MobileNetV2
def test_the_hard_tables_test_model_resolves_from_another_directory(tmp_path):
    """MobileNetV2's hard cases name a test model (tests.models.huggingface): run from outside the repository, the
    table still finds it (it once ended 17 minutes in with a traceback)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "solver.py"), "--hard", "mobilenet_v2@50%:a72", "--time-limit", "5",
         "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out.stdout)["rows"]
    assert row["case"] == "mobilenet_v2@50%:a72" and row["nodes"] == 410 and row["poet_energy_j"] > 0
