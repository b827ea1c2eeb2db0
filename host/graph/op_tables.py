"""Op tables: what an aten op is (view, class) and which FLOP formula prices an op the counter skips.

The formulas themselves (and the counter's corrected ones for conv, LSTM, CPU attention and embedding) are in
:mod:`host.graph.flops`, with the table of forward and backward FLOPs per op. A backward is the counter's
backward FLOPs plus 2 x the forward FLOPs that came from formulas.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from device_agent.executor.split import MAYBE_VIEW_OPS, VIEW_OPS, is_view, op_name
from host.graph.flops import formula_flops, pool_flops, sdpa_flops

__all__ = ["CLASS_PRIORITY", "SHAPE_ONLY_OPS", "classify_op", "is_view", "op_name", "tensors"]

_CONV_OPS = frozenset(
    {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
     "conv_transpose3d", "conv_tbc", "mkldnn_convolution"}
)  # fmt: skip
_SDPA_OPS = frozenset(
    {"scaled_dot_product_attention", "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention"}
)  # fmt: skip
_MATMUL_OPS = _SDPA_OPS | frozenset(
    {"mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "addbmm", "einsum", "addmv", "mv", "dot", "vdot",
     "bilinear", "tensordot", "inner", "outer", "ger", "addr", "_scaled_mm"}
)  # fmt: skip
_NORM_OPS = frozenset(
    {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
     "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "_batch_norm_impl_index", "layer_norm",
     "native_layer_norm", "group_norm", "native_group_norm", "instance_norm", "rms_norm", "_fused_rms_norm",
     "local_response_norm"}
)  # fmt: skip
_POOL_PATTERN = re.compile(r"^_?(adaptive_)?(max|avg|lp)_pool(\d)d")
_SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
_LOSS_OPS = frozenset(
    {"cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "mse_loss", "l1_loss", "smooth_l1_loss",
     "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
     "multilabel_margin_loss", "multi_margin_loss", "hinge_embedding_loss", "margin_ranking_loss",
     "cosine_embedding_loss", "poisson_nll_loss", "triplet_margin_loss", "ctc_loss"}
)  # fmt: skip
_REDUCTION_OPS = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "norm",
     "linalg_vector_norm", "prod", "logsumexp", "argmax", "argmin", "all", "any"}
)  # fmt: skip
_ZERO_FLOP_OPS = VIEW_OPS | MAYBE_VIEW_OPS | frozenset(
    {"embedding", "embedding_bag", "gather", "scatter", "scatter_add", "index", "index_select", "index_put",
     "index_add", "index_copy", "cat", "concat", "stack", "clone", "copy", "_to_copy", "zeros", "zeros_like",
     "ones", "ones_like", "full", "full_like", "empty", "empty_like", "empty_strided", "arange", "scalar_tensor",
     "new_zeros", "new_ones", "new_full", "new_empty", "constant_pad_nd", "pad", "repeat", "tile", "roll", "flip",
     "masked_select", "nonzero", "lift_fresh_copy", "lift_fresh", "rand", "randn", "rand_like", "randn_like",
     "randint", "randperm", "one_hot", "repeat_interleave", "select_scatter", "slice_scatter",
     "diagonal_scatter", "as_strided_scatter", "sym_size", "_assert_tensor_metadata", "_assert_scalar"}
)  # fmt: skip
# Ops that read their tensor argument only for its shape/dtype: they never tie a group to their input.
SHAPE_ONLY_OPS = frozenset(
    {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
     "new_ones", "new_empty", "new_full", "new_empty_strided"}
)  # fmt: skip
# When several classes tie on FLOPs, the first one here names the group.
CLASS_PRIORITY = ("conv", "matmul", "norm", "pool", "loss", "elementwise", "other")


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 0


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a value (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)


def _pool_flops(match: re.Match, args: tuple, result: Any) -> int:
    """:func:`host.graph.flops.pool_flops` from a pooling op's arguments and result."""
    dims = int(match.group(3))
    output = next(tensors(result), None)
    if output is None or not args or not isinstance(args[0], torch.Tensor):
        return 0
    kernel_size = args[1] if len(args) > 1 and not match.group(1) else 1
    return pool_flops(bool(match.group(1)), dims, args[0].shape, output.shape, kernel_size)


def classify_op(name: str, args: tuple, result: Any) -> tuple[str, int]:
    """(op_class, formula FLOPs) of one op; the formula is used only when the counter reports 0."""
    first = args[0] if args else None
    if name in _CONV_OPS:
        return "conv", 0
    if name in _SDPA_OPS:
        query, key, value = (a for a in args[:3])
        return "matmul", sdpa_flops(query.shape, key.shape, value.shape)
    if name in _MATMUL_OPS:
        # Only reached for mv/dot-like ops the counter skips: 2 x the largest operand is exact there.
        return "matmul", 2 * max((_numel(a) for a in args), default=0)
    if name in _NORM_OPS:
        return "norm", formula_flops("norm", _numel(first), 0)
    pool = _POOL_PATTERN.match(name)
    if pool:
        return "pool", _pool_flops(pool, args, result)
    if name in _SOFTMAX_OPS:
        return "elementwise", formula_flops("softmax", _numel(first), 0)
    if name in _LOSS_OPS:
        return "loss", formula_flops("loss", _numel(first), 0)
    if name in _REDUCTION_OPS:
        return "elementwise", formula_flops("reduction", _numel(first), 0)
    if name in _ZERO_FLOP_OPS:
        return "other", 0
    return "elementwise", formula_flops("pointwise", 0, max((t.numel() for t in tensors(result)), default=0))
