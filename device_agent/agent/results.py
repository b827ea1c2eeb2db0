"""Results waiting for the coordinator's acknowledgement, kept on disk so they survive a restart.

A finished job's ``RunResult`` is written atomically to ``STATE_DIR/runs/<run_id>/result.pb`` before it
is reported, and deleted once ``ReportResult`` succeeded; an agent that starts re-sends every file it
finds before it pulls new work.
"""

from __future__ import annotations

import os
from pathlib import Path

from device_agent.fileio import atomic_write_bytes
from device_agent.protos import load

__all__ = ["RESULT_FILE", "PendingResults"]

fleet_pb2 = load("poet.v1.fleet_pb2")

RESULT_FILE = "result.pb"


class PendingResults:
    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.runs_dir = Path(state_dir) / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)

    def path(self, run_id: str) -> Path:
        return self.runs_dir / run_id / RESULT_FILE

    def save(self, result) -> Path:
        path = self.path(result.run_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, result.SerializeToString())
        return path

    def pending(self) -> list:
        """Every saved result, oldest first; an unreadable file is skipped and left for inspection."""
        found = []
        for path in sorted(self.runs_dir.glob(f"*/{RESULT_FILE}"), key=lambda p: p.stat().st_mtime):
            try:
                found.append(fleet_pb2.RunResult.FromString(path.read_bytes()))
            except Exception:  # noqa: BLE001  (a damaged file must not stop the agent)
                continue
        return found

    def done(self, run_id: str) -> None:
        self.path(run_id).unlink(missing_ok=True)
