"""One wall-clock deadline for a whole solve: every phase (warm start, model building, MILP, polishing,
validation) asks it how much time is left, so the time limit is a promise, not a hint to the MILP alone."""

from __future__ import annotations

import math
import threading
import time

# Every solve stops here unless told otherwise, and returns its best schedule with its gap.
DEFAULT_TIME_LIMIT_S = 300.0
DEMO_TIME_LIMIT_S = 60.0  # `poet demo` solves for this machine while the user watches


class DeadlineExpired(Exception):
    """The solve's time limit passed during ``phase``; the caller falls back to its best validated schedule."""

    def __init__(self, phase: str, message: str | None = None):
        super().__init__(message or f"the time limit passed while {phase}")
        self.phase = phase


class Deadline:
    """``limit_s`` seconds of wall-clock time from ``started`` (time.perf_counter()); None: no limit.

    With ``until``, it also passes as soon as that event is set (a search run beside a solve on the other core,
    which stops when the solve has answered)."""

    def __init__(self, limit_s: float | None, started: float | None = None, *, until: threading.Event | None = None):
        self.started = time.perf_counter() if started is None else started
        self.limit_s = limit_s
        self.at = None if limit_s is None else self.started + limit_s
        self.until = until

    @classmethod
    def none(cls) -> Deadline:
        return cls(None)

    def until_set(self, event: threading.Event) -> Deadline:
        """This deadline, passing as well when ``event`` is set."""
        if self.until is not None:
            raise ValueError("this deadline already passes on an event of its own")
        return Deadline(self.limit_s, self.started, until=event)

    def remaining_s(self) -> float:
        if self.until is not None and self.until.is_set():
            return 0.0
        return math.inf if self.at is None else self.at - time.perf_counter()

    def expired(self) -> bool:
        return (self.until is not None and self.until.is_set()) or (self.at is not None and time.perf_counter() >= self.at)

    def check(self, phase: str) -> None:
        """Raise DeadlineExpired when the time is up."""
        if self.expired():
            raise DeadlineExpired(phase)
