"""device_agent.flower.PoetNode: a Flower round under the server's schedule, from the global weights, on the
node's own data; plain training one flag away. Real archives, a real solve, real training (no Flower processes:
tests/host/flower and tests/poet_edge/flower run these nodes behind a real SuperLink)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from device_agent.agent.demo_data import make_demo
from device_agent.flower import CONFIG_ARCHIVE, CONFIG_JOB, CONFIG_PLAIN, FlowerNodeError, PoetNode, archive_arrays
from device_agent.flower.client import node_from_config
from host.costs import load_profile, price_graph
from host.fleet import serde
from host.fleet.model_package import package_model
from host.run.solve import SolveSettings
from host.solver.solve import no_remat_peak_bytes, solve_schedule

STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("flower-node")
    package = package_model("mlp", root / "models", batch_size=16, seed=0)
    priced = price_graph(package.graph.with_optimizer("sgd"), load_profile("a72"))
    result = solve_schedule(priced, SolveSettings(runtime_budget=1.2).options(0.8 * no_remat_peak_bytes(priced)))
    assert result.schedule is not None, result.message
    spec = {"model_digest": package.digest, "model_size_bytes": package.size_bytes, "steps": STEPS,
            "optimizer": "sgd", "lr": 0.1, "collect": "none", "seed": 5, "batch_size": 16,
            "grouping_json": serde.grouping_to_json(package.grouping)}
    job = serde.job_message(spec, job_id="j", run_id="r", kind="train",
                            schedule_json=serde.schedule_json(result.schedule))
    make_demo(root / "data", "digits", shard=(1, 2))
    node = PoetNode(data_dir=root / "data", dataset="digits", work_dir=root / "work", platform="a72")
    config = {CONFIG_JOB: job.SerializeToString(), CONFIG_ARCHIVE: package.path.read_bytes()}
    return node, package, result.schedule, config


def _moved(arrays, scale):
    rng = np.random.default_rng(0)
    return [a + scale * rng.standard_normal(a.shape).astype(a.dtype) for a in arrays]


def test_a_round_under_the_schedule_equals_plain_training_from_the_sent_weights(setup):
    node, package, schedule, config = setup
    names, initial = archive_arrays(package.path)
    start = _moved(initial, 0.05)  # the "global" weights differ from the archive's: training must start from them
    trained, examples, metrics = node.fit(start, config)
    plain, plain_examples, plain_metrics = node.fit(start, {**config, CONFIG_PLAIN: True})

    assert examples == plain_examples == STEPS * 16
    assert [a.shape for a in trained] == [a.shape for a in initial]
    for a, b in zip(trained, plain, strict=True):
        assert np.array_equal(a, b)  # the executor is bitwise plain PyTorch
    assert any(not np.array_equal(a, s) for a, s in zip(trained, start, strict=True))  # it trained

    # The same steps by hand, from `start`, on the node's batches: the node used the sent weights and its own data.
    from device_agent.agent.datasets import LocalDataset
    from device_agent.agent.program import load_module

    module = load_module(package.path)
    module.load_state_dict({n: torch.from_numpy(a) for n, a in zip(names, start, strict=True)})
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)  # make_optimizer("sgd")
    for batch in LocalDataset(node.data_dir, "digits").batches(16, 5, count=STEPS):
        optimizer.zero_grad()
        module(torch.from_numpy(batch.x), labels=torch.from_numpy(batch.y)).backward()
        optimizer.step()
    for name, a in zip(names, trained, strict=True):
        assert np.array_equal(a, module.state_dict()[name].numpy()), name

    predicted = schedule.prediction
    assert (metrics["recomputes"], metrics["page_ins"], metrics["page_outs"]) == (
        predicted.recomputes, predicted.page_ins, predicted.page_outs)
    assert metrics["recomputes"] + metrics["page_outs"] > 0  # a real schedule, not plain training in disguise
    assert metrics["mode"] == "poet" and metrics["steps"] == STEPS
    assert 0 < metrics["peak_ram_bytes"] <= schedule.ram_budget_bytes
    assert metrics["energy_j"] > 0 and metrics["energy_source"]
    assert metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=0, abs=0)
    assert plain_metrics["mode"] == "plain" and "peak_ram_bytes" not in plain_metrics
    assert not list((node.state_dir / "runs").iterdir())  # a round leaves no run state behind


def test_the_archive_is_cached_and_checked(setup):
    node, package, _, config = setup
    _, initial = archive_arrays(package.path)
    node.fit(initial, config)
    trained, _, _ = node.fit(initial, {CONFIG_JOB: config[CONFIG_JOB]})  # no archive: the cached copy
    assert len(trained) == len(initial)
    tampered = bytearray(config[CONFIG_ARCHIVE])
    tampered[-100] ^= 1
    assert hashlib.sha256(bytes(tampered)).hexdigest() != package.digest
    with pytest.raises(FlowerNodeError, match="does not hash to the job's digest"):
        node.fit(initial, {**config, CONFIG_ARCHIVE: bytes(tampered)})


def test_refusals_name_the_problem(setup, tmp_path):
    node, package, _, config = setup
    _, initial = archive_arrays(package.path)
    with pytest.raises(FlowerNodeError, match="PoetStrategy"):
        node.fit(initial, {})
    with pytest.raises(FlowerNodeError, match="arrays but the model has"):
        node.fit(initial[:-1], config)
    with pytest.raises(FlowerNodeError, match="shape"):
        node.fit([a.T.copy() if a.ndim == 2 else a for a in initial], config)
    with pytest.raises(FlowerNodeError, match="no dataset"):
        PoetNode(data_dir=node.data_dir, dataset="missing", work_dir=tmp_path)
    with pytest.raises(ValueError, match="poet-dataset"):
        node_from_config({"poet-data-dir": str(node.data_dir), "poet-work-dir": str(tmp_path)})


def test_properties_carry_the_facts_an_agent_registers(setup):
    node, *_ = setup
    from device_agent import protos

    properties = PoetNode(data_dir=node.data_dir, dataset="digits", work_dir=node.work_dir, platform="a72",
                          ram_budget="40%", memory_limit_bytes=512 * 1024**2).properties()
    facts = protos.load("poet.v1.fleet_pb2").RegisterRequest.FromString(properties["poet.facts"])
    assert facts.platform == "a72" and facts.memory_limit_bytes == 512 * 1024**2 and facts.ram_total_bytes > 0
    assert properties["poet.ram_budget"] == "40%"
