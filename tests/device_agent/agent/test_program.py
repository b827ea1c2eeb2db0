"""A model received by a board: archive checks, the split by the host's grouping, exact training under a schedule."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

import poet_edge
from device_agent.agent.program import ModelArchiveError, check_archive, load_module, load_program
from device_agent.executor import ScheduleExecutor
from device_agent.protos import load
from host.fleet.model_package import package_model, sha256_file
from host.graph.partition import partition_from_traced

fleet_pb2 = load("poet.v1.fleet_pb2")


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    package = package_model("mlp", cache, batch_size=16)
    report = poet_edge.solve("mlp", platform="a72", ram_budget="80%", batch_size=16, time_limit_s=20)
    return package, report.schedule


def _rewrite_zip(source: Path, target: Path, edit) -> None:
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info, data)


def test_package_is_content_addressed_and_deterministic(packaged, tmp_path):
    package, _ = packaged
    assert package.path.name == f"{package.digest}.pt2"
    assert sha256_file(package.path) == package.digest
    assert package.size_bytes == package.path.stat().st_size
    again = package_model("mlp", tmp_path, batch_size=16)
    assert again.grouping == package.grouping
    assert again.graph.fingerprint() == package.graph.fingerprint()
    assert list(package.grouping.batch_shape) == [16, 64] and package.grouping.num_classes == 10


def test_board_training_under_a_paging_schedule_equals_plain_training(packaged, tmp_path):
    package, schedule = packaged
    assert schedule.counts()["page_outs"] + schedule.counts()["recomputes"] > 0, "the schedule must do something"
    loaded = load_program(package.path, package.grouping, schedule)
    assert loaded.partition.fingerprint == schedule.graph_fingerprint == package.graph.fingerprint()
    plain = load_module(package.path)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(3)]
    optimizer = torch.optim.SGD(loaded.partition.parameters, lr=0.1, momentum=0.9)
    with ScheduleExecutor(loaded.partition, schedule, flash_dir=str(tmp_path)) as executor:
        scheduled = [executor.train_step((x,), y, optimizer).loss for x, y in batches]
    reference = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    eager = []
    for x, y in batches:
        reference.zero_grad(set_to_none=True)
        loss = plain(x, labels=y)
        loss.backward()
        reference.step()
        eager.append(float(loss.detach()))
    assert scheduled == eager
    for name, value in plain.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[name], value), name


def test_the_host_partition_and_the_board_partition_agree(packaged):
    package, schedule = packaged
    from host.graph.resolve import resolve_model

    traced = resolve_model("mlp", batch_size=16).traced
    host = partition_from_traced(traced)
    board = load_program(package.path, package.grouping, schedule).partition
    assert host.fingerprint == board.fingerprint == traced.graph.fingerprint()
    assert [(p.input_values, p.output_values, p.grad_input_values) for p in host.programs.values()] == [
        (p.input_values, p.output_values, p.grad_input_values) for p in board.programs.values()
    ]
    assert host.value_producer == board.value_producer


def test_an_archive_with_a_pickled_weight_is_refused(packaged, tmp_path):
    package, schedule = packaged
    forged = tmp_path / "forged.pt2"

    def flag_pickle(name, data):
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            first = next(iter(config["config"]))
            config["config"][first]["use_pickle"] = True
            return json.dumps(config).encode()
        return data

    _rewrite_zip(package.path, forged, flag_pickle)
    with pytest.raises(ModelArchiveError, match="pickled"):
        check_archive(forged)
    with pytest.raises(ModelArchiveError, match="pickled"):
        load_program(forged, package.grouping, schedule)


@pytest.mark.parametrize("entry", ["archive/data/constants/custom_obj_0", "archive/data/weights/model.pt"])
def test_an_archive_with_extra_objects_is_refused(packaged, tmp_path, entry):
    package, _ = packaged
    forged = tmp_path / "forged.pt2"
    _rewrite_zip(package.path, forged, lambda name, data: data)
    with zipfile.ZipFile(forged, "a") as archive:
        archive.writestr(entry, b"\x80\x04K\x01.")
    with pytest.raises(ModelArchiveError, match="not part of a plain torch.export archive"):
        check_archive(forged)


def test_sample_inputs_that_need_unpickling_are_refused(packaged, tmp_path):
    package, _ = packaged
    forged = tmp_path / "forged.pt2"
    import io
    import pickle

    class Anything:
        pass

    payload = io.BytesIO()
    torch.save({"x": Anything.__name__, "obj": pickle.dumps(1)}, payload)  # loads fine: plain containers
    _rewrite_zip(package.path, forged,
                 lambda name, data: payload.getvalue() if "sample_inputs" in name else data)
    check_archive(forged)  # plain containers pass
    bad = io.BytesIO()
    torch.save(torch.nn.Linear(1, 1), bad)  # a module needs unpickling of arbitrary classes
    _rewrite_zip(package.path, forged, lambda name, data: bad.getvalue() if "sample_inputs" in name else data)
    with pytest.raises(ModelArchiveError, match="sample inputs"):
        check_archive(forged)


def test_not_a_zip_is_refused(tmp_path):
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ModelArchiveError, match="not a torch.export archive"):
        check_archive(junk)


def test_a_schedule_for_another_graph_is_refused(packaged):
    package, schedule = packaged
    from dataclasses import replace

    other = replace(schedule, graph_fingerprint="0" * 16)
    with pytest.raises(ModelArchiveError, match="fingerprint"):
        load_program(package.path, package.grouping, other)


def test_a_grouping_naming_missing_ops_is_refused(packaged):
    package, schedule = packaged
    grouping = fleet_pb2.NodeGrouping()
    grouping.CopyFrom(package.grouping)
    grouping.groups[1].ops[0] = "no_such_op"
    with pytest.raises(ModelArchiveError, match="no_such_op"):
        load_program(package.path, grouping, schedule)
