"""The operator's model code never runs in the coordinator (issue 17, part 4): `poet run --model module:callable` traces
on the operator's side and uploads the archive; the coordinator takes it only whole, matching its digest and passing
the checks boards apply. Real coordinators (`poet serve` in a subprocess, or in this process) over mutual TLS."""

from __future__ import annotations

import hashlib
import io
import json
import os
import textwrap
import zipfile

import grpc
import pytest

from device_agent import protos
from host.fleet.uploads import upload_chunks
from tests.host.cli.helpers import test_env
from tests.host.fleet.helpers import solved_runs
from tests.host.fleet.test_cli_fleet import Served, board, operator, play_board
from tests.host.fleet.test_service import TIMEOUT_S, admin, node, refused, register

fleet_pb2 = protos.load("poet.v1.fleet_pb2")
BATCH = 8


def marker_module(root, marker):
    """A module:callable whose import and call each append ``<pid> <what>`` to ``marker``: who ran the code."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "opmodel_marker.py").write_text(textwrap.dedent(f"""
        import os

        import torch
        from torch import nn

        with open({str(marker)!r}, "a") as handle:
            handle.write(f"{{os.getpid()}} import\\n")


        def make():
            with open({str(marker)!r}, "a") as handle:
                handle.write(f"{{os.getpid()}} call\\n")
            return {{"module": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                     "inputs": torch.randn({BATCH}, 16)}}
    """))
    return "opmodel_marker:make"


def pids(marker) -> set[int]:
    return {int(line.split()[0]) for line in marker.read_text().splitlines()} if marker.exists() else set()


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory):
    """mlp traced here, as the operator's `poet run` would."""
    from host.fleet.model_package import package_model

    return package_model("mlp", tmp_path_factory.mktemp("operator-models"), batch_size=BATCH)


def uploaded(package, **overrides):
    values = dict(digest=package.digest, grouping=package.grouping, graph_json=json.dumps(package.graph.to_dict()),
                  batch_size=package.batch_size)
    values.update(overrides)
    return fleet_pb2.UploadedModel(**values)


def submit_uploaded(cert_dir, port, model, agents=("pi-1",)):
    request = fleet_pb2.SubmitRunRequest(model="mine", dataset="digits", steps=2, agents=list(agents),
                                         kind=fleet_pb2.JOB_KIND_TRAIN, optimizer=fleet_pb2.OPTIMIZER_SGD, lr=0.05,
                                         ram_budget=fleet_pb2.RamBudget(fraction_of_peak=1.0), uploaded_model=model)
    stub = admin(cert_dir, port)
    return solved_runs(stub, stub.SubmitRun(request, timeout=TIMEOUT_S).runs)


def upload(cert_dir, port, messages):
    return admin(cert_dir, port).UploadModel(iter(messages), timeout=TIMEOUT_S)


def stat(cert_dir, port, digest):
    return admin(cert_dir, port).StatModel(fleet_pb2.StatModelRequest(digest=digest), timeout=TIMEOUT_S)


# ------------------------------------------------------------------------------------------ `poet serve` + `poet run`
@pytest.mark.slow  # a coordinator, a trace and an upload, ~16 s
def test_poet_run_traces_a_module_callable_on_the_operators_side_and_the_coordinator_never_imports_it(cert_dir,
                                                                                                       tmp_path):
    """The coordinator could import the module (it is on its path too): on the old code it did, and the marker
    named its pid. Now only the operator's `poet run` runs it; the board gets the uploaded archive by digest."""
    marker = tmp_path / "ran.txt"
    model = marker_module(tmp_path / "opmodels", marker)
    path = {"PYTHONPATH": os.pathsep.join([test_env()["PYTHONPATH"], str(tmp_path / "opmodels")])}
    served = Served(cert_dir, tmp_path / "state", env_extra=path)
    try:
        stub = board(cert_dir, served.port, "pi-1")
        result = operator(cert_dir, served, "run", "--model", model, "--dataset", "digits", "--steps", "2",
                          "--ram-budget", "100%", "--agents", "pi-1", "--json", env_extra=path)
        assert result.returncode == 0, result.stderr
        ran = pids(marker)
        assert ran and served.process.pid not in ran, (ran, served.process.pid)
        assert "tracing opmodel_marker:make here" in result.stderr
        job = play_board(stub)  # fetches the archive by digest and checks its sha256
        stored = tmp_path / "state" / "models" / f"{job.model_digest}.pt2"
        assert hashlib.sha256(stored.read_bytes()).hexdigest() == job.model_digest
        assert served.process.pid not in pids(marker)
        again = operator(cert_dir, served, "run", "--model", model, "--dataset", "digits", "--steps", "2",
                         "--ram-budget", "100%", "--agents", "pi-1", "--json", env_extra=path)
        assert again.returncode == 0, again.stderr
        assert "uploading" not in again.stderr  # content-addressed: the coordinator holds it, nothing is sent
    finally:
        assert served.stop() == 0


