"""Unroll recurrent layers (LSTM, GRU, RNN) of an exported program into one cell per time step.

``torch.export`` keeps ``nn.LSTM``/``nn.GRU``/``nn.RNN`` as one op (``aten.lstm.input``, ``aten.gru.input``,
``aten.rnn_tanh.input``, ``aten.rnn_relu.input``): one unsplittable node whose saved state is the whole
sequence's. :func:`unroll_recurrent` rewrites each into its cells, per layer, direction and time step, in the
exported program itself, so the archive a board receives already holds the per-step ops (nothing is redone
on the board). Each new op is tagged ``node.meta[RECURRENT_STEP_META_KEY]`` (``"l0.t07"``, ``"l1.r.t03"`` for
a reverse direction, ``"out"`` for assembling the outputs), which :mod:`host.graph.grouping` turns into one
group per step at "layer" granularity.

The cells are PyTorch's (``torch.nn.LSTMCell``, ``GRUCell``, ``RNNCell`` docs; ``aten/src/ATen/native/RNN.cpp``):

- LSTM: ``gates = linear(h, W_hh, b_hh) + linear(x_t, W_ih, b_ih)``; i, f, g, o = chunk(gates, 4);
  ``c' = σ(f)·c + σ(i)·tanh(g)``; ``h' = σ(o)·tanh(c')`` (then ``linear(h', W_hr)`` with ``proj_size``).
- GRU: ``gi = linear(x_t, W_ih, b_ih)``, ``gh = linear(h, W_hh, b_hh)`` chunked in 3; ``r = σ(gh_r + gi_r)``,
  ``z = σ(gh_z + gi_z)``, ``n = tanh(gi_n + gh_n·r)``; ``h' = (h - n)·z + n``.
- RNN: ``h' = act(linear(h, W_hh, b_hh) + linear(x_t, W_ih, b_ih))``.

Training matches eager ``nn.LSTM`` to float rounding (CPU eager runs the fused oneDNN kernel). Left as one op:
dropout between stacked layers in training (its random draws could not match eager's), and shapes that are
not static.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node

__all__ = ["RECURRENT_STEP_META_KEY", "unroll_recurrent"]

RECURRENT_STEP_META_KEY = "poet_recurrent_step"  # fx node meta: which cell (layer, direction, step) runs the op
_OUTPUT_STEP = "out"

aten = torch.ops.aten
_KINDS = {aten.lstm.input: "lstm", aten.gru.input: "gru", aten.rnn_tanh.input: "rnn_tanh",
          aten.rnn_relu.input: "rnn_relu"}  # fmt: skip
_COPIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn")


class _Emitter:
    """Inserts aten ops before ``anchor`` with the recurrent op's metadata and a FakeTensor ``val``."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph = graph
        self.anchor = anchor
        self.meta = {k: anchor.meta[k] for k in _COPIED_META if k in anchor.meta}
        self.fake_mode = torch._guards.detect_fake_mode(
            [a.meta.get("val") for a in anchor.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        )
        self.step = _OUTPUT_STEP
        self.created: list[Node] = []

    def __call__(self, target: Any, *args: Any) -> Node:
        def val(a: Any) -> Any:
            if isinstance(a, Node):
                return a.meta["val"]
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        node.meta.update(self.meta)
        node.meta[RECURRENT_STEP_META_KEY] = self.step
        if target is operator.getitem:
            node.meta["val"] = val(args[0])[args[1]]
        else:
            with self.fake_mode:
                node.meta["val"] = target(*val(args))
        self.created.append(node)
        return node

    def linear(self, x: Node, weight: Node, bias: Node | None) -> Node:
        return self(aten.linear.default, x, weight, bias)

    def chunks(self, x: Node, count: int) -> list[Node]:
        chunked = self(aten.chunk.default, x, count, 1)
        return [self(operator.getitem, chunked, i) for i in range(count)]


def _cell(emit: _Emitter, kind: str, x: Node, state: tuple[Node, ...], weights: list[Node | None]) -> tuple[Node, ...]:
    """One time step: the new (h,) or (h, c) from input ``x`` [B, I] and the state [B, H] each.

    The op(s) making h' run in a cell of their own (step tag + ``.h``) that saves nothing: whatever reads every
    step's h' (the stacked output) then holds the h's alone, not each step's gates as well.
    """
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    h_step = f"{emit.step}.h"
    if kind == "gru":
        (h,) = state
        gi = emit.chunks(emit.linear(x, w_ih, b_ih), 3)
        gh = emit.chunks(emit.linear(h, w_hh, b_hh), 3)
        reset = emit(aten.sigmoid.default, emit(aten.add.Tensor, gh[0], gi[0]))
        update = emit(aten.sigmoid.default, emit(aten.add.Tensor, gh[1], gi[1]))
        new = emit(aten.tanh.default, emit(aten.add.Tensor, gi[2], emit(aten.mul.Tensor, gh[2], reset)))
        kept = emit(aten.mul.Tensor, emit(aten.sub.Tensor, h, new), update)
        emit.step = h_step
        return (emit(aten.add.Tensor, kept, new),)
    gates = emit(aten.add.Tensor, emit.linear(state[0], w_hh, b_hh), emit.linear(x, w_ih, b_ih))
    if kind != "lstm":
        emit.step = h_step
        return (emit(aten.tanh.default if kind == "rnn_tanh" else aten.relu.default, gates),)
    _, c = state
    i, f, g, o = emit.chunks(gates, 4)
    c_new = emit(aten.add.Tensor,
                 emit(aten.mul.Tensor, emit(aten.sigmoid.default, f), c),
                 emit(aten.mul.Tensor, emit(aten.sigmoid.default, i), emit(aten.tanh.default, g)))  # fmt: skip
    out_gate, cell_tanh = emit(aten.sigmoid.default, o), emit(aten.tanh.default, c_new)
    emit.step = h_step
    h_new = emit(aten.mul.Tensor, out_gate, cell_tanh)
    if w_hr is not None:
        h_new = emit.linear(h_new, w_hr, None)
    return h_new, c_new


def _unrollable(node: Node) -> bool:
    """Static shapes, every use a ``getitem``, and no inter-layer dropout in training."""
    _, hx, params, _, num_layers, dropout, train, _, _ = node.args
    values = [a.meta.get("val") for a in node.all_input_nodes]
    if not all(isinstance(v, torch.Tensor) for v in values) or any(
        not isinstance(d, int) for v in values for d in v.shape
    ):
        return False
    if train and dropout > 0 and num_layers > 1:
        return False
    return all(u.target is operator.getitem for u in node.users)


def _unroll(graph: Graph, node: Node) -> None:
    """Replace one recurrent op by its cells; layer l > 0 reads layer l - 1's per-step outputs directly."""
    kind = _KINDS[node.target]
    x, hx, params, has_biases, num_layers, _, _, bidirectional, batch_first = node.args
    states = list(hx) if kind == "lstm" else [hx]
    directions = 2 if bidirectional else 1
    time_dim = 1 if batch_first else 0
    steps = x.meta["val"].shape[time_dim]
    per_cell = 2 + 2 * int(has_biases) + int(kind == "lstm" and states[0].meta["val"].shape[-1] !=
                                               states[1].meta["val"].shape[-1])
    emit = _Emitter(graph, node)
    width = len(str(steps - 1))
    layer_inputs: list[list[Node]] | None = None  # per step, the parts of the layer's input (None: slices of x)
    finals: list[tuple[Node, ...]] = []
    outputs: list[list[Node]] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            cell = layer * directions + direction
            weights = list(params[cell * per_cell:(cell + 1) * per_cell])
            w_ih, w_hh = weights[:2]
            b_ih, b_hh = weights[2:4] if has_biases else (None, None)
            w_hr = weights[-1] if per_cell in (3, 5) else None
            tag = f"l{layer}." + ("r." if direction else "")
            emit.step = f"{tag}t{(steps - 1 if direction else 0):0{width}d}"
            state = tuple(emit(aten.select.int, s, 0, cell) for s in states)
            hidden: list[Node] = []
            for t in range(steps - 1, -1, -1) if direction else range(steps):
                emit.step = f"{tag}t{t:0{width}d}"
                if layer_inputs is None:
                    step_input = emit(aten.select.int, x, time_dim, t)
                elif len(layer_inputs[t]) == 1:
                    step_input = layer_inputs[t][0]
                else:  # the previous layer's two directions, joined in each cell that reads them
                    step_input = emit(aten.cat.default, layer_inputs[t], 1)
                state = _cell(emit, kind, step_input, state, [w_ih, w_hh, b_ih, b_hh, w_hr])
                hidden.append(state[0])
            outputs.append(hidden[::-1] if direction else hidden)
            finals.append(state)
        layer_inputs = [list(parts) for parts in zip(*outputs, strict=True)]
    emit.step = _OUTPUT_STEP
    stacked = [emit(aten.stack.default, hidden, time_dim) for hidden in outputs]
    output = stacked[0] if directions == 1 else emit(aten.cat.default, stacked, 2)
    results = [output] + [emit(aten.stack.default, [f[k] for f in finals], 0) for k in range(len(states))]
    for user in list(node.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    for created in reversed(emit.created):
        if not created.users:
            graph.erase_node(created)


def unroll_recurrent(program: torch.export.ExportedProgram) -> int:
    """Unroll every LSTM/GRU/RNN op of ``program`` in place into per-step cells; returns how many were unrolled."""
    graph_module = program.graph_module
    unrolled = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target in _KINDS and _unrollable(node):
            _unroll(graph_module.graph, node)
            unrolled += 1
    if unrolled:
        graph_module.graph.lint()
        graph_module.recompile()
    return unrolled
