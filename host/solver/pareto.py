"""Energy against RAM budget: POET, its two ablations, and the baselines, on one priced graph."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from host.costs.priced_graph import PricedGraph
from host.solver.baselines import BaselineDoesNotFitError, checkpoint_sqrt_n_plan, keep_all_plan, paging_plan
from host.solver.solve import SolveOptions, evaluate_plan, minimum_ram_bytes, no_remat_peak_bytes, solve_schedule

POET_VARIANTS = {"poet": {}, "poet remat-only": {"paging": False}, "poet paging-only": {"remat": False}}


def pareto_budgets(priced: PricedGraph, points: int) -> list[float]:
    """``points`` budgets from the hard floor to the no-remat peak, inclusive."""
    low, high = minimum_ram_bytes(priced), no_remat_peak_bytes(priced)
    return [float(round(b)) for b in np.linspace(low, high, max(points, 2))]


def pareto_sweep(
    priced: PricedGraph,
    *,
    points: int = 6,
    runtime_factor: float = 1.2,
    solver: str = "highs",
    time_limit_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    formulation: str = "poet-edge",
) -> list[dict]:
    """POET (``formulation``: poet-edge or the paper's poet2022), its ablations and the baselines per budget."""
    runtime_budget_s = runtime_factor * priced.base_runtime_s
    baseline_plans = {"plain pytorch (keep all)": keep_all_plan(priced.graph),
                      "checkpoint √n (Chen)": checkpoint_sqrt_n_plan(priced.graph)}
    rows: list[dict] = []
    for budget in pareto_budgets(priced, points):
        for method, overrides in POET_VARIANTS.items():
            if progress:
                progress(f"{method} at {budget:,.0f} bytes")
            options = SolveOptions(ram_budget_bytes=budget, runtime_factor=runtime_factor, solver=solver,
                                   time_limit_s=time_limit_s, formulation=formulation,
                                   warm_start=formulation == "poet-edge", **overrides)
            result = solve_schedule(priced, options)
            report = result.report
            rows.append(_row(budget, method, result.status, report))
        plans = dict(baseline_plans)
        try:
            plans["page what does not fit"] = paging_plan(priced.graph, budget)
        except BaselineDoesNotFitError:
            rows.append(_row(budget, "page what does not fit", "infeasible", None))
        for method, plan in plans.items():
            report = evaluate_plan(plan, priced)
            if report.peak_ram_bytes > budget:
                status = "over RAM"
            elif report.runtime_s > runtime_budget_s * (1 + 1e-9):
                status = "over time"
            else:
                status = "feasible"
            rows.append(_row(budget, method, status, report))
    return rows


def _row(budget: float, method: str, status: str, report) -> dict:
    return {
        "ram_budget_bytes": budget,
        "method": method,
        "status": status,
        "energy_j": report.energy_j if report else None,
        "runtime_s": report.runtime_s if report else None,
        "peak_ram_bytes": report.peak_ram_bytes if report else None,
        "recomputes": report.recomputes if report else None,
        "page_ins": report.page_ins if report else None,
        "page_outs": report.page_outs if report else None,
    }
