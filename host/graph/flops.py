"""FLOP formulas of one op, forward and backward: the one place the trace's FLOPs come from.

Convention: a multiply-add is 2 FLOPs, any other arithmetic op 1 FLOP per output element; bias adds inside a
matmul or conv are not counted (as in ``torch.utils.flop_counter``). The trace (:mod:`host.graph.measure`)
runs every op under :func:`flop_counter`, torch's ``FlopCounterMode`` with :data:`COUNTER_FORMULAS` replacing or
adding the formulas marked *; ops the counter prices at 0 take :func:`formula_flops`, and their backward is
2 x their forward (an elementwise backward reads the output gradient and one saved tensor per element).

=========================  =====================================================  ===================================
op                         forward                                                backward
=========================  =====================================================  ===================================
mm, addmm, linear          2·M·K·N (linear: M = rows of the flattened input)      grad input 2·M·K·N + grad weight
                                                                                  2·M·K·N (each only when needed)
bmm, baddbmm, matmul       2·B·M·K·N                                              as mm, per batch
conv* (convolution,        2·N·prod(output spatial)·numel(W), W = C_out x         grad input = forward, grad weight
conv1d/2d/3d, any groups,  C_in/groups x kernel: each output position times       = forward (each only when needed):
depthwise, stride,         every kernel tap of its group, padded taps included;   the same multiply-adds, once per
dilation, padding)         transposed: prod(input spatial) instead                gradient; bias gradient not counted
sdpa* (CPU flash)          4·B·H·L·S·E (QKᵀ and PV; softmax not counted)          5 bmm: 10·B·H·L·S·E (scores
                                                                                  recomputed, dV, dP, dQ, dK)
embedding*                 0 (a gather)                                           numel(grad output): a scatter-add
LSTM* / GRU / RNN, per     per step 2·B·G·H·(I + H_r) (+ 2·B·H·P projection)      2 x forward (grad input, hidden
layer and direction        + E·B·H; G = 4/3/1 gates, E = 13/10/2 elementwise      and weight of each matmul; pointwise
                           (LSTM: gate add 4, 3 sigmoid, 2 tanh, c 3, h 1; GRU:   2 x); no grad of a constant h0
                           gate adds 2, 2 sigmoid, tanh, r·h, add, h' 3)
layer/batch/group norm     5·numel(input): mean, variance, subtract, 1/std, affine 2 x forward
pooling (max/avg/adaptive) kernel elements·numel(output) (adaptive kernel =       2 x forward
                           ceil(input/output) per dim)
pointwise                  numel(output) (reductions: numel(input))               2 x forward
softmax / loss             5·numel / 3·numel(logits)                              2 x forward
data movement              0 (views, cat, copies, indexing)                       0
=========================  =====================================================  ===================================

``*``: torch's counter misprices these on CPU: a grouped conv's weight gradient is counted ``groups`` x too high
(a depthwise conv's backward came out at 65x its forward instead of 2x, MobileNetV2 at 8.1 GFLOP per step instead
of 1.2); the fused CPU LSTM kernel ``mkldnn_rnn_layer``, CPU flash attention and embedding's backward
count 0.
An LSTM/GRU traced by :mod:`host.graph.recurrent` is unrolled into these per-step ops, whose FLOPs add up to the
row above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "COUNTER_FORMULAS", "RNN_ELEMENTWISE_PER_HIDDEN", "RNN_GATES", "conv_backward_flops", "conv_flops",
    "flop_counter", "formula_flops", "pool_flops", "rnn_layer_flops", "sdpa_flops",
]  # fmt: skip

aten = torch.ops.aten

# Per recurrent kind: gates per step (G) and elementwise FLOPs per hidden unit per step (E); see the table above.
RNN_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
RNN_ELEMENTWISE_PER_HIDDEN = {"lstm": 13, "gru": 10, "rnn_tanh": 2, "rnn_relu": 2}
_MKLDNN_RNN_MODES = {0: "rnn_relu", 1: "rnn_tanh", 2: "lstm", 3: "gru"}  # ideep::rnn_kind


# ----------------------------------------------------------------------------- formulas (shapes in, FLOPs out)
def conv_flops(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool) -> int:
    """2·N·prod(output spatial)·numel(W); W is C_out x C_in/groups x kernel, so groups and depthwise are exact.

    Stride, dilation and padding act through the output size; a transposed conv runs over the input's positions.
    """
    spatial = (x_shape if transposed else out_shape)[2:]
    return 2 * int(x_shape[0]) * math.prod(spatial) * math.prod(w_shape)


def conv_backward_flops(x_shape: Sequence[int], w_shape: Sequence[int], grad_out_shape: Sequence[int],
                        transposed: bool, output_mask: Sequence[bool]) -> int:
    """Grad input and grad weight each redo the forward's multiply-adds once (only the ones asked for)."""
    forward = conv_flops(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def sdpa_flops(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int]) -> int:
    """2·B·H·L·S·(E + E_v): QKᵀ and PV (softmax not counted); leading dims of any rank are the batch."""
    length, width = query_shape[-2], query_shape[-1]
    batch_heads = math.prod(query_shape[:-2])
    return 2 * batch_heads * length * key_shape[-2] * (width + value_shape[-1])


