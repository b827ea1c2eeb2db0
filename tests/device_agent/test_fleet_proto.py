"""The fleet protocol (protos/poet/v1/fleet.proto): its messages round-trip, and no field can carry samples."""

from __future__ import annotations

import hashlib

from google.protobuf.descriptor import FieldDescriptor

from device_agent import protos

fleet = protos.load("poet.v1.fleet_pb2")
fleet_grpc = protos.load("poet.v1.fleet_pb2_grpc")
schedule_pb2 = protos.load("poet.v1.schedule_pb2")

# Field-name tokens that would say "training data travels here" (the design's canary rule).
_SAMPLE_TOKENS = {"sample", "samples", "x", "y", "input", "inputs", "label", "labels", "data", "target", "targets",
                  "feature", "features", "image", "images", "example", "examples"}
# The only raw-bytes fields: model archive chunks (host -> board) and collected safetensors weights.
_BYTES_ALLOWED = {"poet.v1.ModelChunk.data", "poet.v1.WeightsRef.safetensors"}
# The only repeated numeric fields: a loss per training step, node indices in the graph, FLOPs per graph
# node and the shapes of a batch tensor, of its class indices and of one item of a board's dataset (a handful of
# dimensions each, at most 8 for a dataset's, checked at Register).
_REPEATED_NUMBERS_ALLOWED = {"poet.v1.RunResult.loss_per_step", "poet.v1.ScheduleNode.deps",
                             "poet.v1.NodeGrouping.node_flops", "poet.v1.NodeGrouping.batch_shape",
                             "poet.v1.NodeGrouping.class_index_shape", "poet.v1.DatasetFacts.item_shape"}
_NUMERIC = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED32,
            FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_SFIXED64}


def _all_messages(file_descriptor):
    pending = list(file_descriptor.message_types_by_name.values())
    while pending:
        message = pending.pop()
        yield message
        pending.extend(message.nested_types)


def _every_message_reachable_from_the_services():
    """Every message type the Fleet and FleetAdmin services can send or receive, transitively."""
    seen: dict[str, object] = {}
    pending = []
    for service in fleet.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            pending += [method.input_type, method.output_type]
    while pending:
        message = pending.pop()
        if message.full_name in seen:
            continue
        seen[message.full_name] = message
        pending += [f.message_type for f in message.fields if f.message_type is not None]
    return seen


def sample_carrying_fields(messages) -> list[str]:
    """Fields whose name or shape could carry training samples, outside the allow-lists."""
    found = []
    for message in messages:
        for field in message.fields:
            full = f"{message.full_name}.{field.name}"
            if _SAMPLE_TOKENS & set(field.name.lower().split("_")) and full not in _BYTES_ALLOWED:
                found.append(f"{full} (name)")
            elif field.type == FieldDescriptor.TYPE_BYTES and full not in _BYTES_ALLOWED:
                found.append(f"{full} (bytes)")
            elif field.is_repeated and field.type in _NUMERIC and full not in _REPEATED_NUMBERS_ALLOWED:
                found.append(f"{full} (repeated numbers)")
    return found


def test_no_message_can_carry_training_samples():
    reachable = _every_message_reachable_from_the_services()
    assert "poet.v1.Schedule" in reachable and "poet.v1.ModelChunk" in reachable  # the walk reaches imports
    assert sample_carrying_fields(reachable.values()) == []
    # Also every message declared in the file, reachable or not (a message added for later use).
    assert sample_carrying_fields(_all_messages(fleet.DESCRIPTOR)) == []


def test_the_canary_check_catches_a_field_that_could_carry_samples():
    """The check above can fail: a message like the ones it must refuse is refused."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    proto = descriptor_pb2.FileDescriptorProto(name="canary_test.proto", package="canary", syntax="proto3")
    bad = proto.message_type.add(name="Leak")
    bad.field.add(name="inputs", number=1, type=FieldDescriptor.TYPE_STRING, label=FieldDescriptor.LABEL_OPTIONAL)
    bad.field.add(name="blob", number=2, type=FieldDescriptor.TYPE_BYTES, label=FieldDescriptor.LABEL_OPTIONAL)
    bad.field.add(name="pixels", number=3, type=FieldDescriptor.TYPE_FLOAT, label=FieldDescriptor.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    leak = pool.FindFileByName(pool.Add(proto).name).message_types_by_name["Leak"]
    assert sample_carrying_fields([leak]) == [
        "canary.Leak.inputs (name)", "canary.Leak.blob (bytes)", "canary.Leak.pixels (repeated numbers)"]


def test_no_request_names_its_sender():
    """Identity comes from the client certificate: no request of the agents' service has a name field."""
    for method in fleet.DESCRIPTOR.services_by_name["Fleet"].methods:
        names = {f.name for f in method.input_type.fields}
        assert not names & {"name", "agent", "agent_name", "node", "node_name", "role", "identity"}, method.name


def test_services_have_the_methods_and_streaming_shapes():
    service = fleet.DESCRIPTOR.services_by_name["Fleet"]
    shapes = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert shapes == {"Register": (False, False), "Heartbeat": (False, False), "PullJob": (False, False),
                      "FetchModel": (False, True), "StreamTelemetry": (True, True), "ReportResult": (False, False)}
    admin = fleet.DESCRIPTOR.services_by_name["FleetAdmin"]
    assert {m.name for m in admin.methods} == {"ListAgents", "RemoveAgent", "SubmitRun", "ListRuns", "GetRun",
                                                  "ListProfiles", "GetProfile", "Calibrate", "GetCalibration",
                                                  "StatModel", "UploadModel"}
    assert {m.name: (m.client_streaming, m.server_streaming) for m in admin.methods}["UploadModel"] == (True, False)
    assert hasattr(fleet_grpc, "FleetStub") and hasattr(fleet_grpc, "FleetAdminServicer")


