"""Nodes run as forward and backward functions cut from their joint graph (ScheduleExecutor(node_functions=True)):
the same parameters, bitwise, as plain PyTorch under every kind of schedule, with recompute replaying dropout and
leaving BatchNorm statistics alone; a split that would draw random numbers in the backward is refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from device_agent.executor.node_functions import NodeCaptureError, capture_node_functions
from device_agent.executor.partition import NodeProgram

from .helpers import case, param_diff, run_plain, run_scheduled, schedule_for

CASES = [pytest.param(model, kind, optimizer, marks=() if model == "mlp" else pytest.mark.slow,  # ~1.5 s each
                       id=f"{model}-{kind}-{optimizer}")
         for model in ("mlp", "resnet18_cifar", "hf_bert")
         for kind, optimizer in (("none", "sgd"), ("remat", "adamw"), ("paging", "sgd"), ("mixed", "adamw"))]


@pytest.mark.parametrize("model,kind,optimizer", CASES)
def test_node_functions_train_bitwise_as_plain_pytorch(model, kind, optimizer, tmp_path):
    current = case(model)
    schedule, _budget = schedule_for(model, kind)
    logged: list[str] = []
    results = run_scheduled(current, schedule, steps=3, optimizer=optimizer, flash_dir=tmp_path,
                            node_functions=True, log=logged.append)
    plain, plain_losses = run_plain(current, steps=3, optimizer=optimizer)
    relative, bitwise = param_diff(current.bundle.module, plain.module)
    assert bitwise, f"{model}/{kind}: parameters differ from plain PyTorch by {relative:.3g} (relative)"
    buffers = [b for _, b in current.bundle.module.named_buffers()]
    plain_buffers = [b for _, b in plain.module.named_buffers()]
    assert all(torch.equal(a, b) for a, b in zip(buffers, plain_buffers, strict=True))
    assert [r.loss for r in results] == plain_losses
    per_node = Counter(ins.node for ins in schedule.instructions if ins.kind == "compute")
    for result in results:
        assert result.counters.computes_per_node == per_node
        assert result.counters.plan_counts()["recomputes"] == schedule.counts()["recomputes"]
    if model != "hf_bert":  # its encoder blocks' splits recompute a dropout in the backward: they run under autograd
        assert logged == []


def test_a_split_with_a_random_op_in_the_backward_is_refused():
    class DropoutTwice(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, True) * x

    gm = torch.fx.symbolic_trace(DropoutTwice())
    program = NodeProgram(1, "dropout", "fwd", gm, ("x",), ("out",), bwd_index=2, grad_input_values=("x",),
                          random=True)
    x = torch.randn(4, 4)
    state = torch.get_rng_state()
    try:
        functions = capture_node_functions(program, [x])
    except NodeCaptureError as error:
        assert "random op in the backward" in str(error)
    else:
        assert not any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                       for n in functions.backward.graph.nodes)
    assert torch.equal(state, torch.get_rng_state()), "capturing drew random numbers"
