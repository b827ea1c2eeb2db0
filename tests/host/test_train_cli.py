"""`poet train` / `poet verify` through the `poet` command."""

from __future__ import annotations

import json
import os

from torch import nn

from host.cli import main as poet_main
from host.train_cli import EXIT_VERIFY_FAILED


def dropout_mlp() -> nn.Module:
    """A bare module for ``--model tests.host.test_train_cli:dropout_mlp --input-shape 8,32``."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _run(capsys, *argv: str) -> tuple[int, dict | None, str]:
    code = poet_main(list(argv))
    captured = capsys.readouterr()
    try:
        payload = json.loads(captured.out.strip().splitlines()[-1]) if captured.out.strip() else None
    except json.JSONDecodeError:
        payload = None
    return code, payload, captured.err


def test_verify_reports_exactness_counters_budget_and_time(capsys, tmp_path):
    code, report, _ = _run(capsys, "verify", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                           "--batch-size", "4", "--flash-dir", str(tmp_path), "--optimizer", "adamw", "--json")
    assert code == 0
    for key in ("max_abs_param_diff", "max_rel_param_diff", "peak_tracked_bytes", "ram_budget_bytes", "planned",
                "executed", "step_time_ratio", "ok"):
        assert key in report
    assert report["ok"] and report["bitwise_equal"]
    assert report["max_rel_param_diff"] == 0.0
    assert report["planned"] == report["executed"]
    assert set(report["planned"]) >= {"computes", "page_ins", "page_outs"}
    assert report["peak_tracked_bytes"] <= report["ram_budget_bytes"]
    assert report["step_time_ratio"] > 0
    assert os.listdir(tmp_path) == []


def test_verify_with_a_model_factory_and_dropout_recomputed(capsys, tmp_path):
    argv = ["verify", "--model", f"{__name__}:dropout_mlp", "--input-shape", "8,32", "--platform", "a72",
            "--ram-budget", "75%", "--no-paging", "--flash-dir", str(tmp_path), "--json"]
    code, report, _ = _run(capsys, *argv)
    assert code == 0, report
    assert report["planned"]["recomputes"] > 0 and report["ok"]


def test_verify_fails_when_parameters_differ(capsys, tmp_path, monkeypatch):
    """Sabotage the RNG replay: the recomputed dropout mask changes, verify notices and exits non-zero."""
    import host.graph.partition as partition

    monkeypatch.setattr(partition, "_draws_random", lambda module: False)
    argv = ["verify", "--model", f"{__name__}:dropout_mlp", "--input-shape", "8,32", "--platform", "a72",
            "--ram-budget", "75%", "--no-paging", "--flash-dir", str(tmp_path), "--json"]
    code, report, _ = _run(capsys, *argv)
    assert code == EXIT_VERIFY_FAILED
    assert not report["ok"] and report["max_rel_param_diff"] > 1e-6


def test_train_pages_for_real_and_reports_predicted_against_measured(capsys, tmp_path):
    events = tmp_path / "events.jsonl"
    flash = tmp_path / "flash"
    flash.mkdir()
    code, summary, err = _run(capsys, "train", "--model", "resnet18_cifar", "--batch-size", "2", "--platform", "m0",
                              "--ram-budget", "50%", "--no-remat", "--steps", "2", "--flash-dir", str(flash),
                              "--events", str(events), "--json")
    assert code == 0, err
    assert summary["planned"]["page_outs"] > 0
    assert {k: summary["executed"][k] for k in ("computes", "page_ins", "page_outs")} == {
        k: summary["planned"][k] for k in ("computes", "page_ins", "page_outs")
    }
    assert summary["measured"]["peak_tracked_bytes"] <= summary["ram_budget_bytes"]
    for key in ("peak_ram_bytes", "step_s", "energy_j"):
        assert summary["predicted"][key] > 0
    assert summary["measured_energy_source"] == "modelled:cpu-time×power"
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert sum(r["type"] == "step" for r in records) == 2
    assert sum(r["kind"] == "page_in" for r in records if r["type"] == "instruction") == 2 * summary["planned"]["page_ins"]
    assert os.listdir(flash) == []


def test_train_text_output_and_plain_mode(capsys, tmp_path):
    code, _, err = _run(capsys, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                        "--steps", "2", "--flash-dir", str(tmp_path))
    assert code == 0
    assert "2/2" in err  # the progress bar
    code, summary, _ = _run(capsys, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                            "--steps", "2", "--plain", "--json")
    assert code == 0 and summary["mode"] == "plain" and len(summary["losses"]) == 2


def test_train_with_a_schedule_file_and_a_changed_trace(capsys, tmp_path):
    from host import cli

    schedule_file = tmp_path / "mlp.schedule.json"
    assert cli.main(["solve", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%", "--batch-size", "4",
                     "--out", str(schedule_file), "--json"]) == 0
    capsys.readouterr()
    code, summary, _ = _run(capsys, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                            "--batch-size", "4", "--schedule", str(schedule_file), "--steps", "1",
                            "--flash-dir", str(tmp_path), "--json")
    assert code == 0 and summary["solve_status"] == "optimal"
    code, _, err = _run(capsys, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                        "--batch-size", "8", "--schedule", str(schedule_file), "--flash-dir", str(tmp_path))
    assert code == 2
    assert "fingerprint" in err and "solve the schedule again" in err


def test_bad_schedule_and_flash_dir_fail_before_training(capsys, tmp_path):
    schedule_file = tmp_path / "bad.json"
    from host import cli

    assert cli.main(["solve", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%", "--batch-size", "4",
                     "--out", str(schedule_file), "--json"]) == 0
    capsys.readouterr()
    data = json.loads(schedule_file.read_text())
    data["instructions"][1]["node"] = 999
    schedule_file.write_text(json.dumps(data))
    code, _, err = _run(capsys, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                        "--batch-size", "4", "--schedule", str(schedule_file), "--flash-dir", str(tmp_path))
    assert code == 2 and "999" in err
    code, _, err = _run(capsys, "train", "--model", "mlp", "--platform", "a72", "--ram-budget", "70%",
                        "--flash-dir", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    code, _, err = _run(capsys, "verify", "--model", "mlp", "--platform", "a72", "--ram-budget", "10",
                        "--flash-dir", str(tmp_path))
    assert code == 3 and "infeasible" in err


def test_commands_register_on_the_poet_parser():
    from host import cli

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert {"train", "verify", "demo"} <= set(subparsers.choices)


def test_allocator_defaults_keep_freed_memory_and_return_under_a_cgroup():
    from argparse import Namespace

    from host.train_cli import _allocator_mode

    assert _allocator_mode(Namespace(allocator=None, cgroup=None)) == "keep"
    assert _allocator_mode(Namespace(allocator=None, cgroup="/sys/fs/cgroup/poet")) == "return"
    assert _allocator_mode(Namespace(allocator="default", cgroup=None)) == "default"
