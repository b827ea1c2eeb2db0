"""Backward ops that write their result over a gradient nothing else reads: the cross-entropy backward, and sums.

A cross-entropy's backward runs ``nll_loss_backward`` (the gradient of the log-probabilities: batch x classes, zero
but at the labels), then ``_log_softmax_backward_data`` (the gradient of the logits, the same size), after which the
first is dead. Eager autograd allocates the second beside the first, so the loss's backward holds three tensors of
that size at once (the saved log-probabilities and both gradients): hf_bert's 3.15 MB at batch 16, the largest
node of its graph, below which no schedule can go. Written over the first, it holds two. The write goes through the
``out=`` overload of the same CPU kernel, which finishes reading a row (its gradient sum) before it writes that row,
so the values are bitwise those of the allocating call (a test checks it on the executor's models).

A sum of two gradients (a value read by two ops of one node, as a residual block's input is) is one ``add`` in the
node's backward graph, which allocates the sum beside its two terms. Eager autograd accumulates in place instead (its
input buffer adds the second gradient into the first when nothing else holds it), so the trace measures the backward
with two of them at once. The backward graph does the same: ``add_`` into a term made in the graph, read by nothing
else, laid out as the sum, and no view of another value. The values are bitwise those of ``add`` (the same kernel;
IEEE addition is commutative).

Both sides apply the one rule here, so the graph's accounting is what the executor does: the executor rewrites its
backward graphs (:func:`write_over_dead_gradients`), and the trace measures each backward's workspace under
:class:`InPlaceBackward`, which makes eager autograd do the same for the cross-entropy (its sums are in place already).
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["InPlaceBackward", "write_over_dead_gradients"]

_aten = torch.ops.aten
# op -> (its out= overload, the ops whose fresh result its first argument may be written over)
_REWRITES = {
    _aten._log_softmax_backward_data.default: (
        _aten._log_softmax_backward_data.out,
        frozenset({_aten.nll_loss_backward.default, _aten.nll_loss2d_backward.default}),
    ),
}
_PRODUCERS = frozenset().union(*(producers for _, producers in _REWRITES.values()))


def _writable(gradient, result_like, dim) -> bool:
    """The kernel may write its result over ``gradient``: a dense CPU tensor laid out as the result, softmax over
    its last dimension (the row-wise path: a row is read before it is written)."""
    return (isinstance(gradient, torch.Tensor) and isinstance(result_like, torch.Tensor)
            and gradient.device.type in ("cpu", "meta") and gradient.dim() >= 1
            and isinstance(dim, int) and dim in (-1, gradient.dim() - 1)
            and gradient.is_contiguous() and gradient.dtype == result_like.dtype
            and tuple(gradient.shape) == tuple(result_like.shape)
            and tuple(gradient.stride()) == tuple(result_like.stride()))


def write_over_dead_gradients(gm: GraphModule) -> int:
    """Rewrite ``gm``'s calls that may write over a gradient only they read (see the module docstring): to their
    ``out=`` overload, and sums to ``add_``; the number rewritten. Checked on the traced values: the gradient made
    in this graph (by one of the rule's producers), read by nothing else, laid out as the result."""
    rewritten = _sums_in_place(gm)
    for node in list(gm.graph.nodes):
        rule = _REWRITES.get(node.target) if node.op == "call_function" else None
        if rule is None or not node.args or node.kwargs:
            continue
        out_overload, producers = rule
        gradient = node.args[0]
        if not (isinstance(gradient, Node) and gradient.op == "call_function" and gradient.target in producers
                and len(gradient.users) == 1 and all(a is not gradient for a in node.args[1:])):
            continue
        if not _writable(gradient.meta.get("val"), node.meta.get("val"), node.args[2] if len(node.args) > 2 else None):
            continue
        node.target = out_overload
        node.kwargs = {"out": gradient}
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _sums_in_place(gm: GraphModule) -> int:
    """``add(a, b)`` -> ``add_(a, b)`` (or ``add_(b, a)``) where that term is free to be written over."""
    nodes = list(gm.graph.nodes)
    storages: dict[StorageWeakRef, int] = {}  # storage -> how many values of the graph live in it
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            key = StorageWeakRef(value.untyped_storage())
            storages[key] = storages.get(key, 0) + 1
    rewritten = 0
    for node in nodes:
        if node.op != "call_function" or node.target is not _aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        for term, other in (node.args, node.args[::-1]):
            if _dead_fresh_term(term, other, node, storages):
                node.target = _aten.add_.Tensor
                node.args = (term, other)
                rewritten += 1
                break
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _dead_fresh_term(term, other, node: Node, storages: dict) -> bool:
    """``term`` may take ``node``'s sum: made by an op of this graph that returns new storage (no view), read by
    ``node`` alone, not ``other``, its storage holding no other value, dense and laid out as the sum."""
    if not isinstance(term, Node) or term is other or term.op != "call_function" or len(term.users) != 1:
        return False
    producer = term.args[0] if term.target is operator.getitem else term
    target = producer.target if isinstance(producer, Node) else None
    if not isinstance(target, torch._ops.OpOverload) or target in _HIDDEN_VIEWS \
            or any(r.alias_info is not None for r in target._schema.returns) \
            or any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments):
        return False
    value, result = term.meta.get("val"), node.meta.get("val")
    if not (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor)):
        return False
    return (storages.get(StorageWeakRef(value.untyped_storage())) == 1 and value.is_contiguous()
            and value.dtype == result.dtype and value.device == result.device
            and tuple(value.shape) == tuple(result.shape) and tuple(value.stride()) == tuple(result.stride()))


# Ops whose schemas declare no alias but whose results may be views of an argument
_HIDDEN_VIEWS = frozenset({_aten._unsafe_view.default, _aten.alias.default, _aten.lift_fresh.default})


class InPlaceBackward(TorchDispatchMode):
    """Eager autograd under the same rule: a rewritten op's gradient argument is written over when it is the very
    tensor one of the rule's producers returned, unmodified since (autograd accumulating another gradient into it
    bumps its version; a sum of gradients is another tensor). For measuring a backward as the executor runs it."""

    def __init__(self) -> None:
        super().__init__()
        self._fresh: list[tuple[weakref.ref, int]] = []  # producers' results, with their version when produced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _REWRITES.get(func)
        if rule is not None and args and not kwargs:
            gradient = args[0]
            fresh = any(ref() is gradient and version == gradient._version for ref, version in self._fresh)
            if fresh and all(a is not gradient for a in args[1:]) \
                    and _writable(gradient, gradient, args[2] if len(args) > 2 else None):
                return rule[0](*args, out=gradient)
        result = func(*args, **kwargs)
        if func in _PRODUCERS and isinstance(result, torch.Tensor):
            self._fresh = [(ref, version) for ref, version in self._fresh if ref() is not None]
            self._fresh.append((weakref.ref(result), result._version))
        return result
