"""The POET paper code's own training graphs (``poet2022:<name>``), rebuilt number for number.

The public POET code (ICML 2022) describes each network as a list of layer objects, appends a
linearised backward chain of ``GradientLayer`` nodes, and turns the list into a checkmate ``DFGraph``.
This module re-expresses those layer lists with small descriptions of its own and reproduces:

* the per-layer FLOP formulas and parameter counts (integers, exactly as the paper's formulas give),
* output bytes ``prod(out_shape) * 4`` (a ``GradientLayer`` has the shape of its first input),
* the dependency edges (``depends_on`` of every layer),
* the node order of ``GraphBuilder.make_graph``: ``toposort`` peels the graph from its sink, so a
  node's position is set by its longest path to the sink (longest first).  Nodes tied on that length
  come out in the iteration order of a set of random ``uuid4`` keys in the paper code, i.e. in no fixed
  order; here ties are broken by the layer-list index.  Only ``resnet18_cifar`` has ties (its
  shortcut convolution branch); every other graph has a unique order, equal to the layer list.

The paper's batch-size handling is kept: ``linear``, ``bert`` and ``transformer`` ignore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from device_agent.errors import UserError
from host.graph.training_graph import GraphBuilder, TrainingGraph

POET2022_MODELS: tuple[str, ...] = (
    "linear",
    "vgg16",
    "vgg16_cifar",
    "resnet18",
    "resnet18_cifar",
    "resnet50",
    "bert",
    "transformer",
)

BYTES_PER_VALUE = 4  # the paper's device["TYPE"]: float32
_BATCH_IGNORED = frozenset({"linear", "bert", "transformer"})
_PARAM_NOTE = "poet2022 graphs count only parameter bytes, as the paper code does"


class UnknownPoet2022ModelError(UserError, KeyError):
    """A ``poet2022`` model name that the paper code does not define."""

    def __init__(self, name: str):
        super().__init__(f"unknown poet2022 model {name!r}; valid names: {', '.join(POET2022_MODELS)}")


@dataclass(frozen=True)
class _Layer:
    """One paper layer: class name, output shape, FLOPs, parameter count and deps (list indices)."""

    class_name: str
    out_shape: tuple[int, ...]
    flops: int
    param_count: int
    deps: tuple[int, ...]
    op_class: str
    grad_of: int | None = None  # GradientLayer: list index of the layer whose gradient it computes


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class _Net:
    """Appends paper layers to a list; each method returns the new layer's list index."""

    def __init__(self) -> None:
        self.layers: list[_Layer] = []

    def shape(self, idx: int) -> tuple[int, ...]:
        return self.layers[idx].out_shape

    @property
    def last(self) -> int:
        return len(self.layers) - 1

    def _add(self, class_name: str, out_shape, flops: int, param_count: int, deps, op_class: str, grad_of=None) -> int:
        shape = tuple(int(d) for d in out_shape)
        self.layers.append(_Layer(class_name, shape, int(flops), int(param_count), tuple(deps), op_class, grad_of))
        return self.last

    # ---------------------------------------------------------------- poet/power_computation.py
    def input(self, shape: tuple[int, ...]) -> int:
        return self._add("InputLayer", shape, 0, 0, (), "input")

    def linear(self, in_features: int, out_features: int, x: int) -> int:
        batch, width = self.shape(x)
        assert width == in_features, (self.shape(x), in_features)
        params = (in_features + 1) * out_features
        # The paper's FLOPs do not scale with the leading (batch / sequence) dimension.
        return self._add("LinearLayer", (batch, out_features), 2 * params + out_features, params, (x,), "matmul")

    def conv(self, in_ch: int, out_ch: int, kernel: tuple[int, int], stride: int, pad: tuple[int, int], x: int) -> int:
        batch, channels, height, width = self.shape(x)
        assert channels == in_ch, (self.shape(x), in_ch)
        out_shape = (
            batch,
            out_ch,
            (height - kernel[0] + 2 * pad[0]) // stride + 1,
            (width - kernel[1] + 2 * pad[1]) // stride + 1,
        )
        params = out_ch * in_ch * kernel[0] * kernel[1] + out_ch
        # Counted on the INPUT size (stride ignored), plus one add per output (bias).
        flops = 2 * (kernel[0] * kernel[1] * _numel(self.shape(x)) * out_ch) + _numel(out_shape)
        return self._add("Conv2dLayer", out_shape, flops, params, (x,), "conv")

    def batchnorm(self, x: int) -> int:
        shape = self.shape(x)
        return self._add("BatchNorm2d", shape, 2 * _numel(shape), 4 * shape[1], (x,), "norm")

    def relu(self, x: int) -> int:
        shape = self.shape(x)
        return self._add("ReLULayer", shape, _numel(shape), 0, (x,), "elementwise")

    def _pool(self, class_name: str, kernel: tuple[int, int], stride: int, x: int) -> int:
        batch, channels, height, width = self.shape(x)
        out_shape = (batch, channels, (height - kernel[0]) // stride + 1, (width - kernel[1]) // stride + 1)
        flops = 2 * (kernel[0] * kernel[1] * _numel(out_shape))
        return self._add(class_name, out_shape, flops, 0, (x,), "pool")

    def maxpool(self, kernel: tuple[int, int], stride: int, x: int) -> int:
        return self._pool("MaxPool2d", kernel, stride, x)

    def avgpool(self, kernel: tuple[int, int], stride: int, x: int) -> int:
        return self._pool("AvgPool2d", kernel, stride, x)

    def flatten(self, x: int) -> int:
        shape = self.shape(x)
        out_shape = (shape[0], _numel(shape[1:]))
        return self._add("FlattenLayer", out_shape, _numel(out_shape), 0, (x,), "other")

    def dropout(self, x: int) -> int:
        shape = self.shape(x)
        return self._add("DropoutLayer", shape, _numel(shape), 0, (x,), "elementwise")

    def skip_add(self, x1: int, x2: int) -> int:
        shape = self.shape(x1)  # the paper takes the first input's shape, even when sizes differ
        return self._add("SkipAddLayer", shape, _numel(shape), 0, (x1, x2), "elementwise")

    def loss(self, x: int, n_classes: int) -> int:
        flops = _numel(self.shape(x)) * n_classes
        return self._add("CrossEntropyLoss", (n_classes,), flops, 0, (x,), "loss")

    # ---------------------------------------------------------------- poet/power_computation_transformer.py
    def qkv(self, seq_len: int, hidden_dim: int, head_dim: int, heads: int, x: int) -> int:
        """QueryKeyValueMatrix: fused Q, K and V projections."""
        params = 3 * hidden_dim * head_dim * heads
        flops = 3 * seq_len * hidden_dim * head_dim * heads
        return self._add("QueryKeyValueMatrix", (3 * seq_len, head_dim, heads), flops, params, (x,), "matmul")

    def qkt(self, seq_len: int, head_dim: int, heads: int, x: int) -> int:
        """QKTMatrix as BERTBase calls it: Q K^T per head, plus mask and dropout."""
        out_shape = (seq_len, seq_len, heads)
        flops = seq_len * head_dim * seq_len * heads + 2 * _numel(out_shape)
        return self._add("QKTMatrix", out_shape, flops, 0, (x,), "matmul")

    def qktv(self, seq_len: int, head_dim: int, heads: int, x: int) -> int:
        """QKTVMatrix as BERTBase calls it: (Q K^T) V per head, plus the head concat."""
        flops = 2 * (seq_len * seq_len * head_dim * heads)
        return self._add("QKTVMatrix", (seq_len, head_dim * heads), flops, 0, (x,), "matmul")

    def linear_relu(self, in_features: int, out_features: int, x: int) -> int:
        rows, width = self.shape(x)
        assert width == in_features, (self.shape(x), in_features)
        params = (in_features + 1) * out_features
        out_shape = (rows, out_features)
        flops = 2 * params + out_features + _numel(out_shape)
        return self._add("LinearLayerReLU", out_shape, flops, params, (x,), "matmul")

    # ---------------------------------------------------------------- backward chain
    def add_backward_chain(self) -> None:
        """GradientLayer(output=L[k-1], inputs=[L[k]], grad_outputs=last) for k = n-1 .. 1."""
        n_forward = len(self.layers)
        for k in range(n_forward - 1, 0, -1):
            output, grad_input = k - 1, k
            prev = self.last  # the loss itself for the first gradient node
            self._add(
                "GradientLayer",
                self.shape(grad_input),
                2 * self.layers[output].flops,
                0,
                (output, grad_input, prev),
                self.layers[output].op_class,
                grad_of=output,
            )


# -------------------------------------------------------------------- poet/architectures/*
def _linear_net() -> _Net:
    net = _Net()
    net.input((1, 784))  # get_chipset_and_net calls make_linear_network() without a batch size
    for in_dim, out_dim in ((784, 10), (10, 120), (120, 100), (100, 200), (200, 10), (10, 10)):
        net.relu(net.linear(in_dim, out_dim, net.last))
    net.loss(net.last, 10)
    return net


def _vgg16_net(batch_size: int, num_classes: int = 1000, input_chw: tuple[int, int, int] = (3, 224, 224)) -> _Net:
    net = _Net()
    net.input((batch_size, *input_chw))
    stages = ((3, 64, 64), (64, 128, 128), (128, 256, 256, 256), (256, 512, 512, 512), (512, 512, 512, 512))
    for stage in stages:
        for in_ch, out_ch in zip(stage[:-1], stage[1:], strict=True):
            net.relu(net.conv(in_ch, out_ch, (3, 3), 1, (1, 1), net.last))
        net.maxpool((2, 2), 2, net.last)
    net.flatten(net.last)
    # The paper writes 512 * H / 32 * W / 32 (a float equal to this integer for these inputs).
    flat_features = 512 * input_chw[1] * input_chw[2] // (32 * 32)
    net.relu(net.linear(flat_features, 4096, net.last))
    net.dropout(net.last)
    net.relu(net.linear(4096, 4096, net.last))
    net.dropout(net.last)
    net.linear(4096, num_classes, net.last)
    net.loss(net.last, num_classes)
    return net


def _resnet_stem(net: _Net, batch_size: int) -> None:
    net.input((batch_size, 3, 224, 224))
    net.conv(3, 64, (7, 7), 2, (3, 3), net.last)
    net.batchnorm(net.last)
    net.maxpool((3, 3), 2, net.last)  # no padding: 112 -> 55 (the paper's comment says 56)


def _resnet_head(net: _Net, features: int, num_classes: int, pool: int) -> None:
    net.avgpool((pool, pool), 1, net.last)
    net.flatten(net.last)
    net.linear(features, num_classes, net.last)
    net.loss(net.last, num_classes)


def _resnet18_net(batch_size: int, num_classes: int = 1000) -> _Net:
    net = _Net()
    _resnet_stem(net, batch_size)
    plan = (
        (64, 64, 1),
        (64, 64, 1),
        (64, 128, 2),
        (128, 128, 1),
        (128, 256, 2),
        (256, 256, 1),
        (256, 512, 2),
        (512, 512, 1),
    )
    for in_planes, planes, stride in plan:
        conv1 = net.conv(in_planes, planes, (3, 3), stride, (1, 1), net.last)
        relu1 = net.relu(net.batchnorm(conv1))
        bn2 = net.batchnorm(net.conv(planes, planes, (3, 3), 1, (1, 1), relu1))
        net.relu(net.skip_add(relu1, bn2))  # the paper adds relu1, not the block input
    _resnet_head(net, 512, num_classes, 7)
    return net


def _resnet50_net(batch_size: int, num_classes: int = 1000) -> _Net:
    net = _Net()
    _resnet_stem(net, batch_size)
    stages = ((64, 256, 3), (128, 512, 4), (256, 1024, 6), (512, 2048, 3))
    in_planes = 64
    for stage_idx, (planes_1, planes_2, n_blocks) in enumerate(stages):
        for block in range(n_blocks):
            stride = 2 if stage_idx > 0 and block == 0 else 1
            conv1 = net.conv(in_planes, planes_1, (1, 1), stride, (0, 0), net.last)
            relu1 = net.relu(net.batchnorm(conv1))
            relu2 = net.relu(net.batchnorm(net.conv(planes_1, planes_1, (3, 3), 1, (1, 1), relu1)))
            bn3 = net.batchnorm(net.conv(planes_1, planes_2, (1, 1), 1, (0, 0), relu2))
            net.relu(net.skip_add(bn3, relu1))
            in_planes = planes_2
    _resnet_head(net, 2048, num_classes, 7)
    return net


def _resnet18_cifar_net(batch_size: int, num_classes: int = 10) -> _Net:
    net = _Net()
    net.input((batch_size, 3, 32, 32))
    net.conv(3, 16, (3, 3), 1, (1, 1), net.last)
    net.batchnorm(net.last)
    for in_planes, planes, stride in ((16, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1)):
        x = net.last
        relu1 = net.relu(net.batchnorm(net.conv(in_planes, planes, (3, 3), stride, (1, 1), x)))
        relu2 = net.relu(net.batchnorm(net.conv(planes, planes, (3, 3), 1, (1, 1), relu1)))
        bn3 = net.batchnorm(net.conv(in_planes, planes, (3, 3), stride, (1, 1), x))  # shortcut branch
        net.relu(net.skip_add(relu2, bn3))
    _resnet_head(net, 64, num_classes, 8)
    return net


def _bert_net(blocks: int, seq_len: int = 512, hidden_dim: int = 768, head_dim: int = 64, heads: int = 12) -> _Net:
    net = _Net()
    net.input((seq_len, hidden_dim))  # no batch dimension in the paper's BERTBase
    for _ in range(blocks):
        block_in = net.last
        net.qkv(seq_len, hidden_dim, head_dim, heads, block_in)
        net.qkt(seq_len, head_dim, heads, net.last)
        net.qktv(seq_len, head_dim, heads, net.last)
        attn_out = net.linear(head_dim * heads, hidden_dim, net.last)
        skip1 = net.skip_add(block_in, attn_out)
        ffn_out = net.linear(4 * hidden_dim, hidden_dim, net.linear_relu(hidden_dim, 4 * hidden_dim, skip1))
        net.skip_add(attn_out, ffn_out)  # the paper's layers[-4]: the attention projection, not skip1
    net.loss(net.last, seq_len)
    return net


def _paper_net(name: str, batch_size: int) -> _Net:
    builders = {
        "linear": _linear_net,
        "vgg16": lambda: _vgg16_net(batch_size),
        "vgg16_cifar": lambda: _vgg16_net(batch_size, 10, (3, 32, 32)),
        "resnet18": lambda: _resnet18_net(batch_size),
        "resnet18_cifar": lambda: _resnet18_cifar_net(batch_size, 10),
        "resnet50": lambda: _resnet50_net(batch_size),
        "bert": lambda: _bert_net(12),
        "transformer": lambda: _bert_net(1),
    }
    net = builders[name]()
    net.add_backward_chain()
    return net


# -------------------------------------------------------------------- DFGraph order
def _dfgraph_order(layers: list[_Layer]) -> list[int]:
    """Layer-list indices in make_graph's topological order (ties by list index)."""
    successors: list[set[int]] = [set() for _ in layers]
    has_edge = [False] * len(layers)
    for idx, layer in enumerate(layers):
        for dep in layer.deps:
            successors[dep].add(idx)
            has_edge[dep] = has_edge[idx] = True
    # toposort peels sinks first; make_graph reverses, so longest path to a sink comes first.
    height = [0] * len(layers)
    for idx in range(len(layers) - 1, -1, -1):  # deps point to earlier list entries
        if successors[idx]:
            height[idx] = 1 + max(height[s] for s in successors[idx])
    isolated = [i for i in range(len(layers)) if not has_edge[i]]  # make_graph puts these first
    connected = sorted((i for i in range(len(layers)) if has_edge[i]), key=lambda i: (-height[i], i))
    return isolated + connected


def build_poet2022_graph(name: str, batch_size: int = 1) -> TrainingGraph:
    """Build the paper code's graph ``name`` (a POET2022_MODELS entry; a ``poet2022:`` prefix is accepted)."""
    key = name.removeprefix("poet2022:")
    if key not in POET2022_MODELS:
        raise UnknownPoet2022ModelError(name)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")

    layers = _paper_net(key, batch_size).layers
    names = [f"layer{idx}_{layer.class_name}" for idx, layer in enumerate(layers)]
    builder = GraphBuilder(f"poet2022:{key}")
    for idx in _dfgraph_order(layers):
        layer = layers[idx]
        if layer.class_name == "GradientLayer":
            kind = "bwd"
        elif layer.class_name == "CrossEntropyLoss":
            kind = "loss"
        else:
            kind = "fwd"
        builder.add(
            names[idx],
            kind,
            output_bytes=_numel(layer.out_shape) * BYTES_PER_VALUE,
            flops=layer.flops,
            deps=[names[d] for d in layer.deps],
            op_class=layer.op_class,
            forward_of=names[layer.grad_of] if layer.grad_of is not None else None,
        )
    graph = builder.build(param_bytes=sum(layer.param_count for layer in layers) * BYTES_PER_VALUE)
    graph.meta.update(
        {
            "source": "poet2022",
            "batch_size": batch_size,
            "param_bytes_note": _PARAM_NOTE,
        }
    )
    if key in _BATCH_IGNORED:
        graph.meta["batch_size_note"] = "the paper code builds this model without a batch size (batch 1 / one sequence)"
    return graph
