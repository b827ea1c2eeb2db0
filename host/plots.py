"""PNG plots: the schedule matrices, RAM over the schedule against the budget, and Pareto curves.

The matrices use the paper's notation (POET, ICML 2022): rows are stages t (stage t computes node t, plus any
recomputation), columns are nodes i; R = computed, S_RAM = kept in RAM, S_SD = kept on flash, M_in / M_out =
paged in / out. Bytes are shown in decimal units (kB = 10^3 bytes) picked by magnitude.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from host.solver.stage_plan import StagePlan  # noqa: E402
from host.units import byte_unit, format_bytes  # noqa: E402

if TYPE_CHECKING:
    from device_agent.schedule import Schedule

__all__ = [
    "NOTATION", "SOLVED", "backward_start_instruction", "backward_start_node", "byte_unit", "pareto_steps",
    "plot_pareto", "plot_ram_timeline", "plot_schedule_matrices", "unplotted_methods", "unsolved_statuses",
]  # fmt: skip

SOLVED = ("optimal", "feasible")  # row statuses that carry a schedule within the budgets
NOTATION = (
    "rows: stage t (stage t computes node t, plus recomputations); columns: node i.  "
    "R[t,i]: node i is computed in stage t (a recompute when i < t).  S_RAM[t,i]: i's output is kept in RAM "
    "into stage t.\nS_SD[t,i]: i's output is kept on flash (SD) into stage t.  "
    "M_out[t,i]: i is paged out (written to flash) in stage t.  M_in[t,i]: i is paged in (read back) in stage t."
)
_PAGE_OUT_COLOR = "tab:blue"
_PAGE_IN_COLOR = "tab:orange"
_RECOMPUTE_COLOR = "tab:red"
_BOUNDARY_STYLE = {"color": "tab:green", "linestyle": ":", "linewidth": 1.2}


def backward_start_node(schedule: Schedule) -> int | None:
    """Index of the first backward node (nodes are in topological order: fwd, loss, bwd), or None."""
    return next((i for i, node in enumerate(schedule.nodes) if node.kind == "bwd"), None)


def backward_start_instruction(schedule: Schedule) -> int | None:
    """Index of the first instruction that computes a backward node, or None."""
    kinds = [node.kind for node in schedule.nodes]
    return next(
        (i for i, ins in enumerate(schedule.instructions) if ins.kind == "compute" and kinds[ins.node] == "bwd"),
        None,
    )


# ----------------------------------------------------------------------------- schedule matrices
def plot_schedule_matrices(plan: StagePlan, path: Path, title: str, *, schedule: Schedule | None = None) -> Path:
    """R, S_RAM, S_SD and M_in/M_out as in the paper (rows: stages t, columns: nodes i).

    With ``schedule`` (the lowered plan) the forward/backward boundary is drawn across every panel.
    """
    size = plan.size
    boundary = backward_start_node(schedule) if schedule is not None else None
    figure, axes = plt.subplots(1, 4, figsize=(17, 5.6))
    own_stage = np.eye(size, dtype=bool) & plan.recompute
    recomputed = plan.recompute & ~own_stage
    marker_size = max(6.0, min(40.0, 4000.0 / size))
    _matrix(axes[0], own_stage.astype(int), ListedColormap(["white", "0.55"]), 1)
    stages, nodes = np.nonzero(recomputed)
    axes[0].scatter(nodes, stages, s=marker_size, c=_RECOMPUTE_COLOR, marker="x", label=f"recompute: {len(nodes)}")
    axes[0].set_title("R: compute / recompute")
    axes[0].legend(
        handles=[Patch(color="0.55", label="computed in its own stage"), *axes[0].get_legend_handles_labels()[0]],
        loc="upper right", fontsize=8,
    )  # fmt: skip
    _matrix(axes[1], plan.keep_ram.astype(int), ListedColormap(["white", "black"]), 1)
    axes[1].set_title("S_RAM: kept in RAM")
    _matrix(axes[2], plan.keep_flash.astype(int), ListedColormap(["white", "tab:purple"]), 1)
    axes[2].set_title("S_SD: kept on flash")
    _matrix(axes[3], np.zeros((size, size), dtype=int), ListedColormap(["white"]), 1)
    for matrix, color, marker, label in (
        (plan.page_out, _PAGE_OUT_COLOR, "v", "M_out: page-out (write to flash)"),
        (plan.page_in, _PAGE_IN_COLOR, "^", "M_in: page-in (read back)"),
    ):
        stages, nodes = np.nonzero(matrix)
        axes[3].scatter(nodes, stages, s=marker_size, c=color, marker=marker, label=f"{label}: {len(nodes)}")
    axes[3].set_title("M_in / M_out: paging")
    axes[3].legend(loc="upper right", fontsize=8)
    for axis in axes:
        if boundary is not None:
            axis.axvline(boundary - 0.5, **_BOUNDARY_STYLE)
            axis.axhline(boundary - 0.5, **_BOUNDARY_STYLE)
            regions = axis.secondary_xaxis("top")
            regions.set_xticks([(boundary - 1) / 2, (boundary + size - 1) / 2], labels=["forward", "backward"])
            regions.tick_params(length=0, labelsize=8, labelcolor="tab:green")
        axis.set_xlabel("node i")
        axis.set_ylabel("stage t")
    figure.suptitle(title + ("" if boundary is None else "   (dotted green: forward | backward boundary)"))
    figure.text(0.5, 0.01, NOTATION, ha="center", va="bottom", fontsize=8.5, wrap=True)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _matrix(axis, codes: np.ndarray, cmap: ListedColormap, top: int) -> None:
    axis.imshow(codes, cmap=cmap, vmin=0, vmax=top, interpolation="nearest")
    axis.set_xlim(-0.5, codes.shape[1] - 0.5)
    axis.set_ylim(codes.shape[0] - 0.5, -0.5)


# ----------------------------------------------------------------------------- RAM over the schedule
def plot_ram_timeline(
    timeline_bytes: Sequence[int], ram_budget_bytes: float, path: Path, title: str, *, schedule: Schedule | None = None
) -> Path:
    """Controlled RAM after each instruction against the budget.

    With ``schedule`` the forward/backward boundary is drawn and the fixed bytes (weights, weight gradients,
    optimizer state: outside the budget) are stated.
    """
    peak = max(timeline_bytes, default=0)
    unit, scale = byte_unit(max(peak, ram_budget_bytes))
    figure, axis = plt.subplots(figsize=(10, 4.6))
    steps = np.arange(len(timeline_bytes))
    axis.step(steps, np.asarray(timeline_bytes, dtype=float) / scale, where="post", label="controlled RAM")
    axis.axhline(ram_budget_bytes / scale, color="tab:red", linestyle="--",
                 label=f"RAM budget {format_bytes(ram_budget_bytes, exact=False)}")  # fmt: skip
    axis.axhline(peak / scale, color="tab:blue", linestyle=":", linewidth=0.8, label=f"peak {format_bytes(peak, exact=False)}")
    axis.set_ylim(0, 1.3 * max(peak, ram_budget_bytes, 1) / scale)  # room above the budget line for notes
    axis.set_xlim(0, max(len(timeline_bytes) - 1, 1))
    top = axis.get_ylim()[1]
    if schedule is not None:
        boundary = backward_start_instruction(schedule)
        if boundary is not None:
            axis.axvline(boundary, **_BOUNDARY_STYLE, label="forward | backward")
            axis.text(boundary, 0.98 * top, "← forward ", ha="right", va="top", color="tab:green", fontsize=9)
            axis.text(boundary, 0.98 * top, " backward →", ha="left", va="top", color="tab:green", fontsize=9)
        axis.text(
            0.01 * axis.get_xlim()[1], 0.98 * top,
            f"fixed bytes, outside the budget: {format_bytes(schedule.fixed_bytes, exact=False)}\n(weights, weight gradients, optimizer state, batch, statistics)",
            ha="left", va="top", fontsize=8.5, bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.7"},
        )  # fmt: skip
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8.5, ncol=4, frameon=False)
    axis.set_xlabel("instruction")
    axis.set_ylabel(f"controlled RAM ({unit})")
    axis.set_title(title)
    axis.grid(alpha=0.25)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------- Pareto curves
def pareto_steps(rows: Sequence[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Per method (in table order) its solved points as (budgets ascending, energies); methods without any omitted.

    Drawn as steps (``steps-post``): a schedule found at one budget also fits every larger budget, so the
    energy holds until the next budget swept, rather than sloping between points nobody solved.
    """
    steps: dict[str, tuple[list[float], list[float]]] = {}
    for method in dict.fromkeys(row["method"] for row in rows):
        points = sorted(
            (float(row["ram_budget_bytes"]), float(row["energy_j"]))
            for row in rows
            if row["method"] == method and row["status"] in SOLVED and row["energy_j"] is not None
        )
        if points:
            steps[method] = ([x for x, _ in points], [y for _, y in points])
    return steps