@pytest.mark.slow  # ~7 s
def test_poet_run_with_os_abort_leaves_the_coordinator_up(cert_dir, tmp_path):
    """`--model os:abort` killed the coordinator: now it aborts only the operator's own `poet run`."""
    served = Served(cert_dir, tmp_path / "state")
    try:
        board(cert_dir, served.port, "pi-1")
        result = operator(cert_dir, served, "run", "--model", "os:abort", "--dataset", "digits", "--steps", "2",
                          "--ram-budget", "100%", "--agents", "pi-1")
        assert result.returncode != 0
        assert served.process.poll() is None, "".join(served.lines)
        listing = operator(cert_dir, served, "fleet", "list", "--json")
        assert listing.returncode == 0 and "pi-1" in listing.stdout, listing.stderr
    finally:
        assert served.stop() == 0


# ------------------------------------------------------------------------------------------ the coordinator's door
def test_a_module_callable_submitted_by_name_is_refused_unimported(cert_dir, coordinator, tmp_path, monkeypatch):
    marker = tmp_path / "ran.txt"
    model = marker_module(tmp_path / "opmodels", marker)
    monkeypatch.syspath_prepend(str(tmp_path / "opmodels"))  # importable here: the coordinator must not do it
    register(cert_dir, coordinator.port, "pi-1")
    request = fleet_pb2.SubmitRunRequest(model=model, dataset="digits", steps=2, agents=["pi-1"],
                                         kind=fleet_pb2.JOB_KIND_TRAIN, optimizer=fleet_pb2.OPTIMIZER_SGD,
                                         ram_budget=fleet_pb2.RamBudget(fraction_of_peak=1.0))
    error = refused(lambda: admin(cert_dir, coordinator.port).SubmitRun(request, timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "never imports an operator's code" in error.details() and "traces it on your side" in error.details()
    calibrate = fleet_pb2.CalibrateRequest(agent="pi-1", models=[model])
    error = refused(lambda: admin(cert_dir, coordinator.port).Calibrate(calibrate, timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a zoo model" in error.details()
    assert not marker.exists()
    assert coordinator.store.list_runs() == []


def test_an_upload_resumes_is_stored_under_its_digest_and_serves_the_boards(cert_dir, coordinator, mlp_package):
    port, digest = coordinator.port, mlp_package.digest
    register(cert_dir, port, "pi-1")
    assert refused(lambda: submit_uploaded(cert_dir, port, uploaded(mlp_package))).code() == \
        grpc.StatusCode.FAILED_PRECONDITION  # not uploaded yet
    messages = list(upload_chunks(digest, mlp_package.path, 0, chunk_bytes=4096))
    assert len(messages) > 2
    half = len(messages) // 2
    reply = upload(cert_dir, port, messages[:half])  # the connection "broke" here
    assert not reply.stored and reply.received_bytes == half * 4096
    assert stat(cert_dir, port, digest).received_bytes == half * 4096
    error = refused(lambda: upload(cert_dir, port, messages[:1]))  # not where it stopped
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume from" in error.details()
    assert upload(cert_dir, port, messages[half:]).stored
    assert stat(cert_dir, port, digest).stored
    runs = submit_uploaded(cert_dir, port, uploaded(mlp_package))
    assert [r.status for r in runs] == [fleet_pb2.RUN_STATUS_QUEUED]
    stub = node(cert_dir, "pi-1", port)
    job = stub.PullJob(fleet_pb2.PullJobRequest(wait_s=5), timeout=TIMEOUT_S).job
    assert job.model_digest == digest and job.grouping == mlp_package.grouping
    data = b"".join(c.data for c in stub.FetchModel(fleet_pb2.FetchModelRequest(digest=digest), timeout=TIMEOUT_S))
    assert data == mlp_package.path.read_bytes()


def test_a_tampered_upload_is_refused_and_nothing_is_stored(cert_dir, coordinator, mlp_package):
    port, digest = coordinator.port, mlp_package.digest
    models = coordinator.coordinator.models_dir
    messages = list(upload_chunks(digest, mlp_package.path, 0, chunk_bytes=8192))

    flipped = fleet_pb2.ModelUpload()
    flipped.CopyFrom(messages[-1])
    flipped.chunk.data = bytes([flipped.chunk.data[0] ^ 1]) + flipped.chunk.data[1:]
    flipped.chunk.chunk_sha256 = hashlib.sha256(flipped.chunk.data).hexdigest()  # a consistent chunk, wrong archive
    error = refused(lambda: upload(cert_dir, port, [*messages[:-1], flipped]))
    assert error.code() == grpc.StatusCode.DATA_LOSS and f"not {digest}" in error.details()
    assert not stat(cert_dir, port, digest).stored and stat(cert_dir, port, digest).received_bytes == 0

    damaged = fleet_pb2.ModelUpload()
    damaged.CopyFrom(messages[0])
    damaged.chunk.data = b"\x00" + damaged.chunk.data[1:]  # its chunk_sha256 no longer matches
    error = refused(lambda: upload(cert_dir, port, [damaged]))
    assert error.code() == grpc.StatusCode.DATA_LOSS and "chunk_sha256" in error.details()

    coordinator.coordinator.uploads.max_size_bytes = 1000
    error = refused(lambda: upload(cert_dir, port, messages))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the coordinator's limit" in error.details()
    coordinator.coordinator.uploads.max_size_bytes = 1 << 32

    # a well-formed upload of an archive a board would refuse: a pickled object inside
    buffer = io.BytesIO()
    with zipfile.ZipFile(mlp_package.path) as source, zipfile.ZipFile(buffer, "w") as target:
        for item in source.infolist():
            target.writestr(item, source.read(item))
        prefix = source.namelist()[0].split("/")[0]
        target.writestr(f"{prefix}/data/evil.pkl", b"cos\nsystem\n(S'true'\ntR.")
    evil = buffer.getvalue()
    evil_digest = hashlib.sha256(evil).hexdigest()
    (models_path := models.parent / "evil.pt2").write_bytes(evil)
    error = refused(lambda: upload(cert_dir, port, upload_chunks(evil_digest, models_path, 0)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "pickled objects are refused" in error.details()
    assert sorted(p.name for p in models.iterdir()) == []  # no archive, no part

    error = refused(lambda: upload(cert_dir, port, [fleet_pb2.ModelUpload(digest="../../etc/passwd",
                                                                         chunk=messages[0].chunk)]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "64 lowercase hex" in error.details()


def test_an_uploaded_model_whose_graph_or_grouping_was_altered_is_refused(cert_dir, coordinator, mlp_package):
    port, digest = coordinator.port, mlp_package.digest
    register(cert_dir, port, "pi-1")
    assert upload(cert_dir, port, upload_chunks(digest, mlp_package.path, 0)).stored
    graph = mlp_package.graph.to_dict()
    graph["nodes"][1]["flops"] += 1  # the graph no longer matches the grouping's FLOPs (its fingerprint)
    error = refused(lambda: submit_uploaded(cert_dir, port, uploaded(mlp_package, graph_json=json.dumps(graph))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "different traces" in error.details()
    grouping = fleet_pb2.NodeGrouping()
    grouping.CopyFrom(mlp_package.grouping)
    grouping.groups[1].ops.append("no_such_op")  # a grouping made for another program
    error = refused(lambda: submit_uploaded(cert_dir, port, uploaded(mlp_package, grouping=grouping)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no_such_op" in error.details()
    error = refused(lambda: submit_uploaded(cert_dir, port, uploaded(mlp_package, graph_json="[1, 2]")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a TrainingGraph" in error.details()
    assert coordinator.store.list_runs() == []


def test_an_upload_that_stalls_is_cancelled_and_resumes_from_what_arrived(cert_dir, coordinator, mlp_package):
    """An operator's stream that stops sending holds a server thread: it is cancelled after the idle deadline."""
    import time

    coordinator.coordinator.state.download_idle_s = 1.0
    port, digest = coordinator.port, mlp_package.digest
    messages = list(upload_chunks(digest, mlp_package.path, 0, chunk_bytes=4096))

    def stalling():
        yield messages[0]
        time.sleep(20)  # the coordinator cancels the call long before
        yield from messages[1:]

    started = time.monotonic()
    error = refused(lambda: admin(cert_dir, port).UploadModel(stalling(), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.CANCELLED and time.monotonic() - started < 15
    state = stat(cert_dir, port, digest)
    assert not state.stored and state.received_bytes == 4096
    assert upload(cert_dir, port, messages[1:]).stored


def test_an_unknown_model_name_is_refused_naming_the_zoo(cert_dir, coordinator):
    register(cert_dir, coordinator.port, "pi-1")
    request = fleet_pb2.SubmitRunRequest(model="mlpp", dataset="digits", steps=2, agents=["pi-1"],
                                         kind=fleet_pb2.JOB_KIND_TRAIN, optimizer=fleet_pb2.OPTIMIZER_SGD,
                                         ram_budget=fleet_pb2.RamBudget(fraction_of_peak=1.0))
    error = refused(lambda: admin(cert_dir, coordinator.port).SubmitRun(request, timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown model 'mlpp'" in error.details() and "resnet18_cifar" in error.details()


def test_a_profile_run_traces_no_model(cert_dir, coordinator, tmp_path, monkeypatch):
    """`poet run --kind profile` measures the board: a --model given with it is not traced (nor uploaded)."""
    from host.fleet.client import OperatorClient

    marker = tmp_path / "ran.txt"
    model = marker_module(tmp_path / "opmodels", marker)
    monkeypatch.syspath_prepend(str(tmp_path / "opmodels"))
    register(cert_dir, coordinator.port, "pi-1")
    with OperatorClient(f"127.0.0.1:{coordinator.port}", cert_dir / "alice") as client:
        runs = client.submit(fleet_pb2.SubmitRunRequest(model=model, agents=["pi-1"], kind=fleet_pb2.JOB_KIND_PROFILE))
    assert [r.status for r in runs] == [fleet_pb2.RUN_STATUS_QUEUED] and not marker.exists()
