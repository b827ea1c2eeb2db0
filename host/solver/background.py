"""A phase of a solve run on a thread of its own, beside the solve's next phase.

The covering problems (host.solver.eviction_bound) spend their time in a HiGHS worker process, so a thread that
waits for them leaves this process's core to the baselines and the ejection moves: on a 2-core machine each phase
gets a core. The thread is told to stop through an event (Ctrl-C lands in the main thread only), and the solve waits
for it to end, so no worker outlives the solve.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

_WAIT_PERIOD_S = 0.1  # how often a wait wakes up, so that Ctrl-C lands at once


class Background(Generic[T]):
    """``target(cancel)`` running on a daemon thread; ``cancel`` is set when the solve stops it (its answer is then
    whatever it returns or raises, and is ignored)."""

    def __init__(self, target: Callable[[threading.Event], T], name: str) -> None:
        self.cancel = threading.Event()
        self.finished = threading.Event()  # set when the target has returned or raised
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self._thread.start()

    def _run(self, target: Callable[[threading.Event], T]) -> None:
        try:
            self._value = target(self.cancel)
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits for it
            self._error = error
        finally:
            self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self) -> T:
        """Wait for the answer (a Ctrl-C while waiting stops the target, waits for it to end, and is raised); the
        target's own error is raised here."""
        try:
            while not self.finished.wait(_WAIT_PERIOD_S):
                pass
        except KeyboardInterrupt:
            self.stop()
            raise
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def stop(self) -> None:
        """Tell the target to stop and wait until it has (a HiGHS worker is stopped within a second or killed)."""
        self.cancel.set()
        while not self.finished.is_set():
            try:
                self.finished.wait(_WAIT_PERIOD_S)
            except KeyboardInterrupt:  # a second Ctrl-C: the worker is already being stopped
                continue

    def map(self, function: Callable[[T], U]) -> Pending[U]:
        """The answer seen through ``function`` (applied when ``result`` is called)."""
        return Pending(self, function)


class Pending(Generic[U]):
    """A view of a Background's answer: ``done``, ``finished`` and ``result`` as the Background's."""

    def __init__(self, source: Background, function: Callable) -> None:
        self._source, self._function = source, function

    @property
    def finished(self) -> threading.Event:
        return self._source.finished

    def done(self) -> bool:
        return self._source.done()

    def result(self) -> U:
        return self._function(self._source.result())
