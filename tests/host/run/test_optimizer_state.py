"""The optimizer's state in the plan: counted from each optimizer's rule, equal to what torch allocates."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from device_agent.executor import OPTIMIZERS, make_optimizer
from device_agent.optimizers import OPTIMIZER_STATE
from host.fleet import service
from host.run.sources import ModelSource
from poet_edge import train
from tests.host.cli.helpers import one_json_object, poet


class PartlyFrozen(nn.Module):
    """A frozen conv stem (weights and BatchNorm), a trainable head, and a layer whose bias alone trains."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.mid = nn.Linear(8 * 6 * 6, 32)
        self.head = nn.Linear(32, 5)
        for parameter in self.stem.parameters():
            parameter.requires_grad_(False)
        self.mid.weight.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.stem(x).flatten(1))))


def _batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(4, 3, 6, 6, generator=generator), torch.randint(0, 5, (4,), generator=generator)


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    net = PartlyFrozen()
    x, y = _batch()
    return net, ModelSource(net, inputs=x, labels=y).resolve().graph


def _real_state_bytes(net: nn.Module, optimizer_name: str) -> int:
    """Sum of nbytes of every tensor the optimizer holds after one step of plain training."""
    net = copy.deepcopy(net)
    optimizer = make_optimizer(optimizer_name, net.parameters())
    x, y = _batch()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


def test_the_rule_covers_exactly_the_optimizers_the_board_builds():
    assert set(OPTIMIZER_STATE) == set(OPTIMIZERS)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_predicted_state_equals_the_real_optimizers_state_after_a_step(traced, optimizer):
    net, graph = traced
    trainable = [p for p in net.parameters() if p.requires_grad]
    assert graph.param_tensors == len(trainable) == 3  # mid.bias, head.weight, head.bias: frozen ones get no state
    planned = graph.with_optimizer(optimizer)
    real = _real_state_bytes(net, optimizer)
    assert real > 0 and planned.optimizer_state_bytes == real
    assert planned.fixed_bytes == graph.fixed_bytes + real
    assert planned.fixed_breakdown_bytes()["optimizer_state"] == real and planned.optimizer == optimizer
    assert graph.optimizer_state_bytes == 0  # the traced graph itself is left as it was


def test_adamw_holds_two_moments_and_a_step_where_sgd_holds_one_momentum_buffer(traced):
    _, graph = traced
    sgd, adamw = (graph.with_optimizer(name).optimizer_state_bytes for name in ("sgd", "adamw"))
    assert sgd == graph.param_grad_bytes
    assert adamw == 2 * graph.param_grad_bytes + 4 * graph.param_tensors


def test_train_reports_the_fixed_bytes_of_its_optimizer(traced, tmp_path):
    net, graph = traced
    x, y = _batch()
    report = train(copy.deepcopy(net), "a72", "100%", inputs=x, labels=y, steps=1, optimizer="adamw",
                   flash_dir=tmp_path)
    assert report.fixed_bytes == graph.with_optimizer("adamw").fixed_bytes > graph.fixed_bytes


def test_the_fleets_auto_budget_takes_the_optimizers_state_off_the_board(traced):
    _, graph = traced
    facts = {"memory_limit_bytes": 512 << 20, "runtime_rss_bytes": 100 << 20}
    budgets = {name: service.auto_budget_bytes(facts, graph, name) for name in OPTIMIZERS}
    for name, budget in budgets.items():
        expected = (512 << 20) - graph.with_optimizer(name).fixed_bytes - (100 << 20) - service.AUTO_MARGIN_BYTES
        assert budget == expected
    assert budgets["sgd"] - budgets["adamw"] == graph.param_grad_bytes + 4 * graph.param_tensors
    assert f"fixed {graph.with_optimizer('adamw').fixed_bytes}" in service.auto_budget_text(facts, graph, "adamw")


# ------------------------------------------------------------------------------------------ the CLI, as users run it
MLP_PARAM_BYTES = (64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10) * 4  # the zoo's mlp, 6 parameter tensors


@pytest.mark.slow  # a CLI subprocess or a solve of several seconds: the fast suite stays under 5 minutes
def test_poet_solve_counts_the_optimizers_state_in_its_fixed_bytes():
    common = ("solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "100%", "--json")
    sgd = one_json_object(poet(*common).stdout)
    adamw = one_json_object(poet(*common, "--optimizer", "adamw").stdout)
    assert (sgd["optimizer"], adamw["optimizer"]) == ("sgd", "adamw")  # sgd is the default, as in `poet train`
    assert sgd["fixed_breakdown_bytes"]["optimizer_state"] == MLP_PARAM_BYTES
    assert adamw["fixed_breakdown_bytes"]["optimizer_state"] == 2 * MLP_PARAM_BYTES + 6 * 4
    assert adamw["fixed_bytes"] - sgd["fixed_bytes"] == MLP_PARAM_BYTES + 6 * 4
    assert sgd["fixed_bytes"] == sum(sgd["fixed_breakdown_bytes"].values())
    assert adamw["objective_j"] == sgd["objective_j"]  # the schedule itself does not depend on it


@pytest.mark.slow  # two CLI runs (7 s): the fast suite stays under 5 minutes
def test_poet_solve_prints_the_breakdown_and_refuses_an_unknown_optimizer():
    text = poet("solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "100%", "--optimizer", "adamw")
    assert text.returncode == 0 and "adamw state 209.00 kB" in text.stdout, text.stdout
    refused = poet("solve", "--model", "mlp", "--platform", "m4", "--ram-budget", "100%", "--optimizer", "lion")
    assert refused.returncode == 2 and "--optimizer" in refused.stderr and "adamw" in refused.stderr


@pytest.mark.slow  # a CLI subprocess or a solve of several seconds: the fast suite stays under 5 minutes
def test_poet_pareto_takes_the_optimizer():
    adamw = one_json_object(poet("pareto", "--model", "mlp", "--platform", "m4", "--points", "2",
                                 "--optimizer", "adamw", "--json").stdout)
    assert adamw["optimizer"] == "adamw" and adamw["fixed_breakdown_bytes"]["optimizer_state"] == 2 * MLP_PARAM_BYTES + 24
    assert adamw["fixed_bytes"] == sum(adamw["fixed_breakdown_bytes"].values())
