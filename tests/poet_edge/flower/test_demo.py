"""python -m poet_edge.flower.demo: a real Flower deployment on loopback, SecAgg+ on, POET against plain."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tomllib

from poet_edge.flower.demo import main, max_rel_diff, node_budgets
from poet_edge.flower.deployment import write_app


def test_node_budgets_differ_and_lie_between_the_floor_and_the_peak():
    for nodes in (2, 3, 5):
        budgets = node_budgets(nodes, 49152, 65536)
        assert len(set(budgets)) == nodes
        assert all(49152 < b < 65536 for b in budgets)


def test_the_parameter_difference_is_per_tensor_relative():
    a = {"w": np.array([1.0, 2.0]), "b": np.array([0.0])}
    assert max_rel_diff(a, a) == 0.0
    assert max_rel_diff({**a, "w": np.array([1.0, 2.002])}, a) == pytest.approx(0.001)
    assert max_rel_diff({**a, "b": np.array([1e-9])}, a) == float("inf")  # plain left it at zero, POET did not


def test_the_app_directory_names_poet_edges_components_and_every_run_config_key(tmp_path):
    app = write_app(tmp_path / "app", {"num-rounds": 7, "poet-model": 'a"b'})
    project = tomllib.loads((app / "pyproject.toml").read_text())
    assert project["tool"]["flwr"]["app"]["components"] == {"serverapp": "host.flower.app:app",
                                                           "clientapp": "device_agent.flower.client:app"}
    config = project["tool"]["flwr"]["app"]["config"]
    assert config["num-rounds"] == 7 and config["poet-model"] == 'a"b' and config["poet-secagg"] is True
    assert "poet-plain" in config and "poet-report" in config  # `flwr run --run-config` overrides only these


def test_secure_aggregation_needs_two_nodes():
    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "1", "--nodes", "1", "--dir", "unused"])
    assert exit_info.value.code == 2


@pytest.mark.slow  # a SuperLink, two SuperNodes, one round of POET and one of plain training (about 5 minutes here)
def test_the_demo_trains_every_node_under_a_schedule_and_matches_plain_training(tmp_path):
    run = subprocess.run([sys.executable, "-m", "poet_edge.flower.demo", "--rounds", "1", "--nodes", "2", "--steps", "2",
                          "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    assert result["ok"] and result["secure_aggregation"] is True
    assert result["max_rel_param_diff_vs_plain"] <= 1e-5
    [entry] = result["rounds"]
    nodes = entry["nodes"]
    assert len(nodes) == 2 and len({n["node"] for n in nodes}) == 2
    assert len({n["ram_budget_bytes"] for n in nodes}) == 2  # each node its own budget
    for node in nodes:
        assert node["recomputes"] + node["page_outs"] > 0
        assert result["floor_bytes"] <= node["peak_ram_bytes"] <= node["ram_budget_bytes"] < result["no_remat_peak_bytes"]
        assert node["energy_j"] > 0 and node["energy_source"] and node["plain"]["energy_j"] > 0
        assert node["loss"] == pytest.approx(node["plain"]["loss"], rel=1e-6)
    assert result["refused"] == []
