"""Helpers the fleet tests share."""

from __future__ import annotations

import time

from host.fleet.serde import fleet_pb2

SOLVED_TIMEOUT_S = 120.0


def solved_runs(admin_stub, runs, timeout_s: float = SOLVED_TIMEOUT_S) -> list:
    """The runs of a SubmitRun reply once none is solving (their schedules solved, or not fitting), as GetRun reads
    them, in the reply's order."""
    latest = {run.run_id: run for run in runs}
    deadline = time.monotonic() + timeout_s
    while True:
        solving = [run_id for run_id, run in latest.items() if run.status == fleet_pb2.RUN_STATUS_SOLVING]
        if not solving:
            return [latest[run.run_id] for run in runs]
        assert time.monotonic() < deadline, f"runs still solving after {timeout_s} s: {solving}"
        time.sleep(0.1)
        for run_id in solving:
            latest[run_id] = admin_stub.GetRun(fleet_pb2.GetRunRequest(run_id=run_id), timeout=30)
