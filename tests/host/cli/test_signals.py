"""SIGTERM (systemd, docker stop, timeout) and Ctrl-C stop training cleanly: pages removed, exit 143 / 130."""

import os
import signal
import subprocess
import time

import pytest

from device_agent.serde import read_schedule_file
from host.cli.common import EXIT_INTERRUPTED, EXIT_TERMINATED
from tests.host.cli.helpers import POET, one_json_object, test_env


@pytest.mark.parametrize("signum,exit_code", [(signal.SIGTERM, EXIT_TERMINATED), (signal.SIGINT, EXIT_INTERRUPTED)])
def test_a_signal_during_training_removes_the_pages(tmp_path, signum, exit_code):
    flash = tmp_path / "flash"
    flash.mkdir()
    process = subprocess.Popen(
        [str(POET), "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--steps", "100000",
         "--flash-dir", str(flash)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env(),
    )
    try:
        deadline = time.monotonic() + 300
        for line in process.stderr:  # the first step's progress line: training (and paging) has started
            if "1/100000" in line:
                break
            assert time.monotonic() < deadline, "training did not start"
        else:
            pytest.fail(f"poet train ended before training: {process.wait()}")
        time.sleep(0.5)  # some steps into training: each pages out and back in
        process.send_signal(signum)
        _, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == exit_code, rest
    assert ("terminated" if signum == signal.SIGTERM else "interrupted") in rest
    assert "Traceback" not in rest
    assert os.listdir(flash) == [], os.listdir(flash)  # no page directory, no staging directory


# (the solve's arguments, its RAM budget in bytes, the phase the signal comes in, seconds into that phase)
# --mip-gap is below the gap its best baseline is proven within, so the MILP runs. Paging only (--no-remat): no second
# covering problem runs, the ejection moves end their passes in seconds, and the MILP starts about 11 s in (with
# recomputation too it started 112 s in: the second problem and both ejection searches take their shares first).
SOLVING = (["--model", "poet2022:resnet18_cifar", "--platform", "m4", "--ram-budget", "737719", "--runtime-budget",
            "1.5", "--mip-gap", "1e-8", "--no-remat"],
           737719, "solving", 3.0)
# resnet18_cifar at 40% on jetsontx2: the first bound does not prove the greedy, and the second problem takes 3.5 s
STRONGER_BOUND = (["--model", "resnet18_cifar", "--platform", "jetsontx2", "--ram-budget", "40%", "--time-limit", "60"],
                  None, "stronger lower bound", 0.5)
# the same solve, stopped while ejection moves improve the greedy (the second bound leaves it 0.77% from the bound)
EJECTION_SEARCH = (STRONGER_BOUND[0], None, "ejection search", 0.2)


@pytest.mark.parametrize("signum,exit_code,case", [
    pytest.param(signal.SIGINT, EXIT_INTERRUPTED, SOLVING, marks=pytest.mark.slow),  # ~20 s each: it waits for the MILP
    pytest.param(signal.SIGTERM, EXIT_TERMINATED, SOLVING, marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, EXIT_INTERRUPTED, STRONGER_BOUND, marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, EXIT_INTERRUPTED, EJECTION_SEARCH, marks=pytest.mark.slow),
])
def test_a_signal_during_a_solve_keeps_the_incumbent(tmp_path, signum, exit_code, case):
    """Stopped while solving, or after the baselines (while the stronger bound is proven, or ejection moves run): the
    best schedule so far is reported (marked interrupted) and written."""
    arguments, budget_bytes, phase, wait_s = case
    out = tmp_path / "r18.schedule.json"
    process = subprocess.Popen(
        [str(POET), "solve", *arguments, "--json", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env(),
    )
    try:
        for line in process.stderr:  # phases are printed as they begin
            if line.strip().startswith(phase):
                break
        else:
            pytest.fail(f"poet solve ended before {phase}: {process.wait()}")
        time.sleep(wait_s)
        process.send_signal(signum)
        stdout, rest = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == exit_code, rest
    summary = one_json_object(stdout)
    assert summary["interrupted"] is True and summary["status"] == "feasible", summary
    assert summary["peak_ram_bytes"] <= (budget_bytes or summary["ram_budget_bytes"])
    assert summary["schedule_file"] == str(out)
    assert read_schedule_file(out).instructions
