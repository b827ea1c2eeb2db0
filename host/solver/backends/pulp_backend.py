"""CBC and Gurobi through PuLP. CBC ships with PuLP; Gurobi is used when gurobipy and a licence exist."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pulp

from device_agent.errors import UserError
from host.solver.milp import MilpProblem, MilpResult, ProgressCallback, SolverProgress


class SolverUnavailableError(UserError, RuntimeError):
    """The requested backend is not installed or not licensed on this machine."""


def _to_pulp(problem: MilpProblem) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    model = pulp.LpProblem(problem.name.replace(" ", "_"), pulp.LpMinimize)
    columns = []
    for col in range(problem.num_cols):
        lb = problem.col_lb[col] if np.isfinite(problem.col_lb[col]) else None
        ub = problem.col_ub[col] if np.isfinite(problem.col_ub[col]) else None
        category = pulp.LpInteger if problem.col_integer[col] else pulp.LpContinuous
        columns.append(model.add_variable(f"x{col}", lb, ub, category))
    model += pulp.LpAffineExpression(
        [(columns[c], v) for c, v in enumerate(problem.col_cost) if v != 0.0], constant=problem.objective_offset
    )
    for row in range(problem.num_rows):
        lo, hi = problem.row_start[row], problem.row_start[row + 1]
        expression = pulp.LpAffineExpression(
            [(columns[problem.row_index[k]], problem.row_value[k]) for k in range(lo, hi)]
        )
        lb, ub = problem.row_lb[row], problem.row_ub[row]
        if np.isfinite(lb) and np.isfinite(ub) and lb == ub:
            model += expression == lb
        else:
            if np.isfinite(lb):
                model += expression >= lb
            if np.isfinite(ub):
                model += expression <= ub
    return model, columns


def _solve(
    problem: MilpProblem,
    solver: pulp.LpSolver,
    start: np.ndarray | None,
    progress: ProgressCallback | None,
    columns_model: tuple[pulp.LpProblem, list[pulp.LpVariable]],
) -> MilpResult:
    model, columns = columns_model
    if start is not None:
        for variable, value in zip(columns, start, strict=True):
            variable.setInitialValue(round(value) if variable.cat == pulp.LpInteger else value)
    started = time.perf_counter()
    model.solve(solver)
    solve_s = time.perf_counter() - started
    status = model.status
    solution_status = getattr(model, "sol_status", None)
    x = _column_values(problem, columns) if status != pulp.LpStatusInfeasible else None
    objective = problem.objective(x) if x is not None else None
    if progress is not None:
        progress(SolverProgress(solve_s, objective, None, None))
    if status == pulp.LpStatusOptimal and solution_status in (None, pulp.LpSolutionOptimal):
        if x is None:
            # CBC can say "optimal" and leave columns empty: no schedule, so never an optimum.
            return MilpResult("error", None, None, None, None, solve_s,
                              "the solver reported optimal but returned no values for the schedule's columns")
        return MilpResult("optimal", x, objective, objective, 0.0, solve_s)
    if status == pulp.LpStatusInfeasible:
        return MilpResult("infeasible", None, None, None, None, solve_s, "the model is infeasible")
    if x is not None and problem.max_violation(x) <= 1e-6:
        return MilpResult("feasible", x, objective, None, None, solve_s, "stopped before proving optimality")
    return MilpResult("timeout", None, None, None, None, solve_s, "no solution within the time limit")


def _column_values(problem: MilpProblem, columns: list[pulp.LpVariable]) -> np.ndarray | None:
    """The solution vector, or None when a column the model uses came back without a value.

    PuLP leaves out of the solver's file a column that no row and no cost mention; its value is
    None, and any value within its bounds is as good, so it takes its lower bound.
    """
    used = np.zeros(problem.num_cols, dtype=bool)
    used[np.asarray(problem.row_index, dtype=np.int64)] = True
    used |= np.asarray(problem.col_cost) != 0.0
    values = np.empty(problem.num_cols)
    for col, variable in enumerate(columns):
        value = variable.value()
        if value is None:
            if used[col]:
                return None
            value = problem.col_lb[col] if np.isfinite(problem.col_lb[col]) else 0.0
        values[col] = value
    return values


def solve_cbc(problem: MilpProblem, *, time_limit_s=None, mip_gap=1e-3, threads=None, start=None, progress=None,
              presolve=True):
    # The CBC binary bundled with PuLP 3 (PULP_CBC_CMD); PuLP 4 moves it to the pulp[cbc] extra.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = _bundled_cbc(time_limit_s, mip_gap, threads, start, presolve)
    return _solve(problem, solver, start, progress, _to_pulp(problem))


def _bundled_cbc(time_limit_s, mip_gap, threads, start, presolve=True):
    return pulp.PULP_CBC_CMD(
        msg=False, timeLimit=time_limit_s, gapRel=mip_gap, threads=threads, warmStart=start is not None,
        presolve=None if presolve else False,
    )


def solve_gurobi(problem: MilpProblem, *, time_limit_s=None, mip_gap=1e-3, threads=None, start=None, progress=None,
                 presolve=True):
    if "GUROBI" not in pulp.listSolvers(onlyAvailable=True):
        raise SolverUnavailableError(
            "Gurobi is not available on this machine: install gurobipy with a valid licence, "
            "or use --solver highs (the default) or --solver cbc"
        )
    options = {"timeLimit": time_limit_s, "gapRel": mip_gap, "warmStart": start is not None}
    if not presolve:
        options["Presolve"] = 0
    if threads is not None:
        options["Threads"] = threads
    return _solve(problem, pulp.GUROBI(msg=False, **options), start, progress, _to_pulp(problem))
