"""The public Python API: the paper's call, nn.Modules with their batch, and one behaviour with the CLI."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch
from torch import nn

import poet_edge
from device_agent.serde import read_schedule_file
from poet_edge import InputError, SolveReport, solve, train, verify
from tests.host.cli.helpers import one_json_object, poet

REPORT_FIELDS = ("status", "objective_j", "compute_j", "paging_j", "runtime_s", "peak_ram_bytes", "gap", "schedule")


@pytest.mark.slow  # it waits for a 20 s time limit: the fast suite stays under 5 minutes
def test_the_papers_call_returns_its_best_schedule_at_the_time_limit():
    """The paper's call, on its own graph, with a shorter time limit: the best schedule so far and its gap."""
    result = solve(model="poet2022:resnet18_cifar", platform="m4", ram_budget=737719, runtime_budget=1.5,
                   time_limit_s=20, solve_threads=1)
    assert isinstance(result, SolveReport)
    for name in REPORT_FIELDS:
        assert hasattr(result, name)
    assert result.status in ("optimal", "feasible") and not result.interrupted
    assert result.objective_j == pytest.approx(result.compute_j + result.paging_j)
    assert result.peak_ram_bytes <= 737719 and result.schedule.instructions
    assert result.runtime_s <= result.runtime_budget_s * (1 + 1e-9)


def test_a_binding_budget_as_a_share_with_its_schedule_saved(tmp_path):
    result = solve("mlp", "m4", "80%", batch_size=4)
    assert result.ok and result.status == "optimal"
    assert result.ram_budget_bytes == pytest.approx(0.8 * result.no_remat_peak_bytes)
    assert result.peak_ram_bytes <= result.ram_budget_bytes
    assert result.recomputes + result.page_outs > 0
    json.dumps(result.to_dict())  # plain values only
    result.save(tmp_path / "mlp.json")
    assert read_schedule_file(tmp_path / "mlp.json").instructions == result.schedule.instructions


def test_the_cli_reports_what_the_api_returns():
    api = solve("mlp", "m4", "80%", batch_size=4).to_dict()
    cli = one_json_object(poet("solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "80%",
                               "--batch-size", "4", "--json").stdout)
    for key in ("status", "objective_j", "peak_ram_bytes", "ram_budget_bytes", "recomputes", "page_outs", "nodes"):
        assert cli[key] == api[key], key


@pytest.mark.parametrize("keywords,named", [
    (dict(ram_budget=float("nan")), "ram_budget"),
    (dict(ram_budget="inf%"), "ram_budget"),
    (dict(runtime_budget=float("inf")), "runtime_budget"),
    (dict(runtime_budget=0.5), "runtime_budget"),
    (dict(mip_gap=-1), "mip_gap"),
    (dict(time_limit_s=0), "time_limit_s"),
    (dict(solve_threads=0), "solve_threads"),
    (dict(batch_size=0), "batch_size"),
    (dict(formulation="poet2099"), "formulation"),
])
def test_bad_keywords_are_refused_naming_them(keywords, named):
    arguments = dict(model="poet2022:linear", platform="a72", ram_budget="50%") | keywords
    with pytest.raises(InputError, match=named):
        solve(**arguments)


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def test_train_an_nn_module_in_place_under_its_schedule(tmp_path):
    torch.manual_seed(0)
    net = TinyNet()
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _batch()
    report = train(net, "a72", "85%", inputs=x, labels=y, loss_fn=nn.functional.cross_entropy, steps=2,
                   flash_dir=tmp_path, optimizer="adamw")
    assert report.mode == "schedule" and report.model == "TinyNet"
    assert report.planned["page_outs"] + report.planned["recomputes"] > 0
    assert {k: report.executed[k] for k in ("computes", "page_ins", "page_outs")} == {
        k: report.planned[k] for k in ("computes", "page_ins", "page_outs")}
    assert report.measured.peak_tracked_bytes <= report.ram_budget_bytes
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))  # trained in place
    assert list(tmp_path.iterdir()) == []


def test_verify_an_nn_module_leaves_it_untouched(tmp_path):
    torch.manual_seed(0)
    net = TinyNet()
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _batch()
    report = verify(net, "a72", "85%", inputs=x, labels=y, steps=2, flash_dir=tmp_path)
    assert report.ok and report.bitwise_equal and report.counters_match
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_an_nn_module_without_its_batch_is_refused():
    with pytest.raises(InputError, match="inputs"):
        train(TinyNet(), "a72", "85%")


@pytest.mark.parametrize("function", [poet_edge.solve, poet_edge.train, poet_edge.verify, poet_edge.pareto,
                                      poet_edge.demo])
def test_every_keyword_is_documented(function):
    doc = inspect.getdoc(function)
    for name in inspect.signature(function).parameters:
        assert re.search(rf"``{name}``", doc), f"{function.__name__}: keyword {name} is not documented"
