"""A node's workspace (temporaries held only while it runs) is controlled RAM: the replay, the floor, the
MILP and the paging baseline all count it, so a schedule's budget holds while its biggest kernels run."""

from __future__ import annotations

import dataclasses

import pytest

from device_agent.replay import ReplayError, replay
from host.graph.training_graph import TrainingGraph
from host.solver.baselines import keep_all_plan, paging_plan
from host.solver.solve import SolveOptions, minimum_ram_bytes, no_remat_peak_bytes, solve_schedule
from host.solver.stage_plan import lower_plan, make_schedule
from host.solver.validator import validate_schedule
from tests.host.solver.graphs import chain_graph, price_simply


def with_workspace(graph: TrainingGraph, workspace_by_name: dict[str, int]) -> TrainingGraph:
    return dataclasses.replace(graph, nodes=[dataclasses.replace(n, workspace_bytes=workspace_by_name.get(n.name, 0))
                                             for n in graph.nodes])


def every_backward(graph: TrainingGraph, workspace_bytes: int) -> dict[str, int]:
    return {n.name: workspace_bytes for n in graph.nodes if n.kind == "bwd"}


def test_replay_counts_a_compute_s_workspace_while_it_runs():
    plain = chain_graph()
    heavy = with_workspace(plain, every_backward(plain, 250))
    instructions = lower_plan(keep_all_plan(plain), plain)
    without = replay(plain.nodes, instructions, graph_label="chain")
    counted = replay(heavy.nodes, instructions, graph_label="chain")
    assert counted.ram_timeline_bytes == without.ram_timeline_bytes  # after each instruction: unchanged
    assert counted.peak_ram_bytes > without.peak_ram_bytes
    with pytest.raises(ReplayError, match="250 bytes of temporaries"):
        replay(heavy.nodes, instructions, graph_label="chain", ram_budget_bytes=counted.peak_ram_bytes - 1)


def test_the_floor_and_the_no_remat_peak_include_the_workspace():
    plain = chain_graph()
    heavy = with_workspace(plain, {plain.nodes[2].name: 1000})
    node = heavy.nodes[2]  # its inputs, output and workspace at once
    assert minimum_ram_bytes(price_simply(heavy)) == node.output_bytes + 1000 + sum(
        heavy.nodes[d].output_bytes for d in node.deps)
    assert no_remat_peak_bytes(price_simply(heavy)) > no_remat_peak_bytes(price_simply(plain))
    floor = minimum_ram_bytes(price_simply(heavy))
    result = solve_schedule(price_simply(heavy), SolveOptions(ram_budget_bytes=floor - 1))
    assert result.status == "infeasible" and "workspace" in result.message


@pytest.mark.parametrize("formulation", ["poet-edge", "poet2022"])
def test_the_milp_makes_room_for_a_workspace(formulation):
    """Keep-all fits the budget until one backward's temporaries are counted; then the MILP must recompute or
    page, and the validator's replay (which counts them) accepts its schedule."""
    plain = chain_graph(length=6, bytes_each=100)
    priced_plain = price_simply(plain)
    budget = no_remat_peak_bytes(priced_plain)
    heavy = with_workspace(plain, every_backward(plain, 150))
    priced = price_simply(heavy)
    assert no_remat_peak_bytes(priced) > budget
    options = SolveOptions(ram_budget_bytes=budget, runtime_factor=3.0, formulation=formulation, time_limit_s=60)
    loose = solve_schedule(priced_plain, options)
    tight = solve_schedule(priced, options)
    assert loose.status == "optimal" and tight.status == "optimal", tight.message  # the MILP itself fits it
    assert loose.report.recomputes + loose.report.page_ins == 0
    assert tight.report.recomputes + tight.report.page_ins > 0
    report = validate_schedule(tight.schedule, priced, ram_budget_bytes=budget)
    assert report.peak_ram_bytes <= budget


def test_the_paging_baseline_leaves_room_for_the_workspace():
    plain = chain_graph(length=6, bytes_each=100)
    heavy = with_workspace(plain, every_backward(plain, 150))
    budget = no_remat_peak_bytes(price_simply(plain))
    plan = paging_plan(heavy, budget)
    report = validate_schedule(make_schedule(heavy, lower_plan(plan, heavy)), price_simply(heavy),
                               ram_budget_bytes=budget)
    assert report.peak_ram_bytes <= budget and report.page_ins > 0
