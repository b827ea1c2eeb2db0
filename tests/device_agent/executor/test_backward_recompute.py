"""Recomputing a backward node (the paper's formulation allows it, and so does poet-edge's) stays exact."""

import dataclasses

import pytest

from host.costs import load_profile, price_graph
from host.solver.validator import validate_schedule

from .helpers import case, param_diff, run_plain, run_scheduled, schedule_for


def _with_backward_recompute(schedule, graph, partition):
    """The keep-all schedule with one backward node freed right after it runs and computed again.

    The node chosen is the first backward node whose output another backward node reads, so the
    recomputed gradient is really consumed, and whose forward node has parameters (so a second
    accumulation into .grad would show).
    """
    instructions = list(schedule.instructions)
    for position, ins in enumerate(instructions):
        node = graph.nodes[ins.node]
        if ins.kind != "compute" or node.kind != "bwd":
            continue
        if not any(graph.nodes[j].kind == "bwd" for j in graph.successors[ins.node]):
            continue
        if not partition.programs[node.forward_index].params:
            continue
        recompute = [dataclasses.replace(ins, kind="free", location="ram"), ins]
        return dataclasses.replace(schedule, instructions=instructions[: position + 1] + recompute
                                   + instructions[position + 1 :]), node.index
    raise AssertionError("no backward node feeds another backward node")


@pytest.mark.parametrize("model,optimizer", [("mlp", "sgd"), ("hf_bert", "adamw")])
def test_recomputed_backward_node_matches_plain_pytorch(model, optimizer, tmp_path):
    current = case(model)
    keep_all, _budget = schedule_for(model, "none")
    graph = current.traced.graph
    schedule, recomputed = _with_backward_recompute(keep_all, graph, current.partition)
    report = validate_schedule(schedule, price_graph(graph, load_profile("a72")))
    assert report.recomputes == 1
    results = run_scheduled(current, schedule, steps=3, optimizer=optimizer, flash_dir=tmp_path)
    plain, plain_losses = run_plain(current, steps=3, optimizer=optimizer)
    relative, bitwise = param_diff(current.bundle.module, plain.module)
    assert relative <= 1e-6
    if model == "mlp":
        assert bitwise
    assert [r.loss for r in results] == pytest.approx(plain_losses, rel=1e-6)
    for result in results:
        assert result.counters.computes_per_node[recomputed] == 2
        assert result.counters.recomputes == 1
