"""A run's status, spelled once: the store keeps its value, the proto's RunStatus mirrors it (host/fleet/serde.py),
and the coordinator, calibration and the CLI compare with its members. A StrEnum, so a stored or JSON string equals
its member."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    SOLVING = "solving"  # recorded; its schedule is being solved (host/fleet/solving.py), then queued
    QUEUED = "queued"  # waiting for its board to pull it
    RUNNING = "running"  # handed to its board by PullJob
    DONE = "done"
    FAILED = "failed"
    DOES_NOT_FIT = "does_not_fit"  # the board's budget is below the schedule's hard floor: never handed out

    @property
    def finished(self) -> bool:
        """Nothing more will happen to the run: a result stands and is never changed."""
        return self in FINISHED

    @property
    def unsuccessful(self) -> bool:
        """The run failed or could not run (the CLI's exit 6; a board stops such a job)."""
        return self in (RunStatus.FAILED, RunStatus.DOES_NOT_FIT)


FINISHED = frozenset({RunStatus.DONE, RunStatus.FAILED, RunStatus.DOES_NOT_FIT})
OPEN = (RunStatus.QUEUED, RunStatus.RUNNING)  # a board's work: handed out, or to be
# From each status, the statuses an update may move a run to. A finished status may be reported again (an agent
# resends its result after a reconnect) but never changed.
TRANSITIONS = {
    RunStatus.SOLVING: frozenset({RunStatus.SOLVING, RunStatus.QUEUED, RunStatus.DOES_NOT_FIT, RunStatus.FAILED}),
    RunStatus.QUEUED: frozenset(RunStatus) - {RunStatus.SOLVING},
    RunStatus.RUNNING: frozenset({RunStatus.RUNNING, RunStatus.QUEUED, RunStatus.DONE, RunStatus.FAILED}),
    RunStatus.DONE: frozenset({RunStatus.DONE}),
    RunStatus.FAILED: frozenset({RunStatus.FAILED}),
    RunStatus.DOES_NOT_FIT: frozenset({RunStatus.DOES_NOT_FIT}),
}
