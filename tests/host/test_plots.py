"""host.plots: the PNGs are written, and the helpers pick units, steps and boundaries right."""

from __future__ import annotations

import pytest

from device_agent.schedule import Instruction, Schedule, ScheduleNode
from host.plots import (
    backward_start_instruction,
    backward_start_node,
    byte_unit,
    pareto_steps,
    plot_pareto,
    plot_ram_timeline,
    plot_schedule_matrices,
    unplotted_methods,
    unsolved_statuses,
)
from host.solver.stage_plan import StagePlan

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _schedule() -> Schedule:
    """a -> b -> loss -> bwd:b -> bwd:a; a is paged out and back in, b is recomputed."""
    kinds = ["fwd", "fwd", "loss", "bwd", "bwd"]
    nodes = [ScheduleNode(f"n{i}", kind, 1000 * (i + 1), (i - 1,) if i else ()) for i, kind in enumerate(kinds)]
    instructions = [
        Instruction("compute", 0), Instruction("compute", 1), Instruction("page_out", 0), Instruction("free", 0),
        Instruction("compute", 2), Instruction("compute", 3), Instruction("page_in", 0), Instruction("compute", 1),
        Instruction("compute", 4),
    ]  # fmt: skip
    return Schedule("tiny", "0" * 16, nodes, instructions, fixed_bytes=123_456)


def _plan() -> StagePlan:
    plan = StagePlan.empty(5)
    plan.recompute[3, 1] = True
    plan.keep_ram[1, 0] = plan.keep_ram[2, 1] = plan.keep_ram[3, 2] = True
    plan.page_out[1, 0] = True
    plan.keep_flash[2:4, 0] = True
    plan.page_in[3, 0] = True
    return plan


ROWS = [
    {"ram_budget_bytes": b, "method": m, "status": s, "energy_j": e}
    for b, m, s, e in [
        (2e6, "poet", "optimal", 3.0), (1e6, "poet", "optimal", 5.0), (3e6, "poet", "feasible", 2.0),
        (1e6, "keep all", "over RAM", 2.0), (2e6, "keep all", "over RAM", 2.0), (3e6, "keep all", "feasible", 2.0),
        (1e6, "paging", "infeasible", None), (2e6, "paging", "infeasible", None), (3e6, "paging", "over time", 9.0),
        (1e6, "chen", "timeout", None), (2e6, "chen", "over RAM", 4.0), (3e6, "chen", "over RAM", 4.0),
    ]
]  # fmt: skip


@pytest.mark.parametrize(
    ("largest", "unit", "scale"),
    [(0, "bytes", 1.0), (999, "bytes", 1.0), (1000, "kB", 1e3), (18_432, "kB", 1e3), (999_999, "kB", 1e3),
     (4_571_136, "MB", 1e6), (2.5e9, "GB", 1e9)],
)  # fmt: skip
def test_byte_unit_is_picked_by_magnitude(largest, unit, scale):
    assert byte_unit(largest) == (unit, scale)


def test_pareto_steps_keep_solved_points_in_budget_order():
    steps = pareto_steps(ROWS)
    assert list(steps) == ["poet", "keep all"]  # table order; methods without a solved point are left out
    assert steps["poet"] == ([1e6, 2e6, 3e6], [5.0, 3.0, 2.0])
    assert steps["keep all"] == ([3e6], [2.0])


def test_unplotted_methods_say_why():
    assert unplotted_methods(ROWS) == {"paging": "infeasible ×2, over time ×1", "chen": "timeout ×1, over RAM ×2"}
    assert unsolved_statuses(ROWS, "keep all") == "over RAM ×2"
    assert unsolved_statuses(ROWS, "poet") == ""


def test_backward_boundary_from_the_schedule():
    schedule = _schedule()
    assert backward_start_node(schedule) == 3
    assert backward_start_instruction(schedule) == 5
    forward_only = Schedule("f", "0" * 16, schedule.nodes[:3], schedule.instructions[:5])
    assert backward_start_node(forward_only) is None
    assert backward_start_instruction(forward_only) is None


@pytest.mark.parametrize("with_schedule", [True, False])
def test_plots_write_pngs(tmp_path, with_schedule):
    schedule = _schedule() if with_schedule else None
    written = [
        plot_schedule_matrices(_plan(), tmp_path / "matrices.png", "tiny: matrices", schedule=schedule),
        plot_ram_timeline([1000, 3000, 3000, 2000, 5000, 9000, 10000, 8000, 4000], 10_500,
                          tmp_path / "ram.png", "tiny: RAM", schedule=schedule),
        plot_pareto(ROWS, tmp_path / "pareto.png", "tiny: Pareto"),
    ]  # fmt: skip
    for path in written:
        assert path.read_bytes().startswith(PNG_SIGNATURE)
        assert path.stat().st_size > 10_000
