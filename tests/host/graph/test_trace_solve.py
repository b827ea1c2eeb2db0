"""Real models all the way through: trace, price, solve, validate."""

import pytest

from host.costs import load_profile, price_graph
from host.graph.resolve import resolve_model
from host.solver.solve import SolveOptions, minimum_ram_bytes, no_remat_peak_bytes, solve_schedule
from host.solver.validator import validate_schedule


def _solve_at(model: str, share: float, platform: str = "a72", time_limit_s: float = 20):
    """Trace and solve; the time limit keeps the suite fast (a feasible schedule is a full answer here)."""
    resolved = resolve_model(model)
    priced = price_graph(resolved.graph, load_profile(platform))
    budget = max(share * no_remat_peak_bytes(priced), minimum_ram_bytes(priced))
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=1.5, time_limit_s=time_limit_s))
    return priced, budget, result


@pytest.mark.slow  # waits for a 20 s time limit; the residual CNN keeps a traced solve in the fast suite
def test_hugging_face_bert_traces_and_solves():
    priced, budget, result = _solve_at("hf_bert", 0.6)
    assert priced.graph.size > 50
    assert result.status in {"optimal", "feasible"}
    report = validate_schedule(result.schedule, priced)
    assert report.peak_ram_bytes <= budget


@pytest.mark.slow  # ~20 s: a residual CNN traced and solved with the MILP
def test_residual_cnn_traces_and_solves_below_its_peak():
    priced, budget, result = _solve_at("resnet18_cifar", 0.7, platform="m4")
    assert result.status in {"optimal", "feasible"}
    assert result.report.peak_ram_bytes <= budget < no_remat_peak_bytes(priced)
