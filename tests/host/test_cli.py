"""The `poet` command contract: JSON fields, readable output, and errors that name the fix."""

import json

import pytest

from device_agent.serde import read_schedule_file
from host.cli import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, main, parse_ram_budget

JSON_FIELDS = {
    "status", "objective_j", "compute_j", "paging_j", "runtime_s", "runtime_budget_s", "peak_ram_bytes",
    "ram_budget_bytes", "fixed_bytes", "recomputes", "page_ins", "page_outs", "solve_s", "gap", "nodes", "edges",
}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_example_is_answered_at_once_and_proven_optimal(capsys):
    code, out, _ = run(capsys, "solve", "--model", "poet2022:resnet18_cifar", "--platform", "a72",
                       "--ram-budget", "3000000", "--runtime-budget", "7.6", "--json")
    assert code == EXIT_OK
    result = json.loads(out)
    assert JSON_FIELDS <= result.keys()
    assert result["status"] == "optimal" and result["gap"] == 0.0
    assert result["solve_s"] < 1.0
    assert result["peak_ram_bytes"] <= result["ram_budget_bytes"]
    assert result["nodes"] == 133


def test_binding_solve_writes_a_valid_schedule_and_plots(capsys, tmp_path):
    schedule_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "80%",
                         "--plot", str(tmp_path / "plots"), "--out", str(schedule_file))
    assert code == EXIT_OK, err
    assert "status    optimal" in out and "validated" in out
    schedule = read_schedule_file(schedule_file)
    assert schedule.graph_name and schedule.instructions
    assert schedule.prediction.peak_ram_bytes <= schedule.ram_budget_bytes
    assert len(list((tmp_path / "plots").glob("*.png"))) == 2


def test_unknown_model_lists_valid_names(capsys):
    code, _, err = run(capsys, "solve", "--model", "resnet19", "--platform", "a72", "--ram-budget", "1MB")
    assert code == EXIT_USAGE
    assert "resnet19" in err and "resnet18_cifar" in err and "poet2022:bert" in err


def test_unknown_platform_lists_valid_names(capsys):
    code, _, err = run(capsys, "solve", "--model", "mlp", "--platform", "pi9", "--ram-budget", "1MB")
    assert code == EXIT_USAGE
    assert "pi9" in err and "a72" in err and "jetsontx2" in err


def test_budget_below_the_minimum_states_it(capsys):
    code, out, _ = run(capsys, "solve", "--model", "poet2022:linear", "--platform", "a72", "--ram-budget", "100",
                       "--json")
    assert code == EXIT_INFEASIBLE
    result = json.loads(out)
    assert result["status"] == "infeasible"
    assert str(result["minimum_ram_bytes"]) in result["message"]


def test_runtime_factor_below_one_is_rejected(capsys):
    code, _, err = run(capsys, "solve", "--model", "mlp", "--platform", "a72", "--ram-budget", "1MB",
                       "--runtime-budget", "0.8")
    assert code == EXIT_USAGE and "below 1.0" in err


def test_user_factor_with_input_shape(capsys):
    code, out, err = run(capsys, "solve", "--model", "host.graph.examples:small_cnn", "--input-shape", "4,3,16,16",
                         "--platform", "a72", "--ram-budget", "80%", "--json")
    assert code == EXIT_OK, err
    assert json.loads(out)["status"] in {"optimal", "feasible"}


def test_factory_without_input_shape_names_the_flag(capsys):
    code, _, err = run(capsys, "solve", "--model", "host.graph.examples:small_cnn", "--platform", "a72",
                       "--ram-budget", "1MB")
    assert code == EXIT_USAGE and "--input-shape" in err


@pytest.mark.parametrize("text,expected", [("3000000", 3e6), ("3MB", 3e6), ("2KiB", 2048), ("50%", 500.0)])
def test_ram_budget_parsing(text, expected):
    assert parse_ram_budget(text, no_remat_peak_bytes=1000) == pytest.approx(expected)


def test_malformed_ram_budget_is_explained():
    from host.cli import CliError

    with pytest.raises(CliError, match="not a size"):
        parse_ram_budget("lots")


def test_models_and_platforms_list(capsys):
    assert run(capsys, "models")[0] == EXIT_OK
    code, out, _ = run(capsys, "platforms")
    assert code == EXIT_OK and "a72nocache" in out and "m0" in out


def test_pareto_table_json_and_plot(capsys, tmp_path):
    code, out, _ = run(capsys, "pareto", "--model", "poet2022:linear", "--platform", "a72", "--points", "3",
                       "--json", "--plot", str(tmp_path))
    assert code == EXIT_OK
    rows = json.loads(out)
    methods = {row["method"] for row in rows}
    assert {"poet", "poet remat-only", "poet paging-only", "checkpoint √n (Chen)"} <= methods
    for budget in {row["ram_budget_bytes"] for row in rows}:
        at_budget = {row["method"]: row for row in rows if row["ram_budget_bytes"] == budget}
        poet = at_budget["poet"]["energy_j"]
        for method, row in at_budget.items():
            if row["status"] in ("optimal", "feasible") and row["energy_j"] is not None:
                assert poet <= row["energy_j"] * (1 + 1e-3), method  # POET is never beaten (within the gap)
    assert list(tmp_path.glob("*_pareto.png"))


def test_profile_local_writes_a_loadable_profile_and_leaves_flash_clean(capsys, tmp_path):
    from host.costs import load_profile

    flash = tmp_path / "flash"
    flash.mkdir()
    out = tmp_path / "here.profile.json"
    code, stdout, err = run(capsys, "profile", "--local", "--quick", "--flash-dir", str(flash), "--out", str(out))
    assert code == EXIT_OK, err
    profile = load_profile(str(out))
    assert profile.page_in_throughput_bytes_per_s > 0 and profile.flops_per_s["default"] > 0
    assert profile.energy_source.startswith("modelled:")
    assert list(flash.iterdir()) == []
    code, stdout, err = run(capsys, "solve", "--model", "mlp", "--platform", str(out), "--ram-budget", "80%")
    assert code == EXIT_OK, err


def test_profile_local_missing_flash_dir_is_named(capsys, tmp_path):
    code, _, err = run(capsys, "profile", "--local", "--quick", "--flash-dir", str(tmp_path / "nope"))
    assert code == EXIT_USAGE and "nope" in err
