"""`poet train` / `poet verify` through the `poet` command (main() under capfd, or the real script)."""

from __future__ import annotations

import json
import os

import pytest
from torch import nn

from host.cli.common import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED
from tests.host.cli.helpers import one_json_object, run_main


def dropout_mlp() -> nn.Module:
    """A bare module for ``--model tests.host.cli.test_train:dropout_mlp --input-shape 8,32``."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def test_verify_reports_exactness_counters_budget_and_time(capfd, tmp_path):
    code, out, err = run_main(capfd, "verify", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%",
                              "--batch-size", "4", "--flash-dir", str(tmp_path), "--optimizer", "adamw", "--json")
    assert code == 0, err
    report = one_json_object(out)
    for key in ("max_abs_param_diff", "max_rel_param_diff", "peak_tracked_bytes", "ram_budget_bytes", "planned",
                "executed", "step_time_ratio", "ok", "solve_status", "solve_gap"):
        assert key in report
    assert report["ok"] and report["bitwise_equal"]
    assert report["max_rel_param_diff"] == 0.0
    assert report["planned"] == report["executed"]
    assert set(report["planned"]) >= {"computes", "page_ins", "page_outs"}
    assert report["peak_tracked_bytes"] <= report["ram_budget_bytes"]
    assert report["step_time_ratio"] > 0
    assert os.listdir(tmp_path) == []


def test_verify_with_a_model_factory_and_dropout_recomputed(capfd, tmp_path):
    argv = ["verify", "--model", f"{__name__}:dropout_mlp", "--input-shape", "8,32", "--platform", "a72",
            "--ram-budget", "75%", "--no-paging", "--flash-dir", str(tmp_path), "--json"]
    code, out, err = run_main(capfd, *argv)
    assert code == 0, err
    report = one_json_object(out)
    assert report["planned"]["recomputes"] > 0 and report["ok"]


def test_verify_fails_when_parameters_differ(capfd, tmp_path, monkeypatch):
    """Sabotage the RNG replay: the recomputed dropout mask changes, verify notices and exits non-zero."""
    import device_agent.executor.split as partition

    monkeypatch.setattr(partition, "draws_random", lambda module: False)
    argv = ["verify", "--model", f"{__name__}:dropout_mlp", "--input-shape", "8,32", "--platform", "a72",
            "--ram-budget", "75%", "--no-paging", "--flash-dir", str(tmp_path), "--json"]
    code, out, _ = run_main(capfd, *argv)
    assert code == EXIT_VERIFY_FAILED
    report = one_json_object(out)
    assert not report["ok"] and report["max_rel_param_diff"] > 1e-6


@pytest.mark.slow  # real paging through the CLI, ~7 s
def test_train_pages_for_real_and_reports_predicted_against_measured(capfd, tmp_path):
    events = tmp_path / "events.jsonl"
    flash = tmp_path / "flash"
    flash.mkdir()
    code, out, err = run_main(capfd, "train", "--model", "resnet18_cifar", "--batch-size", "2", "--platform", "m0",
                              "--ram-budget", "50%", "--no-remat", "--steps", "2", "--flash-dir", str(flash),
                              "--events", str(events), "--json")
    assert code == 0, err
    summary = one_json_object(out)
    assert summary["planned"]["page_outs"] > 0
    assert {k: summary["executed"][k] for k in ("computes", "page_ins", "page_outs")} == {
        k: summary["planned"][k] for k in ("computes", "page_ins", "page_outs")
    }
    assert summary["measured"]["peak_tracked_bytes"] <= summary["ram_budget_bytes"]
    for key in ("peak_ram_bytes", "step_s", "energy_j"):
        assert summary["predicted"][key] > 0
    assert summary["measured_energy_source"] == "modelled:cpu-time×power"
    assert summary["predicted_platform"] == "m0"
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert sum(r["type"] == "step" for r in records) == 2
    assert sum(r["kind"] == "page_in" for r in records if r["type"] == "instruction") == 2 * summary["planned"]["page_ins"]
    assert os.listdir(flash) == []


def test_train_text_output_plain_mode_and_a_created_flash_dir(capfd, tmp_path):
    flash = tmp_path / "out" / "flash"
    code, out, err = run_main(capfd, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%",
                              "--steps", "2", "--flash-dir", str(flash))
    assert code == 0, err
    assert "2/2" in err  # the progress bar, on stderr
    assert f"created flash dir {flash}" in err and flash.is_dir() and os.listdir(flash) == []
    assert "solve     optimal (gap" in out and "predicted for platform a72" in out
    code, out, _ = run_main(capfd, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%",
                            "--steps", "2", "--plain", "--json")
    summary = one_json_object(out)
    assert code == 0 and summary["mode"] == "plain" and len(summary["losses"]) == 2


@pytest.fixture
def mlp_schedule(capfd, tmp_path):
    """An mlp schedule (batch 4) solved for m4, written with `poet solve --out`."""
    schedule_file = tmp_path / "mlp.schedule.json"
    code, _, err = run_main(capfd, "solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "80%",
                            "--batch-size", "4", "--out", str(schedule_file), "--json")
    assert code == 0, err
    return schedule_file


def test_train_with_a_schedule_file_needs_no_budget_and_labels_its_platform(capfd, tmp_path, mlp_schedule):
    solved_for = json.loads(mlp_schedule.read_text())
    code, out, err = run_main(capfd, "train", "--model", "mlp", "--platform", "a72", "--batch-size", "4",
                              "--schedule", str(mlp_schedule), "--steps", "1", "--flash-dir", str(tmp_path))
    assert code == 0, err
    assert "predicted for platform m4" in out and "predicted for platform a72" not in out
    code, out, err = run_main(capfd, "train", "--model", "mlp", "--batch-size", "4", "--schedule", str(mlp_schedule),
                              "--steps", "1", "--flash-dir", str(tmp_path), "--json")
    assert code == 0, err
    summary = one_json_object(out)
    assert summary["solve_status"] == "optimal" and summary["predicted_platform"] == "m4"
    assert summary["platform"] == "m4"  # no --platform: the schedule's own
    assert summary["ram_budget_bytes"] == pytest.approx(solved_for["ram_budget_bytes"])
    code, _, err = run_main(capfd, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%",
                            "--batch-size", "8", "--schedule", str(mlp_schedule), "--flash-dir", str(tmp_path))
    assert code == EXIT_USAGE
    assert "fingerprint" in err and "solve the schedule again" in err


def _edited(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format_version=99), "format_version 99"),
    (lambda d: d.pop("format_version"), "no format_version"),
    (lambda d: d.pop("graph_fingerprint"), "no graph_fingerprint"),
    (lambda d: d["nodes"][2].update(output_bytes=str(int(d["nodes"][2]["output_bytes"]) + 8)), "node 2"),
    (lambda d: d["instructions"][1].update(node=999), "999"),
    (lambda d: d.clear(), "is not a schedule"),
])
def test_bad_schedule_files_are_refused_before_training(capfd, tmp_path, mlp_schedule, edit, message):
    _edited(mlp_schedule, edit)
    code, out, err = run_main(capfd, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%",
                              "--batch-size", "4", "--schedule", str(mlp_schedule), "--flash-dir", str(tmp_path))
    assert code == EXIT_USAGE, err
    assert message in err and "Traceback" not in err
    assert out == ""


def test_an_infeasible_budget_fails_before_training(capfd, tmp_path):
    code, _, err = run_main(capfd, "verify", "--model", "mlp", "--platform", "a72", "--ram-budget", "10",
                            "--flash-dir", str(tmp_path))
    assert code == 3 and "infeasible" in err


def test_allocator_defaults_keep_freed_memory_and_return_under_a_cgroup():
    from host.run.train import allocator_mode

    assert allocator_mode(None, None) == "keep"
    assert allocator_mode(None, "/sys/fs/cgroup/poet") == "return"
    assert allocator_mode("default", None) == "default"


@pytest.mark.slow  # inductor compiles mlp's nodes in two processes
def test_train_compile_runs_inductor_kernels_under_the_schedule(tmp_path):
    """The real `poet` script: --compile trains under the schedule with inductor's kernels, says so, and executes
    exactly the planned instructions."""
    from tests.host.cli.helpers import poet

    out = poet("train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--batch-size", "4",
               "--granularity", "block", "--compile", "--steps", "2", "--flash-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    report = one_json_object(out.stdout)
    assert report["inductor"] is True and report["mode"] == "schedule"
    assert report["planned"] == report["executed"]
    assert "runs uncompiled" not in out.stderr and "under autograd" not in out.stderr
    human = poet("train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--batch-size", "4",
                 "--compile", "--steps", "1", "--flash-dir", str(tmp_path))
    assert human.returncode == 0, human.stderr
    assert "inductor kernels: not bitwise eager" in human.stdout


def test_train_compile_with_plain_is_refused(capfd):
    code, _out, err = run_main(capfd, "train", "--model", "mlp", "--ram-budget", "80%", "--plain", "--compile")
    assert code == EXIT_USAGE
    assert "--compile" in err and "torch.compile" in err


@pytest.mark.slow  # four `poet` processes, each tracing resnet18_cifar
def test_a_schedule_solved_at_block_depth_two_trains_at_that_depth(tmp_path):
    """The real `poet` script: `--granularity block:2` gives nodes between block and layer; the schedule solved
    there trains at that granularity exactly as planned, and at another granularity it is refused."""
    from tests.host.cli.helpers import poet

    nodes = {}
    for granularity in ("block", "block:2", "layer"):
        out = poet("solve", "--model", "resnet18_cifar", "--platform", "a72", "--batch-size", "4", "--ram-budget", "80%",
                   "--granularity", granularity, "--time-limit", "20", "--out", str(tmp_path / f"{granularity}.json"),
                   "--json")
        # one top-level block's inputs, output and workspace are the whole no-remat peak: no schedule at 80%
        assert out.returncode == (EXIT_INFEASIBLE if granularity == "block" else EXIT_OK), out.stderr
        nodes[granularity] = one_json_object(out.stdout)["nodes"]
    assert nodes["block"] < nodes["block:2"] < nodes["layer"]
    schedule = str(tmp_path / "block:2.json")
    out = poet("train", "--model", "resnet18_cifar", "--batch-size", "4", "--granularity", "block:2", "--schedule",
               schedule, "--steps", "2", "--flash-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    report = one_json_object(out.stdout)
    assert report["mode"] == "schedule" and report["planned"] == report["executed"]
    refused = poet("train", "--model", "resnet18_cifar", "--batch-size", "4", "--schedule", schedule, "--steps", "1",
                   "--flash-dir", str(tmp_path))
    assert refused.returncode != 0 and "solve the schedule again" in refused.stderr
    bad = poet("solve", "--model", "resnet18_cifar", "--platform", "a72", "--ram-budget", "60%", "--granularity",
               "block:0")
    assert bad.returncode == 2 and "--granularity" in bad.stderr and "block:N" in bad.stderr
