"""The McuModel for the firmware (device_agent/firmware/cortex_m) from a traced nn.Sequential, and a reference.

The firmware trains chains of ``nn.Linear`` (with bias) and ``nn.ReLU`` ending in a mean softmax cross-entropy,
with torch.optim.SGD (momentum allowed). :func:`mcu_spec` maps the project's traced graph
(``host.graph.trace.trace_model``) onto the firmware's layers: layer i is traced group i, and node i of the graph
(and so of every schedule solved for it) computes ``layers[node_layer[i]]``, forward or backward (mcu.proto,
McuModel). Anything else is refused with the module it cannot run. :class:`TorchReference` trains a copy of the
same module in PyTorch on the same batches, to compare parameters with the board's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from device_agent import protos

mcu_pb2 = protos.load("poet.v1.mcu_pb2")

__all__ = ["McuModelError", "McuSpec", "TorchReference", "initial_params", "max_relative_difference", "mcu_spec"]

_CROSS_ENTROPY = "aten.cross_entropy_loss.default"
_SHAPE_ONLY = {"aten.reshape.default", "aten.view.default", "aten._unsafe_view.default", "aten.flatten.using_ints"}
# aten.cross_entropy_loss(input, target, weight=None, reduction=Mean(1), ignore_index=-100, label_smoothing=0.0)
_CROSS_ENTROPY_DEFAULTS = (None, 1, -100, 0.0)


class McuModelError(ValueError):
    """The model, its loss or its graph is something the firmware cannot train; the message names what."""


@dataclass(frozen=True)
class McuSpec:
    """What the board is sent: the McuModel, and which module path each of its linear layers is."""

    model: object  # poet.v1.McuModel
    linear_paths: dict[int, str]  # McuModel layer index -> module path in the nn.Sequential ("0", "2", ...)
    node_names: tuple[str, ...]  # the graph's nodes, in order (a schedule must list the same)


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Sequential):
        raise McuModelError(f"the firmware trains an nn.Sequential of nn.Linear and nn.ReLU; this model is "
                            f"{type(module).__name__}")
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            if child.bias is None:
                raise McuModelError(f"module {name!r} is nn.Linear without a bias; the firmware's linear layers "
                                    "have one (bias=True)")
        elif not isinstance(child, nn.ReLU):
            raise McuModelError(f"module {name!r} is {type(child).__name__}; the firmware trains nn.Linear and "
                                "nn.ReLU only")
    if not any(isinstance(child, nn.Linear) for child in module.children()):
        raise McuModelError("the model has no nn.Linear layer to train")


def _check_loss(traced, group) -> None:
    nodes = {node.name: node for node in traced.graph_module.graph.nodes}
    targets = [str(nodes[name].target) if name in nodes else name for name in group.fx_nodes]
    arithmetic = [t for t in targets if t not in _SHAPE_ONLY]
    if arithmetic != [_CROSS_ENTROPY]:
        raise McuModelError(f"the loss runs {', '.join(targets) or 'nothing'}; the firmware computes one mean "
                            "softmax cross-entropy (torch.nn.functional.cross_entropy with its defaults)")
    loss = next(nodes[name] for name in group.fx_nodes if str(nodes[name].target) == _CROSS_ENTROPY)
    extra = tuple(loss.args[2:])
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    for index, value in enumerate(extra):
        if value != _CROSS_ENTROPY_DEFAULTS[index]:
            raise McuModelError(f"the cross-entropy sets {names[index]}={value!r}; the firmware computes the "
                                "plain mean over the batch (no weight, ignore_index or label smoothing)")
    for key, value in loss.kwargs.items():
        if key in names and value != _CROSS_ENTROPY_DEFAULTS[names.index(key)]:
            raise McuModelError(f"the cross-entropy sets {key}={value!r}; the firmware computes the plain mean")


def mcu_spec(traced, module: nn.Module, *, learning_rate: float, momentum: float = 0.0,
             schedule=None) -> McuSpec:
    """The McuModel for ``module`` traced as ``traced`` (host.graph.trace.TracedModel), trained with
    SGD(learning_rate, momentum). With ``schedule`` (device_agent.schedule.Schedule or poet.v1.Schedule), also
    check that it was solved for this graph (same node names, in order)."""
    _check_module(module)
    if not learning_rate > 0:
        raise McuModelError(f"learning_rate must be positive, not {learning_rate}")
    if not 0 <= momentum < 1:
        raise McuModelError(f"momentum must be in [0, 1), not {momentum}")
    graph = traced.graph
    groups = traced.groups
    layers, linear_paths = [], {}
    for index, group in enumerate(groups):
        if index == 0:
            if group.op_class != "input" or group.kind != "fwd":
                raise McuModelError(f"graph node 0 is {group.name!r} ({group.op_class}); the firmware expects the "
                                    "input batch first")
            continue
        if group.kind == "loss":
            if index != len(groups) - 1:
                raise McuModelError(f"the loss is graph node {index}, not the last forward node")
            _check_loss(traced, group)
            continue
        try:
            child = module.get_submodule(group.module_path) if group.module_path else None
        except AttributeError:
            child = None
        if isinstance(child, nn.Linear):
            linear_paths[index] = group.module_path
            layers.append((index, mcu_pb2.MCU_LAYER_OP_LINEAR, child.in_features, child.out_features))
        elif isinstance(child, nn.ReLU):
            layers.append((index, mcu_pb2.MCU_LAYER_OP_RELU, None, None))
        else:
            raise McuModelError(f"graph node {index} ({group.name!r}, module {group.module_path!r}) runs "
                                f"{group.op_class} ops that no nn.Linear or nn.ReLU of the model accounts for")
    if groups[-1].kind != "loss":
        raise McuModelError("the graph has no loss node; the firmware needs the cross-entropy loss")

    batch_size, features = (int(d) for d in _input_shape(traced, module))
    first_linear = next(child for child in module.children() if isinstance(child, nn.Linear))
    if first_linear.in_features != features:
        raise McuModelError(f"the batch has {features} features; the first nn.Linear takes {first_linear.in_features}")
    out = [mcu_pb2.McuLayer(op=mcu_pb2.MCU_LAYER_OP_INPUT, in_features=features, out_features=features)]
    width = features
    for index, op, in_features, out_features in layers:
        if index != len(out):
            raise McuModelError(f"graph node {index} does not follow layer {len(out) - 1}: the graph is not a chain")
        if op == mcu_pb2.MCU_LAYER_OP_LINEAR:
            if in_features != width:
                raise McuModelError(f"module {linear_paths[index]!r} takes {in_features} features but gets {width}")
            width = out_features
            out.append(mcu_pb2.McuLayer(op=op, in_features=in_features, out_features=out_features))
        else:
            out.append(mcu_pb2.McuLayer(op=op, in_features=width, out_features=width))
    out.append(mcu_pb2.McuLayer(op=mcu_pb2.MCU_LAYER_OP_CROSS_ENTROPY, in_features=width, out_features=width))

    node_layer = [None] * len(graph.nodes)
    for group in groups:
        node_layer[group.index] = group.index
        if group.bwd_index is not None:
            node_layer[group.bwd_index] = group.index
    missing = [graph.nodes[i].name for i, layer in enumerate(node_layer) if layer is None]
    if missing:
        raise McuModelError(f"graph nodes {missing} belong to no layer")
    for node in graph.nodes:
        layer = node_layer[node.index]
        forward = node.kind != "bwd"
        if forward and layer > 0 and tuple(node.deps) != (layer - 1,):
            raise McuModelError(f"node {node.name!r} reads nodes {node.deps}; the firmware runs a chain, each layer "
                                "reading the one before")
    names = tuple(node.name for node in graph.nodes)
    if schedule is not None:
        listed = tuple(node.name for node in schedule.nodes)
        if listed != names:
            raise McuModelError(f"the schedule lists nodes {listed}, the traced graph has {names}: it was solved "
                                "for another model or batch size")
    model = mcu_pb2.McuModel(layers=out, node_layer=node_layer, batch_size=batch_size, num_classes=width,
                             learning_rate=learning_rate, momentum=momentum)
    return McuSpec(model=model, linear_paths=linear_paths, node_names=names)


def _input_shape(traced, module) -> tuple[int, int]:
    batch = traced.graph.meta.get("batch_size")
    placeholder = next((n for n in traced.graph_module.graph.nodes if n.op == "placeholder"
                        and n.name in traced.input_names), None)
    value = placeholder.meta.get("val") if placeholder is not None else None
    shape = tuple(value.shape) if value is not None and hasattr(value, "shape") else None
    if shape is None or len(shape) != 2:
        raise McuModelError(f"the firmware takes a batch of [batch, features]; this model's input is {shape}")
    if batch is not None and int(batch) != int(shape[0]):
        raise McuModelError(f"graph batch size {batch} and input shape {shape} disagree")
    return int(shape[0]), int(shape[1])


def initial_params(spec: McuSpec, module: nn.Module) -> list[tuple[int, int, torch.Tensor]]:
    """(layer, tensor: 0 weight 1 bias, values) of every parameter the board holds, from ``module``."""
    out = []
    for layer, path in spec.linear_paths.items():
        linear = module.get_submodule(path)
        out.append((layer, 0, linear.weight.detach().clone()))
        out.append((layer, 1, linear.bias.detach().clone()))
    return out


class TorchReference:
    """PyTorch training of a copy of ``module`` as the board trains it: loss_fn, then SGD(lr, momentum)."""

    def __init__(self, spec: McuSpec, module: nn.Module, loss_fn) -> None:
        self.spec = spec
        self.module = copy.deepcopy(module).to(torch.float32)
        self.loss_fn = loss_fn
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=float(spec.model.learning_rate),
                                         momentum=float(spec.model.momentum))

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.module(inputs), labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def params(self) -> dict[tuple[int, int], torch.Tensor]:
        """{(layer, tensor): flat float32 values}, as McuBoard.read_params() returns the board's."""
        return {(layer, tensor): values.reshape(-1) for layer, tensor, values in initial_params(self.spec, self.module)}


def max_relative_difference(board: dict, reference: dict) -> float:
    """Max over tensors of max|board - reference| / max|reference| (each tensor against its own scale)."""
    if set(board) != set(reference):
        raise ValueError(f"the board holds tensors {sorted(board)}, the reference {sorted(reference)}")
    worst = 0.0
    for key, expected in reference.items():
        got = board[key].reshape(-1).to(torch.float64)
        want = expected.reshape(-1).to(torch.float64)
        if got.shape != want.shape:
            raise ValueError(f"tensor {key}: board has {tuple(got.shape)} values, reference {tuple(want.shape)}")
        scale = float(want.abs().max()) or 1.0
        worst = max(worst, float((got - want).abs().max()) / scale)
    return worst
