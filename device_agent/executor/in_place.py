"""Backward ops that write their result over a gradient nothing else reads: the cross-entropy backward.

A cross-entropy's backward runs ``nll_loss_backward`` (the gradient of the log-probabilities: batch x classes, zero
but at the labels), then ``_log_softmax_backward_data`` (the gradient of the logits, the same size), after which the
first is dead. Eager autograd allocates the second beside the first, so the loss's backward holds three tensors of
that size at once (the saved log-probabilities and both gradients): hf_bert's 3.15 MB at batch 16, the largest
node of its graph, below which no schedule can go. Written over the first, it holds two. The write goes through the
``out=`` overload of the same CPU kernel, which finishes reading a row (its gradient sum) before it writes that row,
so the values are bitwise those of the allocating call (a test checks it on the executor's models).

Both sides apply the one rule here, so the graph's accounting is what the executor does: the executor rewrites its
backward graphs (:func:`write_over_dead_gradients`), and the trace measures each backward's workspace under
:class:`InPlaceBackward`, which makes eager autograd do the same.
"""

from __future__ import annotations

import weakref

import torch
from torch.fx import GraphModule, Node
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
    """Rewrite ``gm``'s calls that may write over a gradient only they read (see the module docstring) to their
    ``out=`` overload; the number rewritten. Checked on the traced values: the gradient made in this graph by one of
    the rule's producers, read by nothing else, laid out as the result."""
    rewritten = 0
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
