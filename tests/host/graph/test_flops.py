"""FLOPs per op, forward and backward, as traced, against the formulas documented in host/graph/flops.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from host.graph.flops import flop_counter, rnn_layer_flops
from host.graph.trace import trace_model
from host.graph.zoo import ModelBundle


class Scale(nn.Module):
    """Multiplies each float input by a parameter, so the op under test gets an input that needs a gradient."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.full((count,), 1.5))

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x * self.s[i] if x.is_floating_point() else x for i, x in enumerate(xs))


class Harness(nn.Module):
    """``op(*scale(*inputs))``; the op's node (or, for a recurrent layer, its per-step nodes) is named ``op``."""

    def __init__(self, op: nn.Module, count: int = 1) -> None:
        super().__init__()
        self.scale = Scale(count)
        self.op = op

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.op(*self.scale(*xs))
        return out[0] if isinstance(out, tuple) else out


class Fn(nn.Module):
    """A functional op as a module (a leaf, so its node is named after it)."""

    def __init__(self, fn, *params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.weights = nn.ParameterList(params) if params else None

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs, *(self.weights or ()))


def op_flops(op: nn.Module, *inputs: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) FLOPs of the nodes of ``op`` in the traced training graph."""
    torch.manual_seed(0)
    floats = sum(x.is_floating_point() for x in inputs)
    bundle = ModelBundle("op", Harness(op, max(floats, 1)), inputs, torch.zeros(()),
                         lambda out, labels: out.float().square().mean())
    graph = trace_model(bundle, granularity="layer").graph
    ours = [n for n in graph.nodes if n.name.split(".")[0] in ("op", "bwd:op")]
    assert ours, [n.name for n in graph.nodes]
    return sum(n.flops for n in ours if n.kind != "bwd"), sum(n.flops for n in ours if n.kind == "bwd")


def _conv(n: int, out_spatial: int, weight: tuple[int, ...]) -> int:
    """2·N·prod(output spatial)·numel(W)."""
    return 2 * n * out_spatial * torch.Size(weight).numel()


B, T, IN, H = 3, 5, 6, 8  # recurrent: batch, steps, input, hidden

# name, op factory, inputs, forward FLOPs, backward FLOPs (from the formulas in host/graph/flops.py)
CASES = [
    ("conv dense", lambda: nn.Conv2d(8, 16, 3, padding=1), [(2, 8, 10, 10)],
     _conv(2, 100, (16, 8, 3, 3)), 2 * _conv(2, 100, (16, 8, 3, 3))),
    ("conv groups=4 stride 2", lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=4), [(2, 8, 10, 10)],
     _conv(2, 25, (16, 2, 3, 3)), 2 * _conv(2, 25, (16, 2, 3, 3))),
    ("conv depthwise", lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), [(2, 8, 10, 10)],
     _conv(2, 100, (8, 1, 3, 3)), 2 * _conv(2, 100, (8, 1, 3, 3))),
    ("conv depthwise stride 2 multiplier 2", lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=8),
     [(2, 8, 10, 10)], _conv(2, 25, (16, 1, 3, 3)), 2 * _conv(2, 25, (16, 1, 3, 3))),
    ("conv dilation 2 no padding", lambda: nn.Conv2d(4, 4, 3, dilation=2), [(1, 4, 9, 9)],
     _conv(1, 25, (4, 4, 3, 3)), 2 * _conv(1, 25, (4, 4, 3, 3))),
    ("conv1d padding 2", lambda: nn.Conv1d(3, 5, 5, padding=2), [(2, 3, 16)],
     _conv(2, 16, (5, 3, 5)), 2 * _conv(2, 16, (5, 3, 5))),
    ("conv transposed (input positions)", lambda: nn.ConvTranspose2d(4, 6, 3, stride=2), [(1, 4, 5, 5)],
     _conv(1, 25, (4, 6, 3, 3)), 2 * _conv(1, 25, (4, 6, 3, 3))),
    ("linear", lambda: nn.Linear(12, 7), [(5, 12)], 2 * 5 * 12 * 7, 4 * 5 * 12 * 7),
    ("linear 3-d input", lambda: nn.Linear(12, 7), [(2, 5, 12)], 2 * 10 * 12 * 7, 4 * 10 * 12 * 7),
    ("bmm", lambda: Fn(torch.bmm, torch.randn(3, 6, 4)), [(3, 5, 6)], 2 * 3 * 5 * 6 * 4, 4 * 3 * 5 * 6 * 4),
    ("matmul broadcast", lambda: Fn(torch.matmul, torch.randn(6, 4)), [(2, 3, 5, 6)],
     2 * 6 * 5 * 6 * 4, 4 * 6 * 5 * 6 * 4),
    ("baddbmm", lambda: Fn(lambda x, b, w: torch.baddbmm(b, x, w), torch.randn(3, 5, 4), torch.randn(3, 6, 4)),
     [(3, 5, 6)], 2 * 3 * 5 * 6 * 4, 4 * 3 * 5 * 6 * 4),
    # 4·B·H·L·S·E forward; backward 5 bmm with the scores recomputed: 10·B·H·L·S·E
    ("scaled dot-product attention", lambda: Fn(F.scaled_dot_product_attention), [(2, 3, 8, 16)] * 3,
     4 * 2 * 3 * 8 * 8 * 16, 10 * 2 * 3 * 8 * 8 * 16),
    ("embedding (backward: scatter-add)", lambda: nn.Embedding(50, 8), ["tokens"], 0, 4 * 6 * 8),
    ("layer norm", lambda: nn.LayerNorm(10), [(4, 10)], 5 * 40, 10 * 40),
    ("batch norm", lambda: nn.BatchNorm2d(4, track_running_stats=False), [(2, 4, 5, 5)], 5 * 200, 10 * 200),
    ("group norm", lambda: nn.GroupNorm(2, 4), [(2, 4, 5, 5)], 5 * 200, 10 * 200),
    ("max pool", lambda: nn.MaxPool2d(2), [(2, 3, 8, 8)], 4 * 96, 8 * 96),
    ("avg pool 3x3 stride 1", lambda: nn.AvgPool2d(3, stride=1, padding=1), [(2, 3, 8, 8)], 9 * 384, 18 * 384),
    ("adaptive avg pool", lambda: nn.AdaptiveAvgPool2d(1), [(2, 3, 8, 8)], 64 * 6, 128 * 6),
    ("relu", nn.ReLU, [(4, 10)], 40, 80),
    ("gelu", nn.GELU, [(4, 10)], 40, 80),
    ("softmax", lambda: nn.Softmax(-1), [(4, 10)], 5 * 40, 10 * 40),
    # Recurrent, per layer and direction (rnn_layer_flops): the backward is 2 x, less the gradient of the
    # constant initial state (2·B·G·H·H_r per layer and direction).
    ("lstm", lambda: nn.LSTM(IN, H, batch_first=True), [(B, T, IN)],
     rnn_layer_flops("lstm", T * B, IN, H), 2 * rnn_layer_flops("lstm", T * B, IN, H) - 2 * B * 4 * H * H),
    ("gru", lambda: nn.GRU(IN, H), [(T, B, IN)],
     rnn_layer_flops("gru", T * B, IN, H), 2 * rnn_layer_flops("gru", T * B, IN, H) - 2 * B * 3 * H * H),
    ("lstm 2 layers bidirectional", lambda: nn.LSTM(IN, H, num_layers=2, bidirectional=True), [(T, B, IN)],
     2 * rnn_layer_flops("lstm", T * B, IN, H) + 2 * rnn_layer_flops("lstm", T * B, 2 * H, H),
     2 * (2 * rnn_layer_flops("lstm", T * B, IN, H) + 2 * rnn_layer_flops("lstm", T * B, 2 * H, H))
     - 4 * 2 * B * 4 * H * H),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "shapes", "forward", "backward"), CASES, ids=[c[0] for c in CASES])
def test_traced_flops_match_the_documented_formula(name, make, shapes, forward, backward):
    torch.manual_seed(0)
    inputs = tuple(torch.randint(0, 50, (4, 6)) if s == "tokens" else torch.randn(*s) for s in shapes)
    assert op_flops(make(), *inputs) == (forward, backward)


def test_depthwise_backward_costs_what_its_forward_costs_twice_not_c_in_times_more():
    """The counter's own formula prices a depthwise conv's weight gradient C_in x too high (65x at C = 32)."""
    conv = nn.Conv2d(32, 32, 3, padding=1, groups=32)
    x = torch.randn(2, 32, 16, 16, requires_grad=True)
    with flop_counter() as counter:
        out = conv(x)
    forward = counter.get_total_flops()
    with flop_counter() as counter:
        out.sum().backward()
    assert forward == _conv(2, 256, (32, 1, 3, 3))
    assert counter.get_total_flops() == 2 * forward


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the fused CPU LSTM kernel needs oneDNN")
@pytest.mark.parametrize("bidirectional", [False, True])
def test_an_eager_fused_lstm_is_priced_by_the_same_formula(bidirectional):
    """Eager nn.LSTM on CPU runs one oneDNN kernel per layer and direction, which torch's counter prices at 0."""
    lstm = nn.LSTM(IN, H, batch_first=True, bidirectional=bidirectional)
    x = torch.randn(B, T, IN, requires_grad=True)
    with flop_counter() as counter:
        out, _ = lstm(x)
    forward = counter.get_total_flops()
    with flop_counter() as counter:
        out.sum().backward()
    directions = 2 if bidirectional else 1
    assert forward == directions * rnn_layer_flops("lstm", T * B, IN, H)
    assert counter.get_total_flops() == 2 * forward


def test_an_lstm_costs_more_than_a_gru_of_the_same_size():
    """4 gates against 3: an LSTM was priced at a sixth of the GRU (the fused kernel counted 0)."""
    lstm, _ = op_flops(nn.LSTM(IN, H, batch_first=True), torch.randn(B, T, IN))
    gru, _ = op_flops(nn.GRU(IN, H, batch_first=True), torch.randn(B, T, IN))
    assert 1.2 < lstm / gru < 1.4
