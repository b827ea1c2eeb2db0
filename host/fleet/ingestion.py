"""What boards send, checked at the door (host/fleet/validation.py) and stored: their facts at Register, telemetry
batches (acknowledged per run) and results (taken only for a run handed to that board, and checked against its job).
A done TRAIN or VERIFY run of a calibrated board refines its profile (host/fleet/calibration.py, Refiner)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from typing import Any

import grpc

from host.fleet import serde
from host.fleet.jobs import Jobs
from host.fleet.metrics import RunMetrics
from host.fleet.refusal import Refused
from host.fleet.state import RESULTS_DIR, FleetState
from host.fleet.status import RunStatus
from host.fleet.validation import (
    BoardInputError,
    bounded_error,
    check_facts,
    check_result,
    check_telemetry_batch,
    first_non_finite,
)

fleet_pb2 = serde.fleet_pb2
log = logging.getLogger("poet.fleet")


class Ingestion:
    """Facts, telemetry and results into the store."""

    def __init__(self, state: FleetState, jobs: Jobs, refiner: Any = None):
        self.state = state
        self.store = state.store
        self.jobs = jobs
        self.refiner = refiner  # host.fleet.calibration.Refiner, or None
        self._result_lock = threading.Lock()
        self._run_owner: dict[str, str] = {}  # run id -> the board it is assigned to (telemetry checks)

    def register(self, agent: str, request) -> None:
        """A board's facts (INVALID_ARGUMENT naming the field when one is out of bounds; nothing stored then)."""
        try:
            facts = check_facts(serde.facts_from_register(request))
        except BoardInputError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the facts of node {agent!r}: {error}") from None
        self.store.register_agent(agent, request.platform or "local", facts)
        self.state.notify_work()

    def report(self, agent: str, result) -> None:
        run = self.jobs.assigned_run(agent, result.run_id)
        if result.job_id and result.job_id != run.job_id:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"run {run.run_id!r} belongs to job {run.job_id!r}, not {result.job_id!r}")
        if result.status not in (fleet_pb2.RUN_STATUS_DONE, fleet_pb2.RUN_STATUS_FAILED):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a result's status is DONE or FAILED")
        with self._result_lock:
            run = self.store.get_run(run.run_id)
            if run.status.finished:
                return  # a resend after a reconnect: the first report stands
            if run.status != RunStatus.RUNNING:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"run {run.run_id!r} is {run.status}, not running: report only jobs PullJob handed you")
            spec = self.state.spec(run.job_id)
            try:
                check_result(result, steps=int(spec.get("steps") or 0), collect=spec.get("collect", "none"))
            except BoardInputError as error:
                # the agent drops a refused result: the run fails here, or it would be handed out and re-run forever
                message = f"the result of run {run.run_id!r}: {error}"
                self.store.update_run(run.run_id, status=RunStatus.FAILED,
                                      detail=bounded_error(f"the coordinator refused the board's result ({message})"))
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, message) from None
            update = serde.result_update(result)
            update["detail"] = bounded_error(update["detail"]) if update["detail"] else None
            if result.HasField("max_rel_param_diff") and math.isinf(result.max_rel_param_diff):
                update["metrics"]["max_rel_param_diff"] = None  # strict JSON; the detail says it
                update["detail"] = "max_rel_param_diff is infinite: a tensor plain training left at zero differs" + (
                    f"; {update['detail']}" if update["detail"] else "")
            diverged = first_non_finite(result.loss_per_step)
            if diverged is not None:  # stored as null (the JSON stays strict) and the run failed, saying where
                losses = [v if math.isfinite(v) else None for v in result.loss_per_step]
                update["metrics"].update(loss_per_step=losses, final_loss=losses[-1])
                update["status"] = RunStatus.FAILED
                update["detail"] = (f"the loss is {result.loss_per_step[diverged]} from step {diverged + 1} (it "
                                    f"diverged); lower the learning rate" + (f"; the board said: {update['detail']}"
                                                                            if update["detail"] else ""))
            if result.HasField("weights") and result.weights.safetensors:
                update["metrics"]["weights_path"] = self._save_weights(run.run_id, result.weights)
            if run.kind == "profile" and update["status"] == RunStatus.DONE:
                from host.costs import PlatformProfile

                try:
                    profile = json.loads(result.profile_json)
                    PlatformProfile.from_dict(profile, file_label=f"the profile of run {run.run_id}")
                except ValueError as error:  # ProfileError is a ValueError too
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"profile_json is not a platform profile ({error}); the agent must send what "
                                   f"`poet profile --local` writes") from None
                provenance = {"source": "profile-job", "agent": agent, "job_id": run.job_id, "run_id": run.run_id,
                              "created_unix_s": time.time()}
                version = self.store.add_profile_version(agent, profile, provenance=provenance)
                update["metrics"].update(profile_name=profile.get("name"), profile_version=version.version)
            self.store.update_run(run.run_id, **update)
        if self.refiner is not None and run.kind in ("train", "verify") and update["status"] == RunStatus.DONE:
            self.refiner.run_done(run.run_id)

    def _save_weights(self, run_id: str, weights) -> str:
        from device_agent.fileio import atomic_write_bytes

        data = weights.safetensors
        digest = hashlib.sha256(data).hexdigest()
        if weights.digest and digest != weights.digest:
            raise Refused(grpc.StatusCode.DATA_LOSS,
                           f"collected weights of run {run_id!r} have sha256 {digest}, not {weights.digest}: "
                           "resend the result")
        path = self.state.results_dir / f"{run_id}.safetensors"
        atomic_write_bytes(path, data)
        return f"{RESULTS_DIR}/{path.name}"

    def telemetry(self, agent: str, batch):
        try:
            check_telemetry_batch(batch)
        except BoardInputError as error:  # naming the run lets the agent park it and keep streaming the others
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"node {agent!r}, run {batch.run_id[:64]!r}: {error}") from None
        run_id = batch.run_id
        if self._run_owner.get(run_id) != agent:  # a run's board never changes: checked once per run
            self._run_owner[run_id] = self.jobs.assigned_run(agent, run_id).agent
        events = [(int(e.seq), serde.event_payload(e)) for e in batch.events]
        acked = self.store.store_events(run_id, events) if events else self.store.acked_seq(run_id)
        steps = [e.step.step for e in batch.events if e.WhichOneof("event") == "step"]
        if steps:
            with self._result_lock:  # re-read: a result stored since the batch arrived has the final count
                run = self.store.get_run(run_id)
                if max(steps) > run.run_metrics.steps_done and not run.status.finished:
                    last = max((e for e in batch.events if e.WhichOneof("event") == "step"), key=lambda e: e.step.step)
                    loss = last.step.loss if math.isfinite(last.step.loss) else None  # JSON stores no NaN
                    self.store.update_run(run.run_id, metrics=RunMetrics.changes(steps_done=max(steps), last_loss=loss))
        return fleet_pb2.TelemetryAck(stream_id=batch.stream_id, run_id=run_id, stored_through_seq=acked)