def rnn_layer_flops(kind: str, steps_x_batch: int, input_size: int, hidden_size: int, proj_size: int = 0) -> int:
    """One layer and direction of an LSTM/GRU/RNN over T steps of batch B (``steps_x_batch`` = T·B).

    Per step: 2·B·G·H·(I + H_r) for the input and hidden matmuls (H_r = proj_size or H), 2·B·H·P for an LSTM's
    projection, and E·B·H elementwise (:data:`RNN_GATES`, :data:`RNN_ELEMENTWISE_PER_HIDDEN`).
    """
    recurrent = proj_size or hidden_size
    gates = RNN_GATES[kind] * hidden_size
    per_row = 2 * gates * (input_size + recurrent) + 2 * hidden_size * proj_size
    return steps_x_batch * (per_row + RNN_ELEMENTWISE_PER_HIDDEN[kind] * hidden_size)


def pool_flops(adaptive: bool, dims: int, in_shape: Sequence[int], out_shape: Sequence[int],
               kernel_size: int | Sequence[int] = 1) -> int:
    """Kernel elements·numel(output); an adaptive pool's kernel is ceil(input / output) per dim."""
    if adaptive:
        kernel = math.prod(math.ceil(i / max(o, 1)) for i, o in zip(in_shape[-dims:], out_shape[-dims:], strict=True))
    else:
        sizes = [kernel_size] * dims if isinstance(kernel_size, int) else list(kernel_size)
        kernel = math.prod(int(s) for s in sizes) if sizes else 1
    return int(kernel * math.prod(out_shape))


_PER_ELEMENT = {"norm": 5, "softmax": 5, "loss": 3, "reduction": 1, "pointwise": 1}


def formula_flops(kind: str, in_numel: int, out_numel: int) -> int:
    """FLOPs of an op the counter skips: norm/softmax 5·numel(input), loss 3·numel(logits), a reduction
    numel(input), pointwise numel(output)."""
    return _PER_ELEMENT[kind] * (out_numel if kind == "pointwise" else in_numel)


# ----------------------------------------------------------------------------- the counter's formulas
def _conv(x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, *args, out_shape=None, **kwargs) -> int:
    return conv_flops(x_shape, w_shape, out_shape, transposed)


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                   _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    return conv_backward_flops(x_shape, w_shape, grad_out_shape, transposed, output_mask)


def _mkldnn_rnn_forward(x_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:
    """The fused CPU LSTM kernel, one layer and direction: w_ih is G·H x I, w_hh is G·H x H_r."""
    mode = args[6] if len(args) > 6 else kwargs.get("mode", 2)
    hidden = w_hh_shape[0] // RNN_GATES[_MKLDNN_RNN_MODES[mode]]
    recurrent = w_hh_shape[1]
    return rnn_layer_flops(_MKLDNN_RNN_MODES[mode], math.prod(x_shape) // x_shape[-1], x_shape[-1], hidden,
                           recurrent if recurrent != hidden else 0)


def _mkldnn_rnn_backward(x_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:
    mode = args[11] if len(args) > 11 else kwargs.get("mode", 2)
    hidden = w_hh_shape[0] // RNN_GATES[_MKLDNN_RNN_MODES[mode]]
    recurrent = w_hh_shape[1]
    return 2 * rnn_layer_flops(_MKLDNN_RNN_MODES[mode], math.prod(x_shape) // x_shape[-1], x_shape[-1], hidden,
                               recurrent if recurrent != hidden else 0)


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _embedding_backward(grad_out_shape, *args, out_shape=None, **kwargs) -> int:
    return math.prod(grad_out_shape)


# aten op -> formula over shapes (the counter's custom_mapping): replaces torch's conv formulas and prices ops
# torch's counter reports as 0 on CPU.
COUNTER_FORMULAS: dict[Any, Any] = {
    aten.convolution: _conv,
    aten._convolution: _conv,
    aten.convolution_overrideable: _conv,
    aten.convolution_backward: _conv_backward,
    aten.mkldnn_rnn_layer: _mkldnn_rnn_forward,
    aten.mkldnn_rnn_layer_backward: _mkldnn_rnn_backward,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
    aten.embedding_dense_backward: _embedding_backward,
}


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode with :data:`COUNTER_FORMULAS`; silent."""
    return FlopCounterMode(display=False, custom_mapping=COUNTER_FORMULAS)
