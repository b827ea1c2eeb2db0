"""bench/executor.py --json: one JSON object on stdout, with every part's rows and every method's fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERHEAD_FIELDS = {"allocator", "granularity", "nodes", "plain_s_per_step", "poet_s_per_step", "ratio", "floor_ratio",
                   "overhead_us_per_instruction", "autograd_s_per_step", "autograd_ratio",
                   "autograd_overhead_us_per_instruction", "lowered", "autograd_nodes", "plain_page_faults_per_step",
                   "poet_page_faults_per_step"}
METHOD_FIELDS = {"model", "budget_share", "method", "s_per_step", "j_per_step", "energy_source", "peak_rss_bytes",
                 "peak_rss_after_trim_bytes", "process_rss_bytes", "tracked_bytes", "fits_budget", "note"}


@pytest.mark.slow
def test_json_has_both_parts_and_every_method(tmp_path):
    """mlp at 80% (POET is feasible there), 2 steps: both parts' rows, each method once, POET within its budget;
    POET's rows at the granularity asked for (its own trace, solve and executor partition)."""
    out = subprocess.run(
        [sys.executable, "bench/executor.py", "--json", "--models", "mlp", "--budgets", "80%", "--steps", "2",
         "--overhead-steps", "2", "--no-calibrate", "--time-limit", "20", "--granularity", "block:1",
         "--flash-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)  # the whole of stdout is one JSON object; the tables went to stderr
    assert "## 2. mlp" in out.stderr

    assert len(report["overhead"]) == 6  # two allocator settings x three granularities
    for row in report["overhead"]:
        assert OVERHEAD_FIELDS <= row.keys()
        assert row["plain_s_per_step"] > 0 and row["poet_s_per_step"] > 0 and row["autograd_s_per_step"] > 0
        assert row["autograd_nodes"] == 0  # every mlp node splits into forward and backward ...
        assert row["lowered"]  # ... so the timed steps ran as the straight-line program

    rows = {row["method"]: row for row in report["methods"]}
    assert len(rows) == len(report["methods"])  # one share: each method once
    assert {"plain", "POET", "checkpoint_sequential(2)", "per-block checkpoint", "selective checkpoint (per block)",
            "torch.compile", "save_on_cpu"} <= rows.keys()
    for row in rows.values():
        assert METHOD_FIELDS <= row.keys(), row["method"]
        assert row["budget_share"] == 0.8
        assert row.get("error") or (row["s_per_step"] > 0 and row["j_per_step"] > 0), row
    plain, poet = rows["plain"], rows["POET"]
    assert plain["tracked_bytes"] > 0 and plain["fits_budget"] is False
    # the step's peak above the step start, in steady state and after a heap trim; the whole process holds more
    assert plain["process_rss_bytes"] > plain["peak_rss_bytes"] > 0 and plain["peak_rss_after_trim_bytes"] > 0
    [budget] = report["budgets"]
    assert 0 < poet["tracked_bytes"] <= budget["budget_bytes"] * 1.001 and poet["fits_budget"] is True
    assert poet["granularity"] == budget["granularity"] == "block:1" and "block:1 nodes" in poet["note"]
    assert "plain training" in rows["save_on_cpu"]["note"]