def _schedule():
    return schedule_pb2.Schedule(
        format_version=1, graph_name="mlp", graph_fingerprint="f" * 64, platform="rpi4", ram_budget_bytes=1e6,
        nodes=[schedule_pb2.ScheduleNode(name="fc1", kind="fwd", output_bytes=4096)],
        instructions=[schedule_pb2.Instruction(kind=schedule_pb2.INSTRUCTION_KIND_COMPUTE, node=0)],
    )


def _one_of_each():
    chunk = b"\x00archive bytes\xff"
    figures = fleet.StepFigures(step_s=0.25, peak_ram_bytes=3e6, energy_j=1.5, energy_source="measured:rapl")
    run = fleet.RunInfo(
        run_id="r1", agent="pi-1", status=fleet.RUN_STATUS_DONE, ram_budget_bytes=2e6, schedule_fingerprint="abc",
        predicted=figures, measured=figures, events_emitted=10, events_stored=10, final_loss=0.3,
        accuracy_before=0.5, accuracy_after=0.9, param_digest="d" * 64, max_rel_param_diff=0.0,
    )
    return [
        fleet.RegisterRequest(
            protocol_version=fleet.PROTOCOL_VERSION_1, platform="rpi4", ram_total_bytes=4 << 30,
            ram_available_bytes=3 << 30, memory_limit_bytes=512 << 20, flash_capacity_bytes=32 << 30,
            flash_free_bytes=16 << 30, cpu_count=4, torch_version="2.13.0", meters=["modelled"],
            runtime_rss_bytes=300 << 20),
        fleet.RegisterReply(agent_name="pi-1", heartbeat_interval_s=5.0, max_message_bytes=4 << 20),
        fleet.HeartbeatRequest(ram_available_bytes=1, flash_free_bytes=2, rss_bytes=3, running_job_id="j1"),
        fleet.HeartbeatReply(heartbeat_interval_s=5.0, cancel_job_ids=["j0"]),
        fleet.PullJobRequest(wait_s=30.0),
        fleet.PullJobReply(job=fleet.Job(
            job_id="j1", run_id="r1", kind=fleet.JOB_KIND_VERIFY, model_digest=hashlib.sha256(chunk).hexdigest(),
            model_size_bytes=len(chunk), grouping=fleet.NodeGrouping(groups=[fleet.NodeGroup(name="fc1", ops=["linear"])]),
            schedule=_schedule(), steps=5, optimizer=fleet.OPTIMIZER_ADAMW, lr=1e-3, dataset="digits",
            collect=fleet.COLLECT_DELTA, seed=7)),
        fleet.FetchModelRequest(digest="a" * 64, offset_bytes=1 << 20),
        fleet.ModelChunk(offset_bytes=1 << 20, data=chunk, chunk_sha256=hashlib.sha256(chunk).hexdigest()),
        fleet.TelemetryBatch(stream_id="s1", events=[
            fleet.TelemetryEvent(seq=1, job_id="j1", instruction=fleet.InstructionTelemetry(
                step=0, kind=schedule_pb2.INSTRUCTION_KIND_PAGE_OUT, node=3, duration_s=0.01, bytes_moved=4096)),
            fleet.TelemetryEvent(seq=2, job_id="j1", step=fleet.StepTelemetry(step=0, loss=2.3, energy_j=0.4)),
            fleet.TelemetryEvent(seq=3, job_id="j1", rss=fleet.RssSample(rss_bytes=123)),
        ]),
        fleet.TelemetryAck(stream_id="s1", stored_through_seq=3),
        fleet.RunResult(
            job_id="j1", run_id="r1", status=fleet.RUN_STATUS_DONE, loss_per_step=[2.3, 1.9], accuracy_before=0.5,
            accuracy_after=0.9, param_digest="d" * 64, max_rel_param_diff=1e-7, measured=figures, events_emitted=3,
            weights=fleet.WeightsRef(collect=fleet.COLLECT_DELTA, digest="e" * 64, size_bytes=2, safetensors=b"{}")),
        fleet.ReportResultReply(),
        fleet.ListAgentsReply(agents=[fleet.AgentInfo(name="pi-1", platform="rpi4", online=True, meters=["rapl"])]),
        fleet.RemoveAgentRequest(name="pi-1"),
        fleet.RemoveAgentReply(removed=True),
        fleet.SubmitRunRequest(model="mlp", dataset="digits", steps=5, ram_budget=fleet.RamBudget(auto=True),
                               all_agents=True, kind=fleet.JOB_KIND_TRAIN, collect=fleet.COLLECT_NONE),
        fleet.SubmitRunReply(runs=[run]),
        fleet.ListRunsReply(runs=[run]),
        fleet.GetRunRequest(run_id="r1"),
        run,
    ]


def test_one_message_of_each_kind_round_trips():
    messages = _one_of_each()
    for message in messages:
        back = type(message).FromString(message.SerializeToString())
        assert back == message, type(message).__name__
    job = messages[5].job
    assert fleet.PullJobReply.FromString(messages[5].SerializeToString()).HasField("job")
    assert not fleet.PullJobReply().HasField("job")  # "no work" is distinguishable from an empty job
    assert job.schedule.instructions[0].kind == schedule_pb2.INSTRUCTION_KIND_COMPUTE
    events = messages[8].events
    assert [e.WhichOneof("event") for e in events] == ["instruction", "step", "rss"]
    run = messages[-1]
    assert run.HasField("accuracy_after") and not fleet.RunInfo().HasField("accuracy_after")
    assert not fleet.StepFigures().HasField("energy_j")  # "not measured" is not 0 J
