"""What every measured energy meter shares: the ModelledEnergyMeter interface, sampling, and falling back.

A meter is used like :class:`~device_agent.meters.modelled.ModelledEnergyMeter`: ``read()`` returns a
reading (``cpu_s``, ``wall_s`` and, here, ``energy_j``: the meter's cumulative joules since it started),
``energy_j(start, end, paging_s=0.0)`` returns ``(energy_j, cpu_s)`` between two readings, ``source``
is the label, and ``close()`` stops its background thread. A measured figure already contains the
storage's power, so ``paging_s`` is ignored unless the meter has fallen back to the model.

Two kinds:

* :class:`CounterMeter` (RAPL): the hardware keeps an energy counter; a background thread reads it
  often enough to unwrap it (see :mod:`device_agent.meters.rapl` for the interval).
* :class:`SampledPowerMeter` (INA3221, INA2xx, Pi 5 PMIC): the hardware reports instantaneous power;
  a background thread samples it at ``rate_hz`` (50 Hz for sysfs meters, stated per meter) and
  integrates it with the trapezoid rule into a cumulative counter. ``read()`` between two samples
  adds the last power times the time since the last sample.

A meter that disappears mid-run (its files vanish, a read fails, ``vcgencmd`` stops answering) falls
back to the modelled estimate from then on: its label becomes e.g.
``modelled:cpu-time×power (rapl lost at 2026-01-01T12:00:00Z: ...)``, the loss is logged once, and no
exception reaches the executor. An interval that started before the loss is modelled as a whole.

``source`` is the label as of the latest ``read()``: the executor reads the end of a step, then calls
``energy_j`` and ``source``, so the label always matches the figure even if the meter is lost in between.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from device_agent.meters.modelled import SOURCE as MODELLED_SOURCE
from device_agent.meters.modelled import ModelledEnergyMeter

LOGGER = logging.getLogger("device_agent.meters")

# What a vanished or broken meter raises when read.
READ_ERRORS = (OSError, ValueError, IndexError)


class MeterLost(RuntimeError):
    """The meter can no longer be read (raised by a meter's reading function)."""


class MeterReading(NamedTuple):  # a tuple: built around every instruction, cheaper than a frozen dataclass
    cpu_s: float
    wall_s: float
    energy_j: float | None  # cumulative joules since the meter started; None once the meter is lost


def sysfs_path(sysfs_root: str | Path, *parts: str) -> Path:
    """``sysfs_root``/sys/... (``sysfs_root`` is "/" on a real board, a fixture tree in tests)."""
    return Path(sysfs_root, "sys", *parts)


def read_number(path: Path) -> float:
    return float(path.read_text().strip())


def _default_fallback() -> ModelledEnergyMeter:
    from device_agent.meters.modelled import modelled_energy_meter

    return modelled_energy_meter()


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EnergyMeter:
    """Base of the measured meters. Subclasses set ``name``, ``label`` and ``kind`` and implement
    ``_energy_now(now)`` (cumulative joules at ``now``, raising on a lost meter) and ``reading_now()``."""

    name = "meter"
    label = "measured:?"
    kind = "power"  # "power": instantaneous power integrated here; "energy": a hardware counter
    detail = ""

    def __init__(self, *, fallback: ModelledEnergyMeter | None = None, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, start_thread: bool = True) -> None:
        self._fallback = fallback
        self._log = log if log is not None else LOGGER.warning
        self.clock = clock
        self.start_thread = start_thread
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self.lost: str | None = None  # why and when the meter was lost
        self._read_source = self.label

    # ------------------------------------------------------------------ the executor's interface
    @property
    def source(self) -> str:
        return self._read_source

    def current_source(self) -> str:
        return self.label if self.lost is None else f"{MODELLED_SOURCE} ({self.lost})"

    def read(self) -> MeterReading:
        cpu_s, wall_s = time.process_time(), self.clock()
        energy = None
        if self.lost is None:
            try:
                self.start()
                energy = self._energy_now(wall_s)
            except (MeterLost, *READ_ERRORS) as exc:
                self._lose(exc)
        self._read_source = self.current_source()
        return MeterReading(cpu_s, wall_s, energy)

    def energy_j(self, start, end, paging_s: float = 0.0) -> tuple[float, float]:
        cpu_s = max(end.cpu_s - start.cpu_s, 0.0)
        first, last = getattr(start, "energy_j", None), getattr(end, "energy_j", None)
        if first is None or last is None:
            return self.fallback.energy_j(start, end, paging_s)
        return max(last - first, 0.0), cpu_s

    @property
    def fallback(self) -> ModelledEnergyMeter:
        if self._fallback is None:
            self._fallback = _default_fallback()
        return self._fallback

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Take the first reading and start the background thread (done by the first ``read()``)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._first_sample()
            if self.start_thread and self.interval_s() > 0:
                self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop, self.interval_s()),
                                                name=f"meter-{self.name}", daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def __del__(self) -> None:
        self._stop.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses
    def interval_s(self) -> float:
        raise NotImplementedError

    def _first_sample(self) -> None:
        self.tick()

    def tick(self) -> None:
        """One background read (a sample, or a counter update); a failure loses the meter."""
        if self.lost is not None:
            return
        try:
            self._tick()
        except (MeterLost, *READ_ERRORS) as exc:
            self._lose(exc)

    def _tick(self) -> None:
        raise NotImplementedError

    def _energy_now(self, now: float) -> float:
        raise NotImplementedError

    def reading_now(self) -> dict[str, float]:
        """One reading for ``poet-agent meters``: ``{"power_w": W}`` or ``{"energy_j": J}``."""
        raise NotImplementedError

    def _lose(self, exc: BaseException) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = f"{self.name} lost at {_utc_now()}: {type(exc).__name__}: {exc}"
        self._stop.set()
        self._log(f"energy meter {self.label} lost; energy is modelled from now on ({self.lost})")


def _run(ref: weakref.ref, stop: threading.Event, interval_s: float) -> None:
    """The sampler thread; it holds the meter only weakly, so a dropped meter stops it."""
    while not stop.wait(interval_s):
        meter = ref()
        if meter is None:
            return
        meter.tick()
        lost = meter.lost is not None
        del meter
        if lost:
            return


class SampledPowerMeter(EnergyMeter):
    """Instantaneous power sampled at ``rate_hz`` and integrated (trapezoid) into cumulative joules."""

    kind = "power"
    rate_hz = 50.0

    def __init__(self, *, rate_hz: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if rate_hz is not None:
            self.rate_hz = float(rate_hz)
        self._energy = 0.0
        self._last: tuple[float, float] | None = None  # (time, watts) of the latest sample

    def power_w(self) -> float:
        """Instantaneous power now, in watts (raises OSError/ValueError/MeterLost when unreadable)."""
        raise NotImplementedError

    def interval_s(self) -> float:
        return 1.0 / self.rate_hz

    def _tick(self) -> None:
        watts = self.power_w()
        now = self.clock()
        with self._lock:
            if self._last is not None:
                then, before = self._last
                self._energy += (before + watts) / 2 * max(now - then, 0.0)
            self._last = (now, watts)

    def _energy_now(self, now: float) -> float:
        with self._lock:
            if self._last is None:
                raise MeterLost("no sample yet")
            then, watts = self._last
            return self._energy + watts * max(now - then, 0.0)

    def reading_now(self) -> dict[str, float]:
        return {"power_w": self.power_w()}
