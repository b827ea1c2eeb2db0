"""host.flower.PoetStrategy: FedAvg wrapped, each node planned from its own facts and budget; a node below the
model's floor is reported and left out, not crashed. The slow test runs a real SuperLink and three SuperNodes on
loopback (TLS) with poet-edge's ServerApp and ClientApp."""

from __future__ import annotations

import json

import numpy as np
import pytest

from host.flower import PoetStrategy, StrategyConfigError, parse_budget


def test_budgets_are_parsed_as_poet_run_parses_them():
    assert parse_budget("auto").auto
    assert parse_budget("40%").fraction_of_peak == pytest.approx(0.4)
    assert parse_budget("3MB").budget_bytes == 3_000_000
    assert parse_budget(65536).budget_bytes == 65536
    for bad in ("banana", "150%", "-5"):
        with pytest.raises(StrategyConfigError, match="RAM budget"):
            parse_budget(bad)


def test_bad_arguments_are_refused_before_anything_is_traced(tmp_path):
    from flwr.server.strategy import FedAvg

    with pytest.raises(StrategyConfigError, match="optimizer"):
        PoetStrategy(FedAvg(), model="mlp", work_dir=tmp_path, optimizer="lion")
    with pytest.raises(StrategyConfigError, match="steps"):
        PoetStrategy(FedAvg(), model="mlp", work_dir=tmp_path, steps=0)
    assert not (tmp_path / "models").exists()


@pytest.mark.slow  # a real Flower deployment: SuperLink, four SuperNodes, one round (about 3 minutes here)
def test_each_node_is_planned_from_its_facts_and_one_below_the_floor_is_left_out(tmp_path):
    """Four SuperNodes: two planned at 80% of the peak, one at 1000 bytes (below the floor), one whose ClientApp
    cannot start (its --node-config lacks the dataset): the last two are reported and left out."""
    from device_agent.agent.demo_data import make_demo
    from device_agent.flower import archive_arrays
    from poet_edge.flower.deployment import Deployment, write_app

    budgets = ["80%", "", "1000"]  # the second takes the server's default (80% too: one solve for both)
    configs = []
    for index, budget in enumerate(budgets):
        make_demo(tmp_path / f"n{index}" / "data", "digits", shard=(index + 1, 3))
        configs.append({"poet-data-dir": str(tmp_path / f"n{index}" / "data"), "poet-dataset": "digits",
                        "poet-work-dir": str(tmp_path / f"n{index}" / "work"), "poet-platform": "a72",
                        "poet-ram-budget": budget})
    configs.append({"poet-data-dir": str(tmp_path / "n0" / "data"), "poet-work-dir": str(tmp_path / "n3" / "work")})
    report_path = tmp_path / "report.json"
    app = write_app(tmp_path / "app", {"num-rounds": 1, "poet-min-nodes": 4, "poet-secagg": False, "poet-steps": 2,
                                       "poet-batch-size": 32, "poet-ram-budget": "80%",
                                       "poet-work-dir": str(tmp_path / "server"), "poet-report": str(report_path)})
    with Deployment(tmp_path, configs, echo=False) as deployment:
        deployment.run(app, {}, timeout_s=1200)
    report = json.loads(report_path.read_text())

    assert report["failures"] == []
    assert report["mode"] == "poet" and report["solves"] == 1  # two nodes, one budget and profile: the cache
    refused, broken = sorted(report["refused"], key=lambda r: r["status"])
    assert broken["status"] == "failed" and "did not answer the facts query" in broken["detail"]
    assert refused["status"] == "does_not_fit" and refused["ram_budget_bytes"] == 1000
    assert "below the minimum" in refused["detail"] and refused["min_ram_budget_bytes"] > 1000
    [entry] = report["rounds"]
    assert len(entry["nodes"]) == 2 and {refused["node"], broken["node"]}.isdisjoint(n["node"] for n in entry["nodes"])
    for node in entry["nodes"]:
        predicted = node["predicted"]
        assert node["ram_budget_bytes"] == int(0.8 * 65536)  # mlp at batch 32: a 65,536-byte no-remat peak
        assert (node["recomputes"], node["page_ins"], node["page_outs"]) == (
            predicted["recomputes"], predicted["page_ins"], predicted["page_outs"])
        assert node["recomputes"] + node["page_outs"] > 0 and node["peak_ram_bytes"] <= node["ram_budget_bytes"]
        assert node["steps"] == 2 and node["num_examples"] == 64 and node["mode"] == "poet"
    with np.load(report_path.with_suffix(".npz")) as final:
        names, initial = archive_arrays(next((tmp_path / "server" / "models").glob("*.pt2")))
        assert list(final.files) == names
        assert any(not np.array_equal(final[n], a) for n, a in zip(names, initial, strict=True))  # it trained


@pytest.mark.slow  # a real Flower deployment: SuperLink, two SuperNodes, one round with SecAgg+ and DP (about 4 minutes)
def test_central_dp_with_client_side_clipping_and_secagg_around_poet(tmp_path):
    """PoetStrategy around Flower's DifferentialPrivacyClientSideFixedClipping(FedAvg), SecAgg+ on: each node trains
    under its schedule, its update is clipped by the mod before masking, so the global update's norm is the norm."""
    from device_agent.agent.demo_data import make_demo
    from device_agent.flower import archive_arrays
    from poet_edge.flower.deployment import Deployment, write_app

    configs = []
    for index in range(2):
        make_demo(tmp_path / f"n{index}" / "data", "digits", shard=(index + 1, 2))
        configs.append({"poet-data-dir": str(tmp_path / f"n{index}" / "data"), "poet-dataset": "digits",
                        "poet-work-dir": str(tmp_path / f"n{index}" / "work"), "poet-platform": "a72",
                        "poet-ram-budget": "80%"})
    clip = 1e-3  # far below an unclipped update of 2 SGD steps at lr 0.05 (0.06 here)
    report_path = tmp_path / "report.json"
    app = write_app(tmp_path / "app", {"num-rounds": 1, "poet-min-nodes": 2, "poet-steps": 2, "poet-batch-size": 32,
                                       "poet-dp-clipping-norm": clip, "poet-dp-noise-multiplier": 0.0,
                                       "poet-work-dir": str(tmp_path / "server"), "poet-report": str(report_path)})
    with Deployment(tmp_path, configs, echo=False) as deployment:
        deployment.run(app, {}, timeout_s=1200)
    report = json.loads(report_path.read_text())
    assert report["failures"] == [] and report["refused"] == [] and report["secure_aggregation"] is True
    assert report["dp_clipping_norm"] == clip
    [entry] = report["rounds"]
    assert len(entry["nodes"]) == 2
    assert all(n["page_outs"] + n["recomputes"] > 0 for n in entry["nodes"])  # trained under a schedule
    names, initial = archive_arrays(next((tmp_path / "server" / "models").glob("*.pt2")))
    with np.load(report_path.with_suffix(".npz")) as final:
        update = np.concatenate([(final[n].astype(np.float64) - a).ravel() for n, a in zip(names, initial, strict=True)])
    # The mean of two clipped updates: at most the norm (plus SecAgg+'s quantization, about 2e-5 over 26k weights).
    assert 0 < np.linalg.norm(update) <= clip * 1.1
