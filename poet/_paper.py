"""``solve`` with the POET paper code's signature (poet/solve.py of the ICML 2022 code), on poet-edge's solver.

The paper's model names resolve to the paper's own graphs (:mod:`host.graph.poet2022`), its platform
names to the shipped profiles of its chipsets. Where the paper returns ``None`` figures for a budget no
schedule meets, this raises :class:`InfeasibleBudgetError` naming the minimum feasible budget.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from host.graph.poet2022 import POET2022_MODELS
from host.graph.resolve import POET2022_PREFIX
from host.run.errors import InputError, SolveFailedError
from host.run.solve import DEFAULT_OPTIMIZER, SolveReport, SolveSettings, prepare_solve, run_solve
from host.run.sources import ModelSource, load_platform
from host.run.values import checked, finite_float
from host.solver.solve import DEFAULT_TIME_LIMIT_S

PAPER_MODELS: tuple[str, ...] = POET2022_MODELS
# The paper code's `solver` names (PuLP's or gurobipy's) and poet-edge's backends.
_SOLVERS = {"highs": "highs", "cbc": "cbc", "gurobi": "gurobi", "gurobipy": "gurobi", "pulp-gurobi": "gurobi",
            "pulp-cbc": "cbc"}


class InfeasibleBudgetError(InputError):
    """No schedule meets the budgets; ``minimum_ram_bytes`` is the hard floor: no schedule meets a RAM budget below
    it (the largest node's inputs and output), and with paging and recomputation allowed and no binding runtime
    budget, one meets it."""

    def __init__(self, message: str, minimum_ram_bytes: int, report: SolveReport):
        super().__init__(message)
        self.minimum_ram_bytes = minimum_ram_bytes
        self.report = report


def solve(
    model: str,
    platform: Any,
    ram_budget: Any,
    runtime_budget: float,
    paging: int = 1,
    remat: int = 1,
    mem_power_scale: float = 1.0,
    batch_size: int = 1,
    use_actual_gurobi: bool | None = None,
    solver: str | None = None,
    print_power_costs: bool = False,
    print_graph_info: bool = False,
    plot_directory: str | None = None,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    solve_threads: int | None = None,
    *,
    optimizer: str = DEFAULT_OPTIMIZER,
    mip_gap: float = 1e-3,
) -> SolveReport:
    """Solve the energy-optimal schedule of one of the paper's models on one of its platforms.

    Arguments as in the paper code (energy in joules, time in seconds, memory in bytes):

    - ``model``: a paper model name (``linear``, ``vgg16``, ``vgg16_cifar``, ``resnet18``, ``resnet18_cifar``,
      ``resnet50``, ``bert``, ``transformer``): the paper's own graph of it. (``poet2022:<name>`` works too.)
    - ``platform``: ``m0``, ``a72``, ``a72nocache``, ``m4``, ``jetsontx2`` (or any poet-edge platform or profile).
    - ``ram_budget``: bytes for activations, their gradients and paged-in buffers (or ``"3MB"``, ``"50%"``).
    - ``runtime_budget``: factor of the plain forward+backward runtime, >= 1.0 (the paper's too, despite its
      docstring's "milliseconds").
    - ``paging`` / ``remat``: 1 allows paging to flash / recomputation, 0 forbids it (default both allowed).
    - ``mem_power_scale``: factor on the platform's paging power (default 1.0).
    - ``batch_size``: the graph's batch size (default 1; ``linear``, ``bert`` and ``transformer`` ignore it,
      as in the paper).
    - ``use_actual_gurobi`` / ``solver``: the MILP backend. ``solver`` is ``highs`` (the default here: the
      paper defaults to Gurobi), ``cbc`` or ``gurobi`` (the paper's ``gurobipy``, ``pulp-gurobi`` and
      ``pulp-cbc`` are understood); ``use_actual_gurobi=True`` without ``solver`` picks Gurobi.
    - ``print_power_costs``: print each node's compute, page-in and page-out energy in joules.
    - ``print_graph_info``: print the plain runtime and the forward pass's RAM before solving.
    - ``plot_directory``: write the schedule matrices (R, S_RAM, S_SD, M_in, M_out) there as a PNG.
    - ``time_limit_s``: solver time limit in seconds (default 300; None: none, the paper's default). When
      it passes, the best schedule so far is returned with status ``feasible`` and its ``gap``.
    - ``solve_threads``: solver threads (default: the solver's choice).
    - ``optimizer``: ``sgd`` (default) or ``adamw``: its state counts in ``fixed_bytes``.
    - ``mip_gap``: relative gap that counts as optimal (default 0.001).

    Returns poet-edge's :class:`poet_edge.SolveReport`: ``status``, ``objective_j`` (the paper's total
    energy: ``compute_j`` + ``paging_j``), ``runtime_s``, ``peak_ram_bytes``, ``gap``, the ``schedule``.
    Raises :class:`InfeasibleBudgetError` (naming the minimum feasible RAM budget) when no schedule meets
    the budgets, :class:`poet_edge.SolveFailedError` when the time limit passed before any schedule was
    found, and :class:`poet_edge.InputError` on a bad argument.
    """
    graph_name = _paper_model(model)
    backend = _backend(solver, use_actual_gurobi)
    scale = checked("mem_power_scale", finite_float, mem_power_scale, above=0.0)
    profile = load_platform(platform)
    if scale != 1.0:
        profile = dataclasses.replace(profile, memory_power_w=profile.memory_power_w * scale)
    if time_limit_s is not None and not isinstance(time_limit_s, (int, float)):
        raise InputError(f"time_limit_s: expected seconds as a number, got {type(time_limit_s).__name__}")
    if time_limit_s is not None and not math.isfinite(time_limit_s) or (time_limit_s or 0) >= 1e30:
        time_limit_s = None  # the paper's default 1e100: no limit
    settings = SolveSettings(runtime_budget=runtime_budget, time_limit_s=time_limit_s, solve_threads=solve_threads,
                             solver=backend, mip_gap=mip_gap, paging=bool(paging), remat=bool(remat))
    source = ModelSource(graph_name, batch_size=batch_size)
    problem = prepare_solve(source, profile, ram_budget, settings, optimizer=optimizer)
    priced = problem.priced
    if print_graph_info:
        forward_bytes = sum(node.output_bytes for node in problem.graph.forward_nodes())
        print(f"Total runtime of graph (forward + backward) = {priced.base_runtime_s * 1e3} milliseconds")
        print(f"Total RAM consumption of forward pass = {forward_bytes} bytes")
    if print_power_costs:
        print("CPU power cost:", priced.compute_j)
        print("Page-in power cost:", priced.page_in_j)
        print("Page-out power cost:", priced.page_out_j)
    report = run_solve(problem)
    if report.status == "infeasible":
        raise _infeasible(report, problem.ram_budget_bytes, settings)
    if report.schedule is None:
        raise SolveFailedError(report.status, report.message)
    if plot_directory is not None and report.plan is not None:
        from host.plots import plot_schedule_matrices

        directory = Path(plot_directory)
        directory.mkdir(parents=True, exist_ok=True)
        plot_schedule_matrices(report.plan, directory / f"{model}_{profile.name}_matrices.png",
                               f"{graph_name} on {profile.name}: schedule matrices", schedule=report.schedule)
    return report


def _paper_model(model: Any) -> str:
    if isinstance(model, str) and model in PAPER_MODELS:
        return POET2022_PREFIX + model
    if isinstance(model, str) and model.startswith(POET2022_PREFIX):
        return model
    raise InputError(f"model: {model!r} is not one of the POET paper's models ({', '.join(PAPER_MODELS)}); "
                     "`from poet import solve` answers for the paper's graphs. For a zoo model traced from PyTorch, "
                     "module:factory or your own nn.Module, use `from poet_edge import solve`")


def _backend(solver: str | None, use_actual_gurobi: bool | None) -> str:
    if solver is None:
        return "gurobi" if use_actual_gurobi else "highs"
    if solver not in _SOLVERS:
        raise InputError(f"solver: {solver!r} is not one of {', '.join(_SOLVERS)}")
    return _SOLVERS[solver]


def _infeasible(report: SolveReport, budget_bytes: float, settings: SolveSettings) -> InfeasibleBudgetError:
    floor = report.minimum_ram_bytes
    if budget_bytes < floor:
        message = (f"ram_budget {budget_bytes:.0f} bytes is below the minimum feasible budget of {report.model} on "
                   f"{report.platform}: {floor} bytes (the largest node's inputs and output together, which any "
                   f"schedule holds at once); raise ram_budget to at least {floor}")
    else:
        message = (f"no schedule of {report.model} on {report.platform} meets ram_budget {budget_bytes:.0f} bytes "
                   f"and runtime_budget {settings.runtime_budget:g} ({floor} bytes is the hard floor, which paging and "
                   f"recomputation together meet without a binding runtime budget; paging={settings.paging}, "
                   f"remat={settings.remat}): {report.message}")
    return InfeasibleBudgetError(message, floor, report)
