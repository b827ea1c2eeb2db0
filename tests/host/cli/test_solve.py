"""`poet solve` and `poet pareto` as users run them: JSON fields, readable output, errors that name the fix."""

import pytest

from device_agent.serde import read_schedule_file
from host.cli.common import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE
from host.run.errors import InputError
from host.run.values import RamBudget, parse_ram_budget
from tests.host.cli.helpers import one_json_object, poet, run_main

JSON_FIELDS = {
    "status", "objective_j", "compute_j", "paging_j", "runtime_s", "runtime_budget_s", "peak_ram_bytes",
    "ram_budget_bytes", "fixed_bytes", "recomputes", "page_ins", "page_outs", "solve_s", "gap", "nodes", "edges",
    "interrupted", "formulation", "schedule_file", "plots", "baselines",
}
BASELINE_FIELDS = {"name", "status", "predicted_energy_j", "peak_ram_bytes"}


def test_readme_example_is_answered_at_once_and_proven_optimal(capfd):
    code, out, _ = run_main(capfd, "solve", "--model", "poet2022:resnet18_cifar", "--platform", "a72",
                            "--ram-budget", "3000000", "--runtime-budget", "7.6", "--json")
    assert code == EXIT_OK
    result = one_json_object(out)
    assert JSON_FIELDS <= result.keys()
    assert result["status"] == "optimal" and result["gap"] == 0.0 and result["interrupted"] is False
    assert result["solve_s"] < 1.0
    assert result["peak_ram_bytes"] <= result["ram_budget_bytes"]
    assert result["nodes"] == 133


def test_binding_solve_writes_a_valid_schedule_and_plots(capfd, tmp_path):
    schedule_file = tmp_path / "plan.json"
    # A gap below what the eviction bound proves of the best baseline (1e-7 here) sends the solve to the MILP.
    code, out, err = run_main(capfd, "solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "80%",
                              "--mip-gap", "1e-8", "--plot", str(tmp_path / "plots"), "--out", str(schedule_file))
    assert code == EXIT_OK, err
    assert "status    optimal (gap " in out and "validated" in out
    assert "Running HiGHS" not in out  # C-level chatter goes to stderr
    assert "solving" in err  # the progress display
    schedule = read_schedule_file(schedule_file)
    assert schedule.graph_name and schedule.instructions
    assert schedule.prediction.peak_ram_bytes <= schedule.ram_budget_bytes
    assert len(list((tmp_path / "plots").glob("*.png"))) == 2


def test_json_lists_the_baselines_beside_poets_answer(capfd):
    # At the default gap the greedy from the eviction cover is proven optimal here and the plain greedy is
    # skipped; at a gap below what the bound proves of it (1e-7), both run.
    code, out, err = run_main(capfd, "solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "80%",
                              "--mip-gap", "1e-8", "--json")
    assert code == EXIT_OK, err
    result = one_json_object(out)
    baselines = result["baselines"]
    names = {b["name"] for b in baselines}
    assert {"keep all (plain PyTorch)", "page what does not fit", "greedy", "greedy from the eviction cover"} <= names
    assert any(name.startswith("checkpoint_sequential(") for name in names)
    for baseline in baselines:
        assert BASELINE_FIELDS <= baseline.keys() and baseline["status"] in ("feasible", "infeasible")
    fitting = [b["predicted_energy_j"] for b in baselines if b["status"] == "feasible"]
    assert fitting and result["objective_j"] <= min(fitting)
    plain = next(b for b in baselines if b["name"] == "keep all (plain PyTorch)")
    assert plain["status"] == "infeasible" and plain["peak_ram_bytes"] > result["ram_budget_bytes"]


def test_formulation_flag_reaches_the_solver(capfd):
    code, out, err = run_main(capfd, "solve", "--model", "poet2022:linear", "--platform", "a72", "--ram-budget", "70%",
                              "--formulation", "poet2022", "--json")
    assert code == EXIT_OK, err
    result = one_json_object(out)
    assert result["formulation"] == "poet2022" and result["status"] == "optimal"


