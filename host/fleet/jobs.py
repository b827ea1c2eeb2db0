"""Handing out work: a board's long poll for its next job, the model archives it may fetch, its heartbeat's
cancellations, and an operator removing a board (its open runs fail)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from host.fleet import serde
from host.fleet.limits import MAX_PULL_WAIT_S, SOLVE_IDLE_POLL_S
from host.fleet.refusal import Refused
from host.fleet.state import FleetState
from host.fleet.status import OPEN, RunStatus
from host.fleet.store import UnknownAgentError, UnknownRunError

fleet_pb2 = serde.fleet_pb2


class Jobs:
    """A board's queue of runs, read from the store."""

    def __init__(self, state: FleetState):
        self.state = state
        self.store = state.store

    def next_job(self, agent: str):
        """This agent's oldest queued or running run as a Job (marked running), or None."""
        for run in self.store.list_runs(agent=agent, status=OPEN):
            spec = self.state.spec(run.job_id)
            if run.status == RunStatus.QUEUED:
                run = self.store.update_run(run.run_id, status=RunStatus.RUNNING)
            schedule_json = self.state.schedule_json(spec, run.run_metrics.schedule_key)
            return serde.job_message(spec, job_id=run.job_id, run_id=run.run_id, kind=run.kind,
                                     schedule_json=schedule_json)
        return None

    def pull(self, agent: str, wait_s: float, context) -> Any:
        """A long poll: this agent's next job, or None after at most ``wait_s`` (MAX_PULL_WAIT_S). A newer poll of
        the same board, or a cancelled call, returns None at once."""
        state = self.state
        deadline = time.monotonic() + max(0.0, min(wait_s, MAX_PULL_WAIT_S))
        context.add_callback(state.notify_work)  # a cancelled long poll wakes up and returns
        replaced = state.slots.new_poll(agent)
        state.notify_work()  # this board's older poll, if any, sees it was replaced and returns
        while True:
            if replaced():
                return None
            with state.work:
                generation = state.generation
            job = self.next_job(agent)
            if job is not None:
                return job
            # SQLite: a run waiting for a schedule that another process may solve (`poet solver-worker`), which
            # cannot wake this one: look again soon (PostgreSQL's NOTIFY wakes it; this coordinator's own solves do)
            solving = (self.store.backend == "sqlite"
                       and bool(self.store.list_runs(agent=agent, status=RunStatus.SOLVING)))
            with state.work:
                while state.generation == generation and context.is_active() and not replaced():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    if solving:
                        state.work.wait(min(remaining, SOLVE_IDLE_POLL_S))
                        break
                    state.work.wait(remaining)
            if not context.is_active() or time.monotonic() >= deadline:
                return self.next_job(agent) if context.is_active() else None

    def assigned_run(self, agent: str, run_id: str):
        """The run, if it is assigned to ``agent``."""
        try:
            run = self.store.get_run(run_id)
        except UnknownRunError:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no run {run_id!r} on this coordinator") from None
        if run.agent != agent:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"run {run_id!r} is not assigned to node {agent!r}; report only runs handed to you by PullJob")
        return run

    def model_path(self, agent: str, digest: str) -> Path:
        """The archive of ``digest``, if some run assigned to ``agent`` uses it."""
        for run in self.store.list_runs(agent=agent):
            if self.state.spec(run.job_id).get("model_digest") == digest:
                path = self.state.models_dir / f"{digest}.pt2"
                if path.is_file():
                    return path
                break
        raise Refused(grpc.StatusCode.NOT_FOUND,
                       f"no model {digest!r} for this node (only the models of runs assigned to it can be fetched)")

    def heartbeat(self, agent: str, request):
        """The HeartbeatReply: register again when the store has no record of the board; cancel its running job when
        none of that job's runs on it is still wanted."""
        reply = fleet_pb2.HeartbeatReply(heartbeat_interval_s=self.state.heartbeat_interval_s)
        try:
            self.store.touch_agent(agent)
        except UnknownAgentError:
            reply.register_again = True
            return reply
        if request.running_job_id:
            mine = self.store.list_runs(job_id=request.running_job_id, agent=agent)
            if not mine or all(run.status.unsuccessful for run in mine):
                reply.cancel_job_ids.append(request.running_job_id)
        return reply

    def remove_agent(self, name: str, operator: str) -> bool:
        """Remove a board (its certificate is refused from then on) and fail its open runs; False: no such board."""
        try:
            self.store.remove_agent(name)
        except UnknownAgentError:
            return False
        for run in self.store.list_runs(agent=name, status=(RunStatus.SOLVING, *OPEN)):
            self.store.update_run(run.run_id, status=RunStatus.FAILED,
                                  detail=f"agent {name!r} was removed by operator {operator!r}")
        return True
