"""The time limit is a wall-clock promise for the whole solve: every phase checks one deadline."""

import time

import pytest
import torch
from torch import nn

from host.costs import load_profile, price_graph
from host.run.sources import ModelSource
from host.solver.backends.highs import waiting_worker_pids
from host.solver.baseline_pricing import cheapest_feasible, price_baselines
from host.solver.deadline import Deadline, DeadlineExpired
from host.solver.poet_milp import FormulationOptions, PoetFormulation
from host.solver.policy_search import greedy_policy_plan
from host.solver.solve import SolveOptions, minimum_ram_bytes, no_remat_peak_bytes, solve_schedule
from host.solver.validator import validate_schedule

from .graphs import price_simply, random_training_graph

LIMIT_S = 5.0
# Beyond the limit's 10%: freeing the model abandoned at the deadline (0.2 s), one lowering and replay of
# the answer (0.05 s) and the granularity of the deadline checks (one stage of model building, one greedy
# move), measured on an idle core, with room for a 2-core machine shared by several test runs (load
# average 6 while these tests ran, where one run took 6.3 s before building stopped earlier). Measured
# here: 4.7-4.9 s; the code before this test took 40 s.
SLACK_S = 1.0


@pytest.fixture(scope="module")
def deep_mlp_on_a72():
    """A traced 100-layer MLP (405 nodes): without a deadline in every phase its solve takes about 40 s."""
    torch.manual_seed(0)
    layers = []
    for _ in range(100):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(64, 10))
    inputs, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))
    graph = ModelSource(net, inputs=inputs, labels=labels).resolve().graph
    return price_graph(graph, load_profile("a72"))


@pytest.mark.slow  # ~20 s: tracing a 100-layer model, then a 5 s solve
def test_a_traced_solve_returns_within_its_time_limit(deep_mlp_on_a72):
    priced = deep_mlp_on_a72
    budget = 0.3 * no_remat_peak_bytes(priced)
    started = time.perf_counter()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.2, time_limit_s=LIMIT_S))
    wall_s = time.perf_counter() - started
    assert wall_s <= LIMIT_S * 1.1 + SLACK_S, (wall_s, result.message)
    assert result.solve_s <= wall_s
    # the best validated schedule so far, with its proven gap, never above the best baseline priced
    assert result.status in ("optimal", "feasible") and result.gap is not None
    replayed = validate_schedule(result.schedule, priced)
    assert replayed.peak_ram_bytes <= budget
    assert replayed.energy_j == pytest.approx(result.objective_j, rel=1e-12)
    assert result.objective_j <= cheapest_feasible(result.baselines)[0].energy_j
    if result.schedule.solve.solver == "baseline":  # the message names where the schedule came from
        assert f"the {result.schedule.solve.formulation} schedule" in result.message, result.message


def test_every_phase_stops_at_an_expired_deadline():
    priced = price_simply(random_training_graph(11, 9))
    budget = max(minimum_ram_bytes(priced) * 1.2, 0.6 * no_remat_peak_bytes(priced))
    expired = Deadline(0.0)
    assert greedy_policy_plan(priced, budget, None) is not None
    assert greedy_policy_plan(priced, budget, None, deadline=expired) is None
    with pytest.raises(DeadlineExpired, match="building the model"):
        PoetFormulation(priced, FormulationOptions(budget, None), expired)


def test_the_warm_start_goes_on_past_its_share_until_a_baseline_fits():
    """A loaded machine can spend the warm start's share of the limit before any baseline fits (a 5 s solve of a
    405-node MLP returned no schedule on a busy CI machine): until one fits, the solve's own deadline is checked,
    then the warm start's again."""
    priced = price_simply(random_training_graph(11, 9))
    budget = max(minimum_ram_bytes(priced) * 1.2, 0.6 * no_remat_peak_bytes(priced))
    runtime_s = 2 * priced.base_runtime_s
    expired = Deadline(0.0)
    assert price_baselines(priced, budget, runtime_s, deadline=expired) == []
    found = price_baselines(priced, budget, runtime_s, deadline=expired, until_one_fits=Deadline(None))
    assert [r.feasible for r in found].count(True) == 1 and found[-1].feasible  # it stops at the first that fits
    assert price_baselines(priced, budget, runtime_s, deadline=expired, until_one_fits=expired) == []


