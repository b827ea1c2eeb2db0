"""A cross-entropy's backward writes the logits' gradient over the log-probabilities' gradient, in the executor's
backward functions and in eager autograd under InPlaceBackward (what the trace measures), and only where that
gradient is the loss backward's own fresh tensor; the values are bitwise those of the allocating kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from device_agent.executor.aten_calls import RecordOps
from device_agent.executor.in_place import InPlaceBackward, write_over_dead_gradients
from device_agent.executor.node_functions import capture_node_functions
from device_agent.executor.partition import NodeProgram

_LSB = torch.ops.aten._log_softmax_backward_data


def _smoothed(logits, labels):
    return F.cross_entropy(logits, labels, label_smoothing=0.1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (64 x 300) and labels, the same each call."""
    return (torch.randn(64, 300, generator=torch.Generator().manual_seed(0)),
            torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(1)))


def _eager_ops(loss_fn) -> tuple[list, torch.Tensor]:
    """The ops eager autograd runs for ``loss_fn``'s backward under InPlaceBackward, and the logits' gradient."""
    logits, labels = _batch()
    logits.requires_grad_(True)
    loss = loss_fn(logits, labels)
    with RecordOps() as record, InPlaceBackward():  # InPlaceBackward sees each op first, then passes it on
        (gradient,) = torch.autograd.grad(loss, [logits])
    return record.ops, gradient


@pytest.mark.parametrize("loss_fn", [F.cross_entropy, _smoothed], ids=["cross_entropy", "label_smoothing"])
def test_eager_autograd_writes_over_the_loss_gradient_only_where_it_is_fresh_and_bitwise(loss_fn):
    ops, gradient = _eager_ops(loss_fn)
    logits, labels = _batch()
    logits.requires_grad_(True)
    (expected,) = torch.autograd.grad(loss_fn(logits, labels), [logits])
    assert torch.equal(gradient, expected)
    written_over = _LSB.out in ops
    assert written_over == (loss_fn is F.cross_entropy)  # a summed gradient is not the nll backward's own tensor
    assert (_LSB.default in ops) == (not written_over)


def _loss_program(loss_fn) -> NodeProgram:
    gm = torch.fx.symbolic_trace(_Loss(loss_fn))
    return NodeProgram(1, "loss", "loss", gm, ("logits", "labels"), ("loss",), bwd_index=2,
                       grad_input_values=("logits",))


class _Loss(torch.nn.Module):
    def __init__(self, loss_fn) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, logits, labels):
        return (self.loss_fn(logits, labels),)


@pytest.mark.parametrize("loss_fn", [F.cross_entropy, _smoothed], ids=["cross_entropy", "label_smoothing"])
def test_the_executor_s_loss_backward_is_written_over_as_eager_measures_it(loss_fn):
    logits, labels = _batch()
    functions = capture_node_functions(_loss_program(loss_fn), [logits, labels])
    targets = [n.target for n in functions.backward.graph.nodes if n.op == "call_function"]
    eager_ops, expected = _eager_ops(loss_fn)
    assert (_LSB.out in targets) == (_LSB.out in eager_ops) == (loss_fn is F.cross_entropy)
    outputs = functions.call_forward(*functions.arguments, logits, labels)
    saved = outputs[functions.output_count + len(functions.buffers):]
    (gradient, *_rest) = functions.call_backward(*saved, torch.ones(()))
    assert torch.equal(gradient, expected)


def _nll_then_log_softmax_backward(return_nll_gradient: bool) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    grad_out, log_probs, labels, weight = (graph.placeholder(name) for name in ("g", "lp", "labels", "total"))
    nll = graph.call_function(torch.ops.aten.nll_loss_backward.default,
                              (grad_out, log_probs, labels, None, 1, -100, weight))
    logits_grad = graph.call_function(_LSB.default, (nll, log_probs, 1, torch.float32))
    graph.output((logits_grad, nll) if return_nll_gradient else (logits_grad,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    for node in gm.graph.nodes:  # the traced values the rule checks the layout on
        if node.op == "call_function":
            node.meta["val"] = torch.empty(8, 10, device="meta")
    return gm


@pytest.mark.parametrize("return_nll_gradient", [False, True], ids=["read_once", "read_again"])
def test_a_gradient_read_again_is_not_written_over(return_nll_gradient):
    """The rule needs the gradient to be read by the log-softmax backward alone."""
    gm = _nll_then_log_softmax_backward(return_nll_gradient)
    assert write_over_dead_gradients(gm) == (0 if return_nll_gradient else 1)


class _TwoBranches(torch.nn.Module):
    """A value read by two ops of one node, as a residual block reads its input: its gradient is a sum."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(4)
        self.first = torch.nn.Parameter(torch.randn(32, 32, generator=generator))
        self.second = torch.nn.Parameter(torch.randn(32, 32, generator=generator))

    def forward(self, x):
        return (torch.relu(F.linear(x, self.first)) * F.linear(x, self.second),)


def test_a_sum_of_gradients_is_written_over_its_fresh_term_and_is_bitwise_eager_s():
    module = _TwoBranches()
    program = NodeProgram(1, "branches", "fwd", torch.fx.symbolic_trace(module), ("x",), ("y",), bwd_index=2,
                          grad_input_values=("x",), params=tuple(module.parameters()))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    functions = capture_node_functions(program, [x])
    targets = [n.target for n in functions.backward.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.add_.Tensor in targets and torch.ops.aten.add.Tensor not in targets
    outputs = functions.call_forward(*functions.arguments, x)
    saved = outputs[functions.output_count + len(functions.buffers):]
    upstream = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    gradients = functions.call_backward(*saved, upstream)
    leaf = x.clone().requires_grad_(True)
    expected = torch.autograd.grad(module(leaf)[0], [*module.parameters(), leaf], upstream)
    assert all(torch.equal(g, e) for g, e in zip((*gradients[:len(functions.params)], gradients[-1]),
                                                 expected, strict=True))


def _sum_graph(term_kind: str) -> torch.fx.GraphModule:
    """``add(term, other)``, ``term`` made by mm: read once, read again, or seen through a view (one its op's schema
    declares, or one it does not: ``_unsafe_view``)."""
    graph = torch.fx.Graph()
    a, b, other = (graph.placeholder(name) for name in ("a", "b", "other"))
    term = graph.call_function(torch.ops.aten.mm.default, (a, b))
    views = {"view": torch.ops.aten.view.default, "hidden_view": torch.ops.aten._unsafe_view.default}
    if term_kind in views:
        term = graph.call_function(views[term_kind], (term, [8, 8]))
    total = graph.call_function(torch.ops.aten.add.Tensor, (term, other))
    graph.output((total, term) if term_kind == "read_again" else (total,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    product = torch.empty(8, 8, device="meta")
    for node in gm.graph.nodes:  # the traced values the rule checks: a view shares the product's storage
        if node.op != "output":
            node.meta["val"] = torch.empty(8, 8, device="meta")
        if node.target is torch.ops.aten.mm.default:
            node.meta["val"] = product
        if node.target in views.values():
            node.meta["val"] = product.view(8, 8)
    return gm


@pytest.mark.parametrize("term_kind", ["read_once", "read_again", "view", "hidden_view"])
def test_a_sum_is_written_over_a_term_only_when_nothing_else_holds_it(term_kind):
    gm = _sum_graph(term_kind)
    assert write_over_dead_gradients(gm) == (1 if term_kind == "read_once" else 0)
    a, b, other = (torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    result = gm(a, b, other)
    assert torch.equal(result[0], a @ b + other)
