"""Solving schedules off the RPC: the solve queue's workers.

SubmitRun records its runs and returns at once (host/fleet/planning.py); a run whose schedule is not solved yet is
``solving`` and names it by its schedule key. Each distinct schedule is one row of the run store's ``solves`` table
(:class:`host.fleet.store.SolveRecord`), holding everything a worker needs: the graph, the profile, the budget and
the solver settings. So identical boards cost one solve, a later submission of the same case costs none, and a
worker needs nothing but the store:

- the coordinator runs :class:`SolverPool` with ``poet serve --solver-workers N`` threads (each solve's HiGHS runs in
  a process of its own, host/solver/backends/highs_worker.py, so N threads solve on N cores);
- ``poet solver-worker --store URL`` runs the same pool on another host against a shared PostgreSQL store, where
  workers claim rows with ``FOR UPDATE SKIP LOCKED``.

A worker claims a row with a lease (:data:`SOLVE_LEASE_S`) and renews it while it solves; a row whose worker died
(kill -9, a lost host) is claimed again once its lease runs out. The result is stored and applied to every run
waiting for it in one transaction; the first result stored stands.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from host.fleet.limits import SOLVE_IDLE_POLL_S, SOLVE_LEASE_S
from host.fleet.metrics import RunMetrics
from host.fleet.status import RunStatus
from host.fleet.store import RunStore, SolveRecord

log = logging.getLogger("poet.fleet")
_FINISH_ATTEMPTS = 4  # storing a result: tries, 0.5, 1 and 2 s apart


def solve_problem(problem: dict[str, Any]) -> dict[str, Any]:
    """Solve one queued problem; the result every run waiting for it takes: ``status`` (queued, does_not_fit or
    failed), ``detail``, ``schedule_json``, ``schedule_fingerprint``, ``predicted``, ``metrics`` (the schedule's
    counts) and ``solver`` (its status, gap and seconds)."""
    import hashlib

    from host.calibrate.fit import predict_step
    from host.costs import PlatformProfile, price_graph
    from host.fleet import serde
    from host.graph.training_graph import TrainingGraph
    from host.run.solve import SolveSettings
    from host.solver.solve import solve_schedule

    started = time.monotonic()
    graph = TrainingGraph.from_dict(problem["graph"]).with_optimizer(problem["optimizer"])
    profile = PlatformProfile.from_dict(problem["profile"], file_label=problem.get("label") or "a queued solve")
    priced = price_graph(graph, profile)
    settings = SolveSettings(runtime_budget=problem["runtime_factor"], time_limit_s=problem["time_limit_s"],
                             paging=problem["paging"], remat=problem["remat"])
    log.info("solving %s", problem.get("label") or graph.name)
    result = solve_schedule(priced, settings.options(int(problem["budget_bytes"])))
    solver = {"status": result.status, "gap": result.gap, "solve_s": round(time.monotonic() - started, 3)}
    if result.schedule is None:
        if result.status == "infeasible":
            return {"status": RunStatus.DOES_NOT_FIT.value, "detail": f"no schedule fits: {result.message}",
                    "solver": solver}
        return {"status": RunStatus.FAILED.value, "solver": solver,
                "detail": f"the solver found no schedule ({result.status}): {result.message}"}
    text = serde.schedule_json(result.schedule)
    prediction = result.schedule.prediction
    # A whole step: the schedule's computes and transfers, plus the optimizer and the executor's own time where the
    # profile was calibrated (the solver's runtime covers only what a schedule changes).
    step_s, step_j = predict_step(profile, graph, result.schedule)
    return {
        "status": RunStatus.QUEUED.value, "detail": None, "schedule_json": text,
        "schedule_fingerprint": hashlib.sha256(text.encode()).hexdigest()[:16],
        "predicted": {"step_s": step_s, "peak_ram_bytes": float(prediction.peak_ram_bytes), "energy_j": step_j,
                      "energy_source": f"predicted:{profile.name}"},
        "metrics": RunMetrics.changes(recomputes=prediction.recomputes, page_ins=prediction.page_ins,
                                      page_outs=prediction.page_outs),
        "solver": solver,
    }


def failed_result(error: BaseException) -> dict[str, Any]:
    """The result of a solve that raised: its runs fail, saying why."""
    return {"status": RunStatus.FAILED.value, "detail": f"solving the schedule failed: {type(error).__name__}: {error}",
            "solver": {"status": "error"}}


class SolverPool:
    """``workers`` threads that claim queued solves from ``store``, solve them with ``solve`` and store the results.

    ``on_solved(runs)`` is called with the runs a result changed (the coordinator wakes the boards' long polls);
    :meth:`wake` is called when a submission queued a solve, so an idle worker claims it at once instead of at its
    next poll (every :data:`SOLVE_IDLE_POLL_S`). On PostgreSQL the pool also listens to the store, so a solve another
process queued wakes it at once; on SQLite that poll is how such solves are found.
    """

    def __init__(self, store: RunStore, workers: int, *, solve: Callable[[dict[str, Any]], dict[str, Any]] = solve_problem,
                 on_solved: Callable[[list], None] | None = None, lease_s: float = SOLVE_LEASE_S,
                 idle_poll_s: float = SOLVE_IDLE_POLL_S, name: str | None = None):
        if workers < 0:
            raise ValueError(f"solver workers must be >= 0, not {workers}")
        self.store = store
        self.workers = workers
        self._solve = solve
        self._on_solved = on_solved or (lambda runs: None)
        self.lease_s = lease_s
        self.idle_poll_s = idle_poll_s
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"  # unique per pool
        self._stop = threading.Event()
        self._work = threading.Condition()
        self._pending_wakes = 0
        self._threads: list[threading.Thread] = []
        self._held: dict[str, str] = {}  # schedule key -> worker id, while solving
        self._held_lock = threading.Lock()
        self.solved = 0  # results this pool stored

    def start(self) -> SolverPool:
        if self.workers:
            self.store.listen_for_work(self.wake, self._stop)  # PostgreSQL: woken at once by other processes
        for index in range(self.workers):
            thread = threading.Thread(target=self._loop, args=(f"{self.name}:{index}",), daemon=True,
                                      name=f"poet-solver-{index}")
            thread.start()
            self._threads.append(thread)
        return self

    def wake(self) -> None:
        with self._work:
            self._pending_wakes += 1
            self._work.notify_all()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop claiming; hand the solves in progress back to the queue (another worker, or this coordinator
        restarted, solves them again) and wait up to ``timeout_s`` for the threads."""
        self._stop.set()
        self.wake()
        with self._held_lock:
            held = dict(self._held)
        for key, worker in held.items():
            try:
                self.store.release_solve(key, worker)
            except Exception as error:  # the store may be closing; the lease runs out on its own
                log.warning("could not hand solve %s back to the queue: %s", key, error)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _idle(self) -> None:
        with self._work:
            if self._pending_wakes == 0 and not self._stop.is_set():
                self._work.wait(self.idle_poll_s)
            self._pending_wakes = max(0, self._pending_wakes - 1)

    def _loop(self, worker: str) -> None:
        while not self._stop.is_set():
            try:
                claimed = self.store.claim_solve(worker, self.lease_s)
            except Exception as error:  # a store that is briefly unreachable: try again at the next poll
                log.warning("solver worker %s could not claim a solve: %s", worker, error)
                claimed = None
            if claimed is None:
                self._idle()
                continue
            if self._stop.is_set():  # stopped while claiming: hand it back now rather than at the lease's end
                self.store.release_solve(claimed.schedule_key, worker)
                return
            try:
                self._run(worker, claimed)
            except Exception as error:  # the store refused the result: hand the solve back, keep the worker alive
                log.exception("solver worker %s could not store solve %s", worker, claimed.schedule_key)
                try:
                    self.store.release_solve(claimed.schedule_key, worker)
                except Exception:
                    log.warning("solve %s goes back to the queue when its lease runs out: %s", claimed.schedule_key,
                                error)
                self._stop.wait(self.idle_poll_s)

    def _run(self, worker: str, claimed: SolveRecord) -> None:
        key = claimed.schedule_key
        with self._held_lock:
            self._held[key] = worker
        renewing = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(key, worker, renewing), daemon=True,
                                   name=f"poet-solver-lease-{key[:8]}")
        renewer.start()
        try:
            try:
                result = self._solve(claimed.problem)
            except Exception as error:
                log.exception("solve %s failed", key)
                result = failed_result(error)
        finally:
            renewing.set()
            with self._held_lock:
                self._held.pop(key, None)
        if self._stop.is_set():
            return  # handed back to the queue by stop(); the store may be closed
        changed = self._finish(key, result)
        self.solved += 1
        log.info("solved %s: %s (%d run(s) waiting took it)", claimed.problem.get("label") or key, result["status"],
                 len(changed))
        self._on_solved(changed)

    def _finish(self, key: str, result: dict[str, Any]) -> list:
        """Store the result, trying again a few times when the store is briefly busy or unreachable."""
        for attempt in range(_FINISH_ATTEMPTS):
            try:
                return self.store.finish_solve(key, result)
            except Exception as error:
                if attempt == _FINISH_ATTEMPTS - 1:
                    raise
                log.warning("storing solve %s failed (%s); trying again", key, error)
                time.sleep(0.5 * 2 ** attempt)
        return []

    def _renew(self, key: str, worker: str, done: threading.Event) -> None:
        while not done.wait(self.lease_s / 3):
            try:
                if not self.store.renew_solve(key, worker, self.lease_s):
                    log.warning("solver worker %s lost its claim on %s (its lease ran out)", worker, key)
                    return
            except Exception as error:
                log.warning("solver worker %s could not renew its claim on %s: %s", worker, key, error)
