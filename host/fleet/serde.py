"""The one boundary on the host between poet.v1 fleet messages and Python values.

Records of the run store (host/fleet/store.py) become AgentInfo/RunInfo here, a RegisterRequest
becomes the agent's facts, a telemetry event becomes the JSON payload the store keeps, and the
operator's messages become the JSON objects of `poet run --json`, `poet runs list --json` and
`poet fleet list --json`. Nothing else on the host reads or builds these messages field by field.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from device_agent import protos
from device_agent.serde import schedule_from_json, schedule_to_json, schedule_to_proto
from host.fleet.metrics import RunMetrics
from host.fleet.status import RunStatus

fleet_pb2 = protos.load("poet.v1.fleet_pb2")

# ------------------------------------------------------------------------------------------ enums
# poet.v1.RunStatus mirrors host.fleet.status.RunStatus: RUN_STATUS_<NAME> for each member
RUN_STATUS_TO_PB = {status: fleet_pb2.RunStatus.Value(f"RUN_STATUS_{status.name}") for status in RunStatus}
RUN_STATUS_FROM_PB = {v: k for k, v in RUN_STATUS_TO_PB.items()}
JOB_KIND_TO_PB = {"train": fleet_pb2.JOB_KIND_TRAIN, "verify": fleet_pb2.JOB_KIND_VERIFY,
                  "profile": fleet_pb2.JOB_KIND_PROFILE}
JOB_KIND_FROM_PB = {v: k for k, v in JOB_KIND_TO_PB.items()}
OPTIMIZER_TO_PB = {"sgd": fleet_pb2.OPTIMIZER_SGD, "adamw": fleet_pb2.OPTIMIZER_ADAMW}
OPTIMIZER_FROM_PB = {v: k for k, v in OPTIMIZER_TO_PB.items()}
COLLECT_TO_PB = {"none": fleet_pb2.COLLECT_NONE, "weights": fleet_pb2.COLLECT_WEIGHTS, "delta": fleet_pb2.COLLECT_DELTA}
COLLECT_FROM_PB = {v: k for k, v in COLLECT_TO_PB.items()}

FIGURE_KEYS = ("step_s", "peak_ram_bytes", "energy_j", "energy_source")


# ------------------------------------------------------------------------------------------ agents
def facts_from_register(request) -> dict[str, Any]:
    """Everything a RegisterRequest reports, as JSON-able values (platform included; no name: it has none)."""
    facts: dict[str, Any] = {}
    for field in request.DESCRIPTOR.fields:
        value = getattr(request, field.name)
        if field.name == "protocol_version":
            facts[field.name] = int(value)
        elif field.name == "datasets":
            facts[field.name] = [{"name": d.name, "item_shape": list(d.item_shape), "item_count": int(d.item_count),
                                  "classes": int(d.classes)} for d in value]
        elif field.is_repeated:
            facts[field.name] = list(value)
        else:
            facts[field.name] = value
    return facts


def agent_info(record, *, online: bool):
    """An AgentInfo for ``record`` (a store.AgentRecord)."""
    facts = record.facts
    info = fleet_pb2.AgentInfo(name=record.name, platform=record.platform, online=online,
                               last_seen_unix_s=record.last_seen_at_s)
    for field in info.DESCRIPTOR.fields:
        if field.name in ("name", "platform", "online", "last_seen_unix_s") or field.name not in facts:
            continue
        value = facts[field.name]
        if field.is_repeated:
            getattr(info, field.name).extend(value or [])
        elif value is not None:
            setattr(info, field.name, value)
    return info


def agent_info_to_json(info) -> dict[str, Any]:
    """One entry of `poet fleet list --json`."""
    return {field.name: (list(getattr(info, field.name)) if field.is_repeated
                         else getattr(info, field.name))
            for field in info.DESCRIPTOR.fields}


# ------------------------------------------------------------------------------------------ runs
def figures(values: dict[str, Any] | None):
    """A StepFigures from a stored predicted/measured dict (None: unset)."""
    if not values:
        return None
    message = fleet_pb2.StepFigures(step_s=values.get("step_s") or 0.0,
                                    peak_ram_bytes=values.get("peak_ram_bytes") or 0.0,
                                    energy_source=values.get("energy_source") or "")
    if values.get("energy_j") is not None:
        message.energy_j = values["energy_j"]
    return message


def figures_to_dict(message) -> dict[str, Any]:
    """A StepFigures as the dict the store keeps (energy_j None when unset)."""
    return {"step_s": message.step_s, "peak_ram_bytes": message.peak_ram_bytes,
            "energy_j": message.energy_j if message.HasField("energy_j") else None,
            "energy_source": message.energy_source}


def run_info(record, spec: dict[str, Any] | None = None,
             telemetry_steps_missing: list[tuple[int, int]] | None = None):
    """A RunInfo for ``record`` (a store.RunRecord); ``spec`` is its job's spec (model, dataset, steps);
    ``telemetry_steps_missing`` the step ranges without stored step events (GetRun computes them)."""
    metrics, spec = record.run_metrics, spec or {}
    info = fleet_pb2.RunInfo(
        run_id=record.run_id, agent=record.agent, status=RUN_STATUS_TO_PB[record.status],
        ram_budget_bytes=float(record.ram_budget_bytes or 0), schedule_fingerprint=record.schedule_fingerprint or "",
        events_emitted=int(metrics.events_emitted), events_stored=record.events_stored,
        param_digest=metrics.param_digest or "", kind=JOB_KIND_TO_PB[record.kind],
        error=record.detail or "", min_ram_budget_bytes=float(metrics.min_ram_budget_bytes or 0),
        recomputes=int(metrics.recomputes), page_ins=int(metrics.page_ins),
        page_outs=int(metrics.page_outs), steps=int(spec.get("steps") or 0),
        steps_done=int(metrics.steps_done), model=spec.get("model") or "",
        dataset=spec.get("dataset") or "",
    )
    if metrics.profile_version is not None:
        info.profile.CopyFrom(fleet_pb2.ProfileRef(name=metrics.profile_name or "", version=str(metrics.profile_version)))
    for name in ("final_loss", "accuracy_before", "accuracy_after", "max_rel_param_diff", "last_loss"):
        if getattr(metrics, name) is not None:
            setattr(info, name, float(getattr(metrics, name)))
    refinement = metrics.refinement
    if refinement:
        info.refinement.CopyFrom(fleet_pb2.ProfileRefinement(
            status=refinement.get("status", ""), profile_version=int(refinement.get("profile_version") or 0),
            refined_version=int(refinement.get("refined_version") or 0), detail=refinement.get("detail") or "",
            **{k: float(refinement[k]) for k in ("step_mape_before", "step_mape_after")
               if refinement.get(k) is not None}))
    for name, values in (("predicted", record.predicted), ("measured", record.measured)):
        message = figures(values)
        if message is not None:
            getattr(info, name).CopyFrom(message)
    if telemetry_steps_missing is not None:
        info.telemetry_steps_missing.SetInParent()  # present, even when empty: the telemetry is complete
        for first, last in telemetry_steps_missing:
            info.telemetry_steps_missing.ranges.add(first=first, last=last)
    return info


def run_info_to_json(info) -> dict[str, Any]:
    """One entry of `poet run --json` / `poet runs list --json`: unset optional numbers are null."""
    out: dict[str, Any] = {}
    for field in info.DESCRIPTOR.fields:
        name = field.name
        if name in ("predicted", "measured"):
            if info.HasField(name):
                out[name] = figures_to_dict(getattr(info, name))
            else:
                out[name] = dict.fromkeys(FIGURE_KEYS)
        elif name == "profile":
            out[name] = profile_ref_to_json(info.profile) if info.HasField("profile") else None
        elif name == "refinement":
            out[name] = refinement_to_json(info.refinement) if info.HasField("refinement") else None
        elif name == "telemetry_steps_missing":  # [[first, last], ...]; null where not computed (lists)
            out[name] = ([[r.first, r.last] for r in info.telemetry_steps_missing.ranges]
                         if info.HasField(name) else None)
        elif name == "status":
            out[name] = RUN_STATUS_FROM_PB.get(info.status, "unknown")
        elif name == "kind":
            out[name] = JOB_KIND_FROM_PB.get(info.kind, "unknown")
        elif field.has_presence:
            out[name] = getattr(info, name) if info.HasField(name) else None
        else:
            out[name] = getattr(info, name)
    return out


def refinement_to_json(refinement) -> dict[str, Any]:
    """{"status", "profile_version", "refined_version", "step_mape_before", "step_mape_after", "detail"}; versions
    and MAPEs null where they do not apply."""
    return {"status": refinement.status, "profile_version": refinement.profile_version or None,
            "refined_version": refinement.refined_version or None,
            **{k: getattr(refinement, k) if refinement.HasField(k) else None
               for k in ("step_mape_before", "step_mape_after")},
            "detail": refinement.detail}


def profile_ref_to_json(ref) -> dict[str, Any]:
    """{"name", "version"}: version an int for a stored version, else "shipped:NAME" or "local"."""
    return {"name": ref.name, "version": int(ref.version) if ref.version.isdigit() else ref.version}


# ------------------------------------------------------------------------------------------ profiles
def profile_info(version):
    """A ProfileInfo for ``version`` (a store.ProfileVersion)."""
    return fleet_pb2.ProfileInfo(agent=version.agent, version=version.version,
                                 name=str(version.profile.get("name") or ""), created_unix_s=version.created_at_s,
                                 profile_json=dumps(version.profile), provenance_json=dumps(version.provenance or {}))


def profile_info_to_json(info, *, with_profile: bool = True) -> dict[str, Any]:
    """One entry of `poet profiles list --json` (without the profile) or `poet profiles show --json`."""
    out: dict[str, Any] = {"agent": info.agent, "version": info.version, "name": info.name,
                           "created_unix_s": info.created_unix_s,
                           "provenance": json.loads(info.provenance_json or "{}")}
    if with_profile:
        out["profile"] = json.loads(info.profile_json)
    return out


def result_update(result) -> dict[str, Any]:
    """What a RunResult changes in the run: keyword arguments of RunStore.update_run (status, measured, metrics, detail)."""
    metrics = RunMetrics.changes(loss_per_step=list(result.loss_per_step),
                                 final_loss=result.loss_per_step[-1] if result.loss_per_step else None,
                                 param_digest=result.param_digest, events_emitted=result.events_emitted)
    if result.loss_per_step:  # one loss per step done; the last steps' telemetry may arrive after the result
        metrics.update(RunMetrics.changes(steps_done=len(result.loss_per_step)))
    for name in ("accuracy_before", "accuracy_after", "max_rel_param_diff"):
        metrics.update(RunMetrics.changes(**{name: getattr(result, name) if result.HasField(name) else None}))
    update: dict[str, Any] = {"status": RUN_STATUS_FROM_PB[result.status], "metrics": metrics,
                              "detail": result.error or None}
    if result.HasField("measured"):
        update["measured"] = figures_to_dict(result.measured)
    return update


# ------------------------------------------------------------------------------------------ telemetry
def event_payload(event) -> dict[str, Any]:
    """A TelemetryEvent as the JSON payload the store keeps (proto field names; 64-bit integers as strings)."""
    return json_format.MessageToDict(event, preserving_proto_field_name=True)


# ------------------------------------------------------------------------------------------ jobs
def grouping_to_json(grouping) -> str:
    return json_format.MessageToJson(grouping, preserving_proto_field_name=True, indent=None)


def grouping_from_json(text: str):
    return json_format.Parse(text, fleet_pb2.NodeGrouping())


def job_message(spec: dict[str, Any], *, job_id: str, run_id: str, kind: str, schedule_json: str | None):
    """The Job handed to an agent, from the stored job spec and the run's schedule (None for PROFILE)."""
    job = fleet_pb2.Job(
        job_id=job_id, run_id=run_id, kind=JOB_KIND_TO_PB[kind], model_digest=spec.get("model_digest") or "",
        model_size_bytes=int(spec.get("model_size_bytes") or 0), steps=int(spec.get("steps") or 0),
        optimizer=OPTIMIZER_TO_PB[spec.get("optimizer", "sgd")], lr=float(spec.get("lr") or 0.0),
        dataset=spec.get("dataset") or "", collect=COLLECT_TO_PB[spec.get("collect", "none")],
        seed=int(spec.get("seed") or 0), batch_size=int(spec.get("batch_size") or 0),
        checkpoint_every_steps=int(spec.get("checkpoint_every_steps") or 0), compile=bool(spec.get("compile")),
    )
    if spec.get("grouping_json"):
        job.grouping.CopyFrom(grouping_from_json(spec["grouping_json"]))
    if schedule_json:
        job.schedule.CopyFrom(schedule_to_proto(schedule_from_json(schedule_json, source="the run store")))
    return job


def schedule_json(schedule) -> str:
    return schedule_to_json(schedule)


def dumps(payload: Any) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))


__all__ = [
    "COLLECT_TO_PB", "JOB_KIND_TO_PB", "OPTIMIZER_TO_PB", "RUN_STATUS_FROM_PB", "RUN_STATUS_TO_PB", "agent_info",
    "agent_info_to_json", "event_payload", "facts_from_register", "figures", "fleet_pb2", "job_message",
    "result_update", "run_info", "run_info_to_json",
]
