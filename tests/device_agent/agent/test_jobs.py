"""The board's job runner: TRAIN/VERIFY under a paging schedule on the board's own data, resume, results."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

import poet_edge
from device_agent.agent.jobs import JobCancelled, JobError, JobRunner
from device_agent.agent.telemetry import TelemetrySink
from device_agent.protos import load as load_proto
from device_agent.serde import schedule_to_proto
from host.fleet.model_package import package_model

fleet_pb2 = load_proto("poet.v1.fleet_pb2")
BATCH = 16


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    root = tmp_path_factory.mktemp("board")
    subprocess.run([Path(sys.executable).with_name("poet-agent"), "datasets", "make-demo", "--data-dir",
                    str(root / "data"), "--shard", "1/2"], check=True, capture_output=True)
    package = package_model("mlp", root / "models", batch_size=BATCH)
    schedule = poet_edge.solve("mlp", platform="a72", ram_budget="80%", batch_size=BATCH, time_limit_s=20).schedule
    return root, package, schedule


def _job(package, schedule, run_id: str, **fields):
    settings = dict(job_id=f"job-{run_id}", run_id=run_id, kind=fleet_pb2.JOB_KIND_TRAIN, model_digest=package.digest,
                    grouping=package.grouping, schedule=schedule_to_proto(schedule), steps=12,
                    optimizer=fleet_pb2.OPTIMIZER_SGD, lr=0.05, dataset="digits", seed=4, checkpoint_every_steps=3)
    settings.update(fields)
    return fleet_pb2.Job(**settings)


def _runner(root: Path, state: str) -> tuple[JobRunner, TelemetrySink]:
    (root / state).mkdir(exist_ok=True)
    (root / "flash").mkdir(exist_ok=True)
    runner = JobRunner(flash_dir=root / "flash", data_dir=root / "data", state_dir=root / state)
    return runner, TelemetrySink(root / state)


def test_verify_job_trains_on_board_data_and_matches_plain_training(material):
    root, package, schedule = material
    runner, sink = _runner(root, "state-verify")
    job = _job(package, schedule, "verify", kind=fleet_pb2.JOB_KIND_VERIFY, steps=20,
               collect=fleet_pb2.COLLECT_DELTA)
    result = runner.run(job, package.path, sink.for_run("verify"), threading.Event())
    assert result.status == fleet_pb2.RUN_STATUS_DONE
    assert len(result.loss_per_step) == 20
    assert result.max_rel_param_diff == 0.0  # same weights, batches and RNG: bitwise
    assert result.accuracy_after > result.accuracy_before
    assert result.events_emitted == sink.for_run("verify").emitted > 20 * len(schedule.instructions)
    assert result.measured.step_s > 0 and result.measured.peak_ram_bytes > 0
    assert result.measured.energy_source.startswith("modelled:")
    delta = load(result.weights.safetensors)
    assert any(float(t.abs().max()) > 0 for t in delta.values())
    assert (root / "state-verify" / "runs" / "verify" / "weights.safetensors").is_file()


def test_a_job_cancelled_mid_way_resumes_to_the_same_parameters(material):
    root, package, schedule = material
    runner, sink = _runner(root, "state-plain")
    whole = runner.run(_job(package, schedule, "whole"), package.path, sink.for_run("whole"), threading.Event())

    runner, sink = _runner(root, "state-resume")
    cancel = threading.Event()

    def stop_after_seven(step: int) -> None:
        if step == 7:
            cancel.set()

    with pytest.raises(JobCancelled, match="step 7"):
        runner.run(_job(package, schedule, "cut"), package.path, sink.for_run("cut"), cancel,
                   progress=stop_after_seven)
    resumed = runner.run(_job(package, schedule, "cut"), package.path, sink.for_run("cut"), threading.Event())
    assert resumed.param_digest == whole.param_digest
    assert list(resumed.loss_per_step) == list(whole.loss_per_step)


def test_a_dataset_of_another_shape_is_a_clear_error(material, tmp_path):
    root, package, schedule = material
    import numpy as np

    (tmp_path / "data" / "wide").mkdir(parents=True)
    np.savez(tmp_path / "data" / "wide" / "shard0.npz", x=np.zeros((40, 32), np.float32), y=np.zeros(40, np.int64))
    (tmp_path / "flash").mkdir()
    runner = JobRunner(flash_dir=tmp_path / "flash", data_dir=tmp_path / "data", state_dir=tmp_path)
    sink = TelemetrySink(tmp_path)
    with pytest.raises(JobError, match=r"shape \(32,\).*takes \(64,\)"):
        runner.run(_job(package, schedule, "wide", dataset="wide"), package.path, sink.for_run("wide"),
                   threading.Event())
    with pytest.raises(JobError, match="no dataset 'absent'"):
        runner.run(_job(package, schedule, "absent", dataset="absent"), package.path, sink.for_run("absent"),
                   threading.Event())


def test_a_profile_job_measures_the_board_into_a_profile_the_host_accepts(tmp_path):
    import json

    from host.costs import PlatformProfile

    (tmp_path / "flash").mkdir()
    runner = JobRunner(flash_dir=tmp_path / "flash", data_dir=tmp_path, state_dir=tmp_path, platform="pi-7",
                       quick_profile=True)
    job = fleet_pb2.Job(job_id="job-p", run_id="p", kind=fleet_pb2.JOB_KIND_PROFILE)
    result = runner.run(job, None, TelemetrySink(tmp_path).for_run("p"), threading.Event())
    assert result.status == fleet_pb2.RUN_STATUS_DONE
    profile = PlatformProfile.from_dict(json.loads(result.profile_json))
    assert profile.name == "pi-7" and profile.page_out_throughput_bytes_per_s > 0
    assert profile.energy_source.startswith("modelled:")
    assert list((tmp_path / "flash").iterdir()) == []  # the benchmark's page files are gone


@pytest.mark.slow  # 11 s (traces hf_bert); the fast suite keeps its 5-minute margin
def test_a_sequence_model_trains_on_synthetic_samples_with_a_label_per_token(tmp_path):
    """Calibration runs of a masked-LM train on `:synthetic`: its labels take the model's label shape (one per
    token), not one per sample."""
    from device_agent.agent.datasets import SYNTHETIC_DATASET

    package = package_model("hf_bert", tmp_path / "models", batch_size=2)
    assert list(package.grouping.class_index_shape) == [2, 32]
    schedule = poet_edge.solve("hf_bert", platform="a72", ram_budget="100%", batch_size=2, time_limit_s=20).schedule
    (tmp_path / "data").mkdir()
    runner, sink = _runner(tmp_path, "state")
    result = runner.run(_job(package, schedule, "bert", dataset=SYNTHETIC_DATASET, steps=2), package.path,
                        sink.for_run("bert"), threading.Event())
    assert result.status == fleet_pb2.RUN_STATUS_DONE and len(result.loss_per_step) == 2


# ------------------------------------------------------------------------------------------ checkpoints
def _sgd_model():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # momentum buffers exist
    return module, optimizer


def test_a_checkpoint_is_one_file_so_a_kill_at_any_moment_leaves_a_whole_one(tmp_path):
    """The metadata rides in the safetensors header: there is no moment between two writes at which a kill -9 leaves
    tensors and metadata of different steps (which made a restarted board start over from step 0)."""
    from device_agent.agent.jobs import _Run

    module, optimizer = _sgd_model()
    run = _Run(tmp_path, "run-1")
    run.save_checkpoint(module, optimizer, 10, 80, {"losses": [1.0, 0.5]})
    assert sorted(p.name for p in run.dir.iterdir()) == ["checkpoint.safetensors"]
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    meta = run.load_checkpoint(fresh, fresh_optimizer)
    assert (meta["step"], meta["data_index"], meta["losses"]) == (10, 80, [1.0, 0.5])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    assert fresh_optimizer.state_dict()["state"][0]["momentum_buffer"].equal(
        optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_an_older_two_file_checkpoint_still_resumes_and_a_mixed_pair_starts_over(tmp_path):
    import json

    from safetensors.torch import save

    from device_agent.agent.jobs import _Run

    module, optimizer = _sgd_model()
    run = _Run(tmp_path, "run-1")
    tensors = {f"model/{k}": v.contiguous() for k, v in module.state_dict().items()}
    tensors["rng/cpu"] = torch.get_rng_state()
    tensors["meta/step"] = torch.tensor([20], dtype=torch.int64)
    (run.dir / "checkpoint.safetensors").write_bytes(save(tensors))
    meta = {"step": 20, "data_index": 160, "optimizer_entries": [], "param_groups": optimizer.state_dict()["param_groups"]}
    (run.dir / "checkpoint.json").write_text(json.dumps(meta))
    assert run.load_checkpoint(torch.nn.Linear(3, 2), torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1))["step"] == 20
    (run.dir / "checkpoint.json").write_text(json.dumps({**meta, "step": 30}))
    assert run.load_checkpoint(module, optimizer) is None


@pytest.mark.slow  # inductor compiles each node's forward and backward at the first step (tens of seconds)
def test_a_compile_job_trains_through_inductor(material, tmp_path, monkeypatch):
    """`poet run --compile`: the board runs the node functions through inductor (its kernels land in inductor's
    cache); without the flag nothing is compiled."""
    root, package, schedule = material
    cache = tmp_path / "inductor-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    logged: list[str] = []
    runner, sink = _runner(root, "state-plain-2")
    runner.log = logged.append
    plain = runner.run(_job(package, schedule, "plain", steps=3), package.path, sink.for_run("plain"), threading.Event())
    assert plain.status == fleet_pb2.RUN_STATUS_DONE and not cache.exists()
    runner, sink = _runner(root, "state-compiled")
    runner.log = logged.append
    compiled = runner.run(_job(package, schedule, "compiled", steps=3, compile=True), package.path,
                          sink.for_run("compiled"), threading.Event())
    assert compiled.status == fleet_pb2.RUN_STATUS_DONE and len(compiled.loss_per_step) == 3
    assert any("through inductor" in line for line in logged) and not any("could not compile" in line for line in logged)
    assert any(cache.rglob("*.py")), "inductor wrote no kernels"
