"""PNG plots: the schedule matrices, RAM over the schedule against the budget, and Pareto curves."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from host.solver.stage_plan import StagePlan  # noqa: E402


def plot_schedule_matrices(plan: StagePlan, path: Path, title: str) -> Path:
    """R, S_RAM and S_SD as in the paper (rows: stages, columns: nodes), plus paging events."""
    panels = [
        ("computed (R)", plan.recompute),
        ("kept in RAM (S_RAM)", plan.keep_ram),
        ("on flash (S_SD)", plan.keep_flash),
        ("paged in / out", plan.page_in.astype(int) - plan.page_out.astype(int)),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4))
    for axis, (label, matrix) in zip(axes, panels, strict=True):
        cmap = "coolwarm" if matrix.dtype != bool else "Greys"
        axis.imshow(matrix.astype(float), cmap=cmap, interpolation="nearest", vmin=-1 if cmap == "coolwarm" else 0)
        axis.set_title(label)
        axis.set_xlabel("node")
        axis.set_ylabel("stage")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_ram_timeline(timeline_bytes: list[int], ram_budget_bytes: float, path: Path, title: str) -> Path:
    figure, axis = plt.subplots(figsize=(9, 3.6))
    steps = np.arange(len(timeline_bytes))
    axis.step(steps, np.asarray(timeline_bytes) / 1e6, where="post", label="controlled RAM")
    axis.axhline(ram_budget_bytes / 1e6, color="tab:red", linestyle="--", label="RAM budget")
    axis.set_xlabel("instruction")
    axis.set_ylabel("MB (10^6 bytes)")
    axis.set_title(title)
    axis.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_pareto(rows: list[dict], path: Path, title: str) -> Path:
    """Energy against RAM budget for each method in ``rows`` ({method, ram_budget_bytes, energy_j})."""
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    markers = "osd^v<>"
    for number, method in enumerate(methods):
        points = sorted(
            (row["ram_budget_bytes"], row["energy_j"]) for row in rows if row["method"] == method and row["energy_j"] and row["status"] in ("optimal", "feasible")
        )
        if points:
            xs, ys = zip(*points, strict=True)
            axis.plot(np.asarray(xs) / 1e6, ys, marker=markers[number % len(markers)], label=method)
    axis.set_xlabel("RAM budget (MB, 10^6 bytes)")
    axis.set_ylabel("energy per step (J)")
    axis.set_title(title)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
