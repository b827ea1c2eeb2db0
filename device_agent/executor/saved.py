"""Where a tensor a node's backward reads lives, and what holds it until then.

The executor never lets a saved tensor live anywhere it does not account for. Each one is classified when
the node's forward runs (:class:`Packer`): fixed (a parameter, buffer, constant or label, or an internal
the node pins: outside the schedule), in an input's entry (a view of a tensor another node produced), or
in this node's own entry (:func:`place_saved` adds it there). A record keeps the classification until
the node's backward reads the tensors back from the RAM store: :class:`GraphRecord` for a node run under
autograd (its graph, held by gradient edges only), :class:`SavedRecord` for one run as node functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from device_agent.executor.ram_store import EntryBuilder, StorageKey, TensorView, storage_key

__all__ = ["GraphRecord", "Packer", "Saved", "SavedRecord", "accumulate_grad", "hollow", "place_saved"]


class Saved:
    """What autograd keeps for a saved tensor: the tensor itself (fixed bytes) or where to find it."""

    __slots__ = ("node", "tensor", "view")

    def __init__(self, node: int | None, view: TensorView | None, tensor: torch.Tensor | None):
        self.node = node
        self.view = view
        self.tensor = tensor


@dataclass
class GraphRecord:
    """A fwd/loss node's autograd graph, held by gradient edges only (no activation data)."""

    roots: dict[str, torch.autograd.graph.GradientEdge]  # output value -> edge a gradient enters through
    root_meta: dict[str, tuple[torch.Size, torch.dtype]]
    leaves: dict[str, torch.Tensor]  # grad input value -> hollow leaf whose gradient the bwd node produces
    pinned_bytes: int = 0  # internals the graph holds itself (NodeProgram.pinned_internals)


@dataclass
class SavedRecord:
    """A fwd/loss node run through its forward function: the tensors its backward function reads."""

    saved: list[Saved]  # in the backward's order; each held here (fixed, pinned) or found in an entry
    output_meta: list[tuple[torch.Size, torch.dtype]]  # of its outputs, for gradients nobody sends
    input_meta: dict[str, tuple[torch.Size, torch.dtype]]  # of the inputs it sends gradients to
    pinned_bytes: int = 0


_ZERO_BY_DTYPE: dict[torch.dtype, torch.Tensor] = {}


def hollow(tensor: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype over one shared element: what a leaf keeps once its data belongs to the store."""
    zero = _ZERO_BY_DTYPE.get(tensor.dtype)
    if zero is None:
        zero = _ZERO_BY_DTYPE[tensor.dtype] = torch.zeros((), dtype=tensor.dtype)
    return zero.expand(tensor.shape)


class Packer:
    """``saved_tensors_hooks`` pack for one program run: classify every saved tensor by where it lives."""

    def __init__(self, node: int, input_keys: dict[StorageKey, tuple[int, int]], fixed_keys: set[StorageKey]):
        self.node = node
        self.input_keys = input_keys
        self.fixed_keys = fixed_keys
        self.pending: list[Saved] = []

    def pack(self, tensor: torch.Tensor) -> Saved:
        key = storage_key(tensor)
        if key is None or key in self.fixed_keys:
            return Saved(None, None, tensor)
        source = self.input_keys.get(key)
        if source is not None:
            producer, storage_index = source
            view = TensorView(storage_index, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                              tensor.storage_offset())
            return Saved(producer, view, None)
        saved = Saved(self.node, None, tensor)  # created by this program: joins its entry when the run ends
        self.pending.append(saved)
        return saved


def place_saved(pending: list[Saved], pinned_internals: bool, output_keys: set[StorageKey],
                 builder: EntryBuilder) -> int:
    """Saved tensors a run created: internals stay with the record when the node pins them (fixed bytes,
    returned), the rest (saved outputs included) join the node's entry."""
    pinned_bytes = 0
    if pending and pinned_internals:
        pinned_keys: set[StorageKey] = set()
        for saved in pending:
            key = storage_key(saved.tensor)
            if key is not None and key not in output_keys:
                saved.node = None
                if key not in pinned_keys:
                    pinned_keys.add(key)
                    pinned_bytes += key[1]
        pending = [saved for saved in pending if saved.node is not None]
    for saved in pending:  # tensors the backward reads: they belong to this node's entry
        saved.view = builder.add(saved.tensor)
        saved.tensor = None
    return pinned_bytes


def accumulate_grad(param: torch.nn.Parameter, grad: torch.Tensor, *, shared: bool) -> None:
    """What autograd's AccumulateGrad does: take the first gradient (a copy when shared), add the next in place."""
    if param.grad is None:
        if shared or grad.stride() != param.stride():
            grad = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype).copy_(grad)
        param.grad = grad
    else:
        param.grad.add_(grad)