def unsolved_statuses(rows: Sequence[dict], method: str) -> str:
    """Why ``method`` has no point at some budgets: its other statuses and how often (``"over RAM ×3"``)."""
    counts = Counter(
        row["status"]
        for row in rows
        if row["method"] == method and (row["status"] not in SOLVED or row["energy_j"] is None)
    )
    return ", ".join(f"{status} ×{count}" for status, count in counts.items())


def unplotted_methods(rows: Sequence[dict]) -> dict[str, str]:
    """Methods with no solved point at any budget, each with its statuses (see :func:`unsolved_statuses`)."""
    plotted = pareto_steps(rows)
    return {
        method: unsolved_statuses(rows, method)
        for method in dict.fromkeys(row["method"] for row in rows)
        if method not in plotted
    }


def _pareto_label(rows: Sequence[dict], method: str, solved: int, budgets: int) -> str:
    missing = unsolved_statuses(rows, method)
    return f"{method} ({solved}/{budgets} budgets" + (f"; {missing})" if missing else ")")


def plot_pareto(rows: list[dict], path: Path, title: str) -> Path:
    """Energy against RAM budget for each method in ``rows`` ({method, ram_budget_bytes, status, energy_j}).

    The legend says at how many budgets each method has a schedule and why not at the others; methods without
    any are listed under the plot. Dotted lines mark the budgets swept. Where methods coincide, the earlier one
    is drawn wider underneath, and markers are hollow so that stacked ones stay visible.
    """
    steps = pareto_steps(rows)
    missing = unplotted_methods(rows)
    budgets = sorted({float(row["ram_budget_bytes"]) for row in rows})
    unit, scale = byte_unit(max(budgets, default=0))
    figure, axis = plt.subplots(figsize=(10.5, 5))
    markers = "osD^v<>p"
    count = max(len(steps), 1)
    for number, (method, (xs, ys)) in enumerate(steps.items()):
        axis.plot(
            np.asarray(xs) / scale, ys, drawstyle="steps-post", marker=markers[number % len(markers)],
            linewidth=1.2 + 2.4 * (count - 1 - number) / count, markersize=13 - 7 * number / count,
            markerfacecolor="none", markeredgewidth=1.6, alpha=0.9, label=_pareto_label(rows, method, len(xs), len(budgets)),
        )  # fmt: skip
    for budget in budgets:
        axis.axvline(budget / scale, color="0.7", linestyle=":", linewidth=0.8, zorder=0)
    axis.set_xlabel(f"RAM budget ({unit}; dotted: budgets swept)")
    axis.set_ylabel("energy per step (J)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8.5)
    if missing:
        note = "not shown, no schedule within these budgets: " + "; ".join(f"{m} ({r})" for m, r in missing.items())
        figure.text(0.01, 0.01, note, ha="left", va="bottom", fontsize=8.5, wrap=True)
    figure.tight_layout(rect=(0, 0.07 if missing else 0, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------- calibration
def plot_node_predictions(points: Sequence[tuple[float, float, float]], path: Path, title: str) -> Path:
    """Predicted against measured seconds per node compute, before and after calibration (log-log).

    ``points``: (measured_s, predicted_before_s, predicted_after_s) per node; the diagonal is a perfect model.
    """
    figure, axis = plt.subplots(figsize=(6.4, 6))
    measured = np.array([p[0] for p in points], dtype=float)
    for column, label, marker in ((1, "before calibration", "x"), (2, "after calibration", "o")):
        predicted = np.array([p[column] for p in points], dtype=float)
        error = 100 * np.median(np.abs(predicted - measured) / measured) if len(measured) else float("nan")
        axis.scatter(measured, predicted, s=14, marker=marker, alpha=0.7,
                     label=f"{label} (median error {error:.0f}%)")
    low = max(min(float(np.min([p[i] for p in points for i in range(3)])), 1e-7), 1e-7) if points else 1e-6
    high = float(np.max([p[i] for p in points for i in range(3)])) if points else 1.0
    axis.plot([low, high], [low, high], color="0.4", linewidth=0.8, label="predicted = measured")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("measured seconds per node compute (median over steps)")
    axis.set_ylabel("predicted seconds")
    axis.set_title(title)
    axis.legend(fontsize=8.5)
    axis.grid(alpha=0.25, which="both")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_step_errors(series: dict[str, Sequence[tuple[int, float, float]]], path: Path, title: str) -> Path:
    """Per-step error of the predicted step time over a run, before and after calibration.

    ``series``: run label -> (step, error_before_pct, error_after_pct) per step (signed: predicted over measured).
    """
    figure, axis = plt.subplots(figsize=(10, 4.6))
    for index, (label, rows) in enumerate(series.items()):
        color = f"C{index % 10}"
        steps = [r[0] for r in rows]
        axis.plot(steps, [r[1] for r in rows], color=color, linestyle=":", linewidth=1)
        axis.plot(steps, [r[2] for r in rows], color=color, linewidth=1.4, label=label)
    axis.axhline(0, color="0.4", linewidth=0.8)
    axis.set_xlabel("step")
    axis.set_ylabel("predicted - measured step time (% of measured)")
    axis.set_title(f"{title}\n(dotted: before calibration; solid: after)")
    axis.legend(fontsize=7.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    axis.grid(alpha=0.25)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
