"""The state every role of the coordinator shares: the run store, the state dir, the job specs, the work signal and the
boards' call slots. The roles (auth, jobs, planning, ingestion) read and write through it; the servicers
(host/fleet/service.py) only turn requests into their calls.

All lasting state lives in the run store and the state dir, so a coordinator restarted on the same store (even after
kill -9) hands out the same jobs: the job spec (model digest, grouping, graph, hyperparameters) and its solved
schedules are stored with the job; model archives are ``STATE_DIR/models/<sha256>.pt2``, collected weights
``STATE_DIR/results/<run_id>.safetensors``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from host.fleet.admission import CallSlots
from host.fleet.limits import DOWNLOAD_IDLE_S, HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S
from host.fleet.store import RunStore
from host.fleet.uploads import UploadedArchives

MODELS_DIR, RESULTS_DIR = "models", "results"


class FleetState:
    """The store, the state dir and what the roles keep in memory between calls."""

    def __init__(self, store: RunStore, state_dir: str | Path, *, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, download_idle_s: float = DOWNLOAD_IDLE_S,
                 board_calls: int | None = None):
        self.store = store
        self.state_dir = Path(state_dir)
        self.models_dir = self.state_dir / MODELS_DIR
        self.results_dir = self.state_dir / RESULTS_DIR
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.uploads = UploadedArchives(self.models_dir)  # archives operators traced and uploaded
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.download_idle_s = download_idle_s
        self.slots = CallSlots(board_calls=board_calls)  # boards' open calls (host/fleet/admission.py)
        self.work = threading.Condition()  # notified whenever work may have appeared
        self.generation = 0  # bumped with each notification
        self._specs: dict[str, dict[str, Any]] = {}  # job_id -> spec (immutable once stored)
        self.calibrations: dict[str, Any] = {}  # calibration id -> host.fleet.calibration.Calibration (in memory)
        self.solvers = None  # the coordinator's host.fleet.solving.SolverPool (None: only other processes solve)
        self._schedule_texts: dict[str, str] = {}  # schedule key -> schedule JSON (immutable once solved)

    def notify_work(self) -> None:
        with self.work:
            self.generation += 1
            self.work.notify_all()

    def wake_solvers(self) -> None:
        """A solve was queued: an idle solver worker of this coordinator claims it now."""
        if self.solvers is not None:
            self.solvers.wake()

    def schedule_json(self, spec: dict[str, Any], schedule_key: str | None) -> str | None:
        """The schedule a run names: in its job's spec (jobs stored before solves were queued) or solved in the
        store; None when there is none (yet)."""
        if not schedule_key:
            return None
        text = (spec.get("schedules") or {}).get(schedule_key) or self._schedule_texts.get(schedule_key)
        if text is None:
            solved = self.store.get_solve(schedule_key)
            if solved is not None and solved.state == "done" and solved.result.get("schedule_json"):
                text = self._schedule_texts[schedule_key] = solved.result["schedule_json"]
        return text

    def spec(self, job_id: str) -> dict[str, Any]:
        spec = self._specs.get(job_id)
        if spec is None:
            spec = self.store.get_job(job_id).spec
            self._specs[job_id] = spec
        return spec

    def remember_spec(self, job_id: str, spec: dict[str, Any]) -> None:
        """A job just stored: its spec, without reading it back."""
        self._specs[job_id] = spec