def test_unknown_model_lists_valid_names(capfd):
    code, _, err = run_main(capfd, "solve", "--model", "resnet19", "--platform", "a72", "--ram-budget", "1MB")
    assert code == EXIT_USAGE
    assert "resnet19" in err and "resnet18_cifar" in err and "poet2022:bert" in err


def test_unknown_platform_lists_valid_names(capfd):
    code, _, err = run_main(capfd, "solve", "--model", "mlp", "--platform", "pi9", "--ram-budget", "1MB")
    assert code == EXIT_USAGE
    assert "pi9" in err and "a72" in err and "jetsontx2" in err


def test_budget_below_the_minimum_states_it(capfd):
    code, out, _ = run_main(capfd, "solve", "--model", "poet2022:linear", "--platform", "a72", "--ram-budget", "100",
                            "--json")
    assert code == EXIT_INFEASIBLE
    result = one_json_object(out)
    assert result["status"] == "infeasible"
    assert str(result["minimum_ram_bytes"]) in result["message"]


def test_user_factory_with_input_shape(capfd):
    code, out, err = run_main(capfd, "solve", "--model", "host.graph.examples:small_cnn", "--input-shape", "4,3,16,16",
                              "--platform", "a72", "--ram-budget", "95%", "--json")
    assert code == EXIT_OK, err
    assert one_json_object(out)["status"] in {"optimal", "feasible"}


def test_factory_without_input_shape_names_the_flag(capfd):
    code, _, err = run_main(capfd, "solve", "--model", "host.graph.examples:small_cnn", "--platform", "a72",
                            "--ram-budget", "1MB")
    assert code == EXIT_USAGE and "--input-shape" in err


def test_a_factory_next_to_the_user_is_found_from_its_directory(tmp_path):
    (tmp_path / "mynet.py").write_text(
        "from torch import nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
    )
    result = poet("solve", "--model", "mynet:make", "--input-shape", "4,8", "--platform", "a72",
                  "--ram-budget", "100%", "--json", cwd=tmp_path)
    assert result.returncode == EXIT_OK, result.stderr
    assert one_json_object(result.stdout)["model"] == "mynet:make"


@pytest.mark.parametrize("text,expected", [("3000000", 3e6), ("3MB", 3e6), ("2KiB", 2048), ("50%", 500.0),
                                           ("1.5e3", 1500.0)])
def test_ram_budget_parsing(text, expected):
    assert parse_ram_budget(text, no_remat_peak_bytes=1000) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["lots", "nan%", "inf%", "1e400", "0", "-5%", "0%", float("nan")])
def test_malformed_ram_budgets_are_refused(text):
    with pytest.raises(ValueError):
        RamBudget.parse(text)
    with pytest.raises(InputError, match="ram_budget"):
        parse_ram_budget(text, 1000)


def test_help_states_the_default_time_limit():
    from host.solver.solve import DEFAULT_TIME_LIMIT_S

    result = poet("solve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert f"(default {DEFAULT_TIME_LIMIT_S:g} s)" in text
    assert "wall-clock limit of the whole solve" in text and "tracing the model is not counted" in text


def test_pareto_json_object_and_plot(capfd, tmp_path):
    code, out, _ = run_main(capfd, "pareto", "--model", "poet2022:linear", "--platform", "a72", "--points", "3",
                            "--json", "--plot", str(tmp_path))
    assert code == EXIT_OK
    payload = one_json_object(out)
    assert payload["model"] == "poet2022:linear" and payload["plot"].endswith("_pareto.png")
    rows = payload["rows"]
    methods = {row["method"] for row in rows}
    assert {"poet", "poet remat-only", "poet paging-only", "checkpoint √n (Chen)"} <= methods
    for budget in {row["ram_budget_bytes"] for row in rows}:
        at_budget = {row["method"]: row for row in rows if row["ram_budget_bytes"] == budget}
        poet_j = at_budget["poet"]["energy_j"]
        for method, row in at_budget.items():
            if row["status"] in ("optimal", "feasible") and row["energy_j"] is not None:
                assert poet_j <= row["energy_j"] * (1 + 1e-3), method  # POET is never beaten (within the gap)
    assert list(tmp_path.glob("*_pareto.png"))