def test_a_limit_too_short_for_anything_says_so():
    priced = price_simply(random_training_graph(5, 12), page_j_per_byte=1e-3)
    budget = max(minimum_ram_bytes(priced), 0.5 * no_remat_peak_bytes(priced))
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, time_limit_s=1e-9))
    assert result.status == "timeout" and result.schedule is None
    assert "raise --time-limit" in result.message


@pytest.mark.slow  # ~60 s: a solve held to its limit
def test_a_solver_that_stops_answering_is_stopped_at_the_limit_with_its_incumbent():
    """HiGHS cannot be cancelled everywhere (model loading, presolve, its root node's analytic centre: 78 s on
    MobileNetV2, over 100 s on resnet50, whatever the limit). Here its worker process is frozen (SIGSTOP) once it
    has sent a schedule: the solve still returns by its limit, with that schedule, validated, and no worker is
    left behind."""
    import os
    import signal

    import psutil

    priced = price_graph(ModelSource("poet2022:resnet18_cifar").resolve().graph, load_profile("m4"))
    budget = 737719
    # The MILP starts about 9 s in and reports its first schedule about 6 s later (alone); in loaded full runs limits of
    # 25 s and 40 s ended first (the test failed with no schedule reported), so the limit leaves room for three times that.
    limit_s = 60.0
    frozen = []

    def freeze_on_first_incumbent(report):
        if frozen or report.incumbent_j is None:
            return
        workers = [p for p in psutil.Process().children()
                   if "highs_worker" in " ".join(p.cmdline()) and p.pid not in waiting_worker_pids()]
        assert len(workers) == 1, workers
        os.kill(workers[0].pid, signal.SIGSTOP)
        frozen.append(workers[0])

    started = time.perf_counter()
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.5, time_limit_s=limit_s,
                                                 shortcut_non_binding=False), progress=freeze_on_first_incumbent)
    wall_s = time.perf_counter() - started
    assert frozen, "the solve ended before HiGHS reported a schedule"
    assert wall_s <= limit_s * 1.1 + SLACK_S, (wall_s, result.message)
    assert not frozen[0].is_running() or frozen[0].status() == psutil.STATUS_ZOMBIE  # killed, not left frozen
    assert result.status == "feasible" and result.schedule is not None, result.message
    replayed = validate_schedule(result.schedule, priced)
    assert replayed.peak_ram_bytes <= budget
    assert replayed.energy_j == pytest.approx(result.objective_j, rel=1e-12)


def test_the_second_covering_problem_never_gets_time_past_the_limit():
    """Its time is at least 1.5 times the first's; where the baselines ran until one fitted, near the limit, that
    least would have run past it (1.5 times 20 s beyond a 120 s limit): it is capped by what is left, and at the limit
    nothing is left for it."""
    from host.solver.solve import _stronger_bound_time_s

    options = SolveOptions(ram_budget_bytes=1.0, time_limit_s=120.0)
    reserve_s = 1.0
    fresh = _stronger_bound_time_s(options, 20.0, time.perf_counter() - 40.0, reserve_s)
    assert fresh == pytest.approx(0.75 * 120 - reserve_s - 40.0, abs=0.1)  # until the ejection moves' share
    late = _stronger_bound_time_s(options, 20.0, time.perf_counter() - 100.0, reserve_s)
    assert late == pytest.approx(120 - reserve_s - 100.0, abs=0.1)  # not 1.5 * 20 s
    assert _stronger_bound_time_s(options, 20.0, time.perf_counter() - 119.5, reserve_s) <= 0
    unlimited = SolveOptions(ram_budget_bytes=1.0, time_limit_s=None)
    assert _stronger_bound_time_s(unlimited, 20.0, time.perf_counter() - 1000.0, reserve_s) == 30.0
