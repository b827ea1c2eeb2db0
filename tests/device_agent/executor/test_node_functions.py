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
    assert logged == []  # every node split (hf_bert's attention once left a dead dropout in its backward)
    # the first step of a shape is interpreted (and captures the functions), the next run the lowered program
    assert [r.lowered for r in results] == [False, True, True]


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


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.argmax_only = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x), self.argmax_only(x)


class _ArgmaxOfOneHead(torch.nn.Module):
    """One node with two outputs; the second is read only by argmax, so no gradient ever reaches its head."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.out = _TwoHeads(), torch.nn.Linear(8, 4)

    def forward(self, x):
        used, argmax_only = self.heads(x)
        return self.out(used) + argmax_only.argmax(-1, keepdim=True).to(used.dtype)


def test_a_head_no_gradient_reaches_keeps_no_gradient_as_in_eager(tmp_path):
    """AdamW moves a parameter whose .grad is a zero tensor (weight decay) and leaves one whose .grad is None: the
    head read only by argmax must come out of the backward with no gradient, as autograd leaves it."""
    import copy

    from device_agent.executor import ScheduleExecutor, make_optimizer, plain_train_step
    from host.costs import load_profile, price_graph
    from host.graph.partition import partition_from_traced
    from host.graph.trace import trace_model
    from host.graph.zoo import ModelBundle
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    torch.manual_seed(0)
    module = _ArgmaxOfOneHead()
    plain_module = copy.deepcopy(module)
    bundle = ModelBundle("two_heads", module, (torch.randn(16, 8),), torch.randint(0, 4, (16,)),
                         torch.nn.functional.cross_entropy)
    traced = trace_model(bundle, granularity="block", block_depth=1)
    priced = price_graph(traced.graph, load_profile("a72"))
    schedule = solve_schedule(priced, SolveOptions(ram_budget_bytes=no_remat_peak_bytes(priced))).schedule
    optimizer = make_optimizer("adamw", module.parameters())
    plain_optimizer = make_optimizer("adamw", plain_module.parameters())
    with ScheduleExecutor(partition_from_traced(traced), schedule, node_functions=True) as executor:
        for _ in range(2):
            executor.train_step(bundle.inputs, bundle.labels, optimizer)
            plain_train_step(plain_module, bundle.loss_fn, bundle.inputs, bundle.labels, plain_optimizer)
        assert executor.autograd_nodes == {}
    assert plain_module.heads.argmax_only.weight.grad is None
    for (name, a), b in zip(module.named_parameters(), plain_module.parameters(), strict=True):
        assert torch.equal(a, b), name
