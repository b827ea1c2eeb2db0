"""What the `poet` command shows on stderr while it works, and how it writes numbers.

One live status line for every command: the solver's phase, elapsed time, incumbent, bound and gap,
then a bar over training steps. On a terminal a ticker thread redraws it every ``interval_s`` so the
clock keeps moving through long phases; elsewhere (a log file, CI) it prints a plain line now and then.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from host.units import format_bytes

__all__ = ["LiveStatus", "format_bytes"]


class LiveStatus:
    """The status line on stderr. Call it with progress reports; ``log`` prints a line above it."""

    WIDTH = 110

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, tty: bool | None = None,
                 interval_s: float = 0.5, plain_every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s
        self.plain_every_s = plain_every_s
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._render = None  # () -> str: the current line, with a live clock
        self._shown = False
        self._last_plain_s = -float("inf")
        self._last_phase = ""

    # -------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> LiveStatus:
        if self.enabled and self.tty:
            self._thread = threading.Thread(target=self._tick, name="poet-status", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            self._thread = None
        with self._lock:
            self._clear()
            self._render = None

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if self._render is not None:
                    self._draw(self._render())

    # -------------------------------------------------------------------------------- output
    def _draw(self, line: str) -> None:
        self.stream.write("\r" + line[: self.WIDTH].ljust(self.WIDTH))
        self.stream.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * self.WIDTH + "\r")
            self.stream.flush()
            self._shown = False

    def log(self, message: str) -> None:
        """A permanent line (above the live one on a terminal)."""
        if not self.enabled:
            return
        with self._lock:
            self._clear()
            self.stream.write(message + "\n")
            self.stream.flush()
            if self._render is not None and self.tty:
                self._draw(self._render())

    def _show(self, render, *, force_plain: bool = False) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._render = render
            if self.tty:
                self._draw(render())
                return
            now = time.monotonic()
            if force_plain or now - self._last_plain_s >= self.plain_every_s:
                self._last_plain_s = now
                self.stream.write(render() + "\n")
                self.stream.flush()

    def line(self, text: str) -> None:
        """Replace the live line with ``text`` (e.g. progress of several boards at once)."""
        self._last_phase = ""
        self._show(lambda: text)

    # -------------------------------------------------------------------------------- reports
    def __call__(self, report: Any) -> None:
        """A progress callback for the API: solver reports and training steps."""
        from host.run.loops import StepProgress

        if isinstance(report, StepProgress):
            self.step(report)
        else:
            self.solver(report)

    def solver(self, progress: Any) -> None:
        """A ``host.solver.milp.SolverProgress``: the clock keeps running from its ``elapsed_s``."""
        base_s = time.monotonic() - progress.elapsed_s
        phase = getattr(progress, "phase", "solving") or "solving"
        incumbent = f"{progress.incumbent_j:.6g} J" if progress.incumbent_j is not None else "none yet"
        bound = f"{progress.bound_j:.6g} J" if progress.bound_j is not None else "-"
        gap = f"{100 * progress.gap:.2f}%" if progress.gap is not None else "-"
        figures = f"   incumbent {incumbent}   bound {bound}   gap {gap}" if phase == "solving" else ""

        def render() -> str:
            return f"  {phase:<20} {time.monotonic() - base_s:7.1f} s{figures}"

        changed = phase != self._last_phase
        self._last_phase = phase
        self._show(render, force_plain=changed)

    def step(self, progress: Any) -> None:
        """A finished training step (``host.run.loops.StepProgress``)."""
        width = 24
        filled = int(width * progress.step / progress.steps)
        line = (f"  {progress.label:<5} {'#' * filled}{'.' * (width - filled)} {progress.step}/{progress.steps}"
                f"  loss {progress.loss:.4f}  {progress.step_s:.3f} s/step")
        self._last_phase = ""
        last = progress.step == progress.steps
        self._show(lambda: line, force_plain=progress.step == 1 or last)
        if last and self.tty and self.enabled:
            with self._lock:  # keep the finished bar
                self.stream.write("\n")
                self.stream.flush()
                self._shown = False
                self._render = None
