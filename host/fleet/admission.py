"""How many calls one board may hold open at once, so that no board can take the coordinator's threads.

Every call of the Fleet service holds one of the server's worker threads while it runs. A board is
limited per identity (its certificate's name), per kind of call:

- a PullJob long poll: a second one from the same board replaces the first, which returns at once
  without a job (an agent that reconnected leaves its old poll behind);
- ``stream``: telemetry streams (an agent keeps one open while it has nothing to send, so they
  have no idle deadline); ``download``: model downloads, also cancelled when nobody reads their
  chunks for DOWNLOAD_IDLE_S.
- ``call``: all of a board's calls together (the ones above included).

All boards together hold at most ``board_calls`` calls: the server's threads minus
OPERATOR_RESERVED_WORKERS, so however many boards connect, the operator's calls and health checks
always find a thread (one hostile board is held to MAX_CALLS_PER_NODE, a crowd of them to the
fleet-wide limit). Over a limit the call is refused with RESOURCE_EXHAUSTED, naming the limit; agents
retry it with backoff, as they retry an unreachable coordinator.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from host.fleet.limits import (
    MAX_CALLS_PER_NODE,
    MAX_DOWNLOADS_PER_NODE,
    MAX_STREAMS_PER_NODE,
    MAX_WORKERS,
    OPERATOR_RESERVED_WORKERS,
)

__all__ = ["CallLimitError", "CallSlots", "IdleWatch"]

LIMITS = {"call": MAX_CALLS_PER_NODE, "stream": MAX_STREAMS_PER_NODE, "download": MAX_DOWNLOADS_PER_NODE}
_WHAT = {"call": "calls", "stream": "telemetry streams", "download": "model downloads"}


class CallLimitError(Exception):
    """A board holds as many calls of a kind as it may."""


def board_calls_for(server_workers: int) -> int:
    """The calls all boards together may hold on a server of ``server_workers`` threads (ValueError when none)."""
    if server_workers <= OPERATOR_RESERVED_WORKERS:
        raise ValueError(f"the server needs more than {OPERATOR_RESERVED_WORKERS} threads (that many are kept for "
                         f"the operator and health checks); got {server_workers}")
    return server_workers - OPERATOR_RESERVED_WORKERS


class CallSlots:
    """Counts each board's open calls by kind, and all boards' calls together (at most ``board_calls``);
    ``hold(name, kind)`` takes a slot for the call's lifetime."""

    def __init__(self, limits: dict[str, int] | None = None, board_calls: int | None = None) -> None:
        self.limits = dict(LIMITS if limits is None else limits)
        self.board_calls = board_calls_for(MAX_WORKERS) if board_calls is None else int(board_calls)
        self._total = 0  # all boards' open calls
        self._open: Counter[tuple[str, str]] = Counter()
        self._poll_token: dict[str, int] = {}  # board -> the token of its current long poll
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, name: str, kind: str = "call") -> Iterator[None]:
        kinds = ("call",) if kind == "call" else ("call", kind)
        with self._lock:
            if self._total >= self.board_calls:
                raise CallLimitError(
                    f"the coordinator already serves {self._total} board calls, its limit for all boards together "
                    f"(its threads but {OPERATOR_RESERVED_WORKERS}, kept for operators and health checks); retry "
                    "shortly, or start it with more threads for this many boards")
            for each in kinds:
                if self._open[name, each] >= self.limits[each]:
                    raise CallLimitError(
                        f"node {name!r} already holds {self._open[name, each]} open {_WHAT[each]} (the limit per "
                        f"board is {self.limits[each]}); close some before opening more")
            for each in kinds:
                self._open[name, each] += 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                self._total -= 1
                for each in kinds:
                    self._open[name, each] -= 1
                    if not self._open[name, each]:
                        del self._open[name, each]

    def open_calls(self, name: str, kind: str = "call") -> int:
        with self._lock:
            return self._open[name, kind]

    def open_board_calls(self) -> int:
        """All boards' open calls together."""
        with self._lock:
            return self._total

    def new_poll(self, name: str) -> Callable[[], bool]:
        """Start a long poll of ``name``; the returned check says whether a newer poll has replaced it."""
        with self._lock:
            token = self._poll_token.get(name, 0) + 1
            self._poll_token[name] = token
        return lambda: self._poll_token.get(name) != token


class IdleWatch:
    """Calls ``cancel`` once ``idle_s`` pass without :meth:`progress`; :meth:`stop` when the call ends."""

    def __init__(self, idle_s: float, cancel: Callable[[], None]) -> None:
        self.idle_s = float(idle_s)
        self._cancel = cancel
        self._progress = threading.Event()
        self._stopped = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="poet-idle-watch", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        self._progress.set()

    def stop(self) -> None:
        self._stopped.set()
        self._progress.set()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            if not self._progress.wait(self.idle_s):
                self.fired = True
                self._cancel()
                return
            self._progress.clear()
