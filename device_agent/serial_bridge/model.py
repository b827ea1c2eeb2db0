"""A received model as the firmware runs it: the McuModel (layers, and which layer each schedule node computes)
and its parameters, from the exported program and the node grouping the job carries.

The firmware trains chains of linear and ReLU layers ending in a softmax cross-entropy (the zoo's ``mlp``);
anything else is refused here, with the op that cannot run, before a byte goes to the board.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from device_agent import protos
from device_agent.errors import UserError

mcu_pb2 = protos.load("poet.v1.mcu_pb2")

# torch ops the firmware runs, per group: what the whole group must be
_LINEAR, _RELU, _CROSS_ENTROPY = "aten.linear.default", "aten.relu.default", "aten.cross_entropy_loss.default"
_SHAPE_ONLY = {"aten.reshape.default", "aten.view.default", "aten._unsafe_view.default",
               "aten.flatten.using_ints"}  # no arithmetic
# aten.cross_entropy_loss(input, target, weight=None, reduction=Mean(1), ignore_index=-100, label_smoothing=0.0)
_CROSS_ENTROPY_OPTIONS = ("weight", "reduction", "ignore_index", "label_smoothing")
_CROSS_ENTROPY_DEFAULTS = (None, 1, -100, 0.0)


class McuModelError(UserError, ValueError):
    """The model has an op or a shape the firmware cannot train; the message names it."""


@dataclass(frozen=True)
class McuLayerParams:
    """A linear layer's parameters as the firmware stores them: ``layer`` indexes McuModel.layers."""

    layer: int
    weight_name: str  # the module's parameter names, for reading the trained values back
    bias_name: str


@dataclass(frozen=True)
class McuProgram:
    model: object  # poet.v1.McuModel
    params: tuple[McuLayerParams, ...]


def _target(node) -> str:
    return str(node.target)


def mcu_model(module: GraphModule, grouping, schedule, *, learning_rate: float, momentum: float = 0.0) -> McuProgram:
    """The McuModel for ``module`` split by ``grouping`` (poet.v1.NodeGrouping) under ``schedule``
    (device_agent.schedule.Schedule, or the TrainingGraph it was solved for: the same nodes and deps), trained
    with SGD(learning_rate, momentum)."""
    if not learning_rate > 0:
        raise McuModelError(f"the learning rate must be positive, not {learning_rate}")
    if not 0 <= momentum < 1:
        raise McuModelError(f"momentum must be in [0, 1), not {momentum}")
    nodes = {node.name: node for node in module.graph.nodes}
    parameters = dict(module.named_parameters())
    layers, params = [], []
    batch_shape = list(grouping.batch_shape)
    if len(batch_shape) != 2 or grouping.batch_dtype != "float32":
        raise McuModelError(f"the firmware takes a float32 batch of [batch, features]; this model's is "
                            f"{grouping.batch_dtype} {batch_shape}")
    for index, group in enumerate(grouping.groups):
        targets = [_target(nodes[op]) for op in group.ops]
        if index == 0:
            layers.append(mcu_pb2.McuLayer(op=mcu_pb2.MCU_LAYER_OP_INPUT, out_features=batch_shape[1]))
            continue
        arithmetic = [t for t in targets if t not in _SHAPE_ONLY]
        if group.kind == "loss":
            if arithmetic != [_CROSS_ENTROPY]:
                raise McuModelError(f"the loss must be one cross-entropy for the firmware; node {group.name!r} "
                                    f"runs {', '.join(targets)}")
            _check_cross_entropy(next(nodes[op] for op in group.ops if _target(nodes[op]) == _CROSS_ENTROPY))
            layers.append(mcu_pb2.McuLayer(op=mcu_pb2.MCU_LAYER_OP_CROSS_ENTROPY, in_features=grouping.num_classes,
                                           out_features=grouping.num_classes))
        elif arithmetic == [_LINEAR]:
            linear = next(nodes[op] for op in group.ops if _target(nodes[op]) == _LINEAR)
            weight_attr, bias_attr = (linear.args[1].target, linear.args[2].target if len(linear.args) > 2 and
                                      linear.args[2] is not None else None)
            if bias_attr is None:
                raise McuModelError(f"node {group.name!r}: the firmware's linear layers have a bias; this one has "
                                    "none (nn.Linear(..., bias=True))")
            weight = parameters[weight_attr]
            out_features, in_features = weight.shape
            params.append(McuLayerParams(len(layers), weight_attr, bias_attr))
            layers.append(mcu_pb2.McuLayer(op=mcu_pb2.MCU_LAYER_OP_LINEAR, in_features=in_features,
                                           out_features=out_features))
        elif arithmetic == [_RELU]:
            features = layers[-1].out_features
            layers.append(mcu_pb2.McuLayer(op=mcu_pb2.MCU_LAYER_OP_RELU, in_features=features,
                                           out_features=features))
        else:
            raise McuModelError(f"node {group.name!r} runs {', '.join(targets) or 'nothing'}; the firmware trains "
                                "linear, ReLU and a cross-entropy loss only (an nn.Sequential of nn.Linear and "
                                "nn.ReLU)")
    node_layer = [0] * len(schedule.nodes)
    for index, group in enumerate(grouping.groups):
        node_layer[index] = index
        if group.bwd_index >= 0:
            node_layer[group.bwd_index] = index
    _check_chain(schedule, grouping, layers)
    model = mcu_pb2.McuModel(layers=layers, node_layer=node_layer, batch_size=batch_shape[0],
                             num_classes=grouping.num_classes, learning_rate=learning_rate, momentum=momentum)
    return McuProgram(model, tuple(params))


def _check_cross_entropy(loss) -> None:
    """The firmware computes the plain mean softmax cross-entropy: no class weights, ignore_index or smoothing."""
    given = dict(zip(_CROSS_ENTROPY_OPTIONS, loss.args[2:], strict=False))
    given.update((key, value) for key, value in loss.kwargs.items() if key in _CROSS_ENTROPY_OPTIONS)
    for key, value in given.items():
        if value != _CROSS_ENTROPY_DEFAULTS[_CROSS_ENTROPY_OPTIONS.index(key)]:
            raise McuModelError(f"the cross-entropy sets {key}={value!r}; the firmware computes the plain mean over "
                                "the batch (torch.nn.functional.cross_entropy with its defaults)")


def _check_chain(schedule, grouping, layers) -> None:
    """The firmware's dependency convention (mcu.proto, McuModel) holds: a chain, forward and backward."""
    count = len(grouping.groups)
    for index in range(1, count):
        deps = tuple(schedule.nodes[index].deps)
        if deps != (index - 1,):
            raise McuModelError(f"node {schedule.nodes[index].name!r} reads {deps}; the firmware runs a chain of "
                                "layers, each reading the one before")
    for index in range(1, count):
        if layers[index - 1].out_features != layers[index].in_features:
            raise McuModelError(f"layer {index} takes {layers[index].in_features} features but gets "
                                f"{layers[index - 1].out_features}")


def parameter_tensors(module: torch.nn.Module, program: McuProgram) -> list[tuple[int, int, torch.Tensor]]:
    """(layer, tensor: 0 weight 1 bias, values) of every parameter the firmware holds, in the module's dtype."""
    named = dict(module.named_parameters())
    out = []
    for entry in program.params:
        out.append((entry.layer, 0, named[entry.weight_name].detach()))
        out.append((entry.layer, 1, named[entry.bias_name].detach()))
    return out


def load_parameters(module: torch.nn.Module, program: McuProgram, values: dict[tuple[int, int], torch.Tensor]) -> None:
    """Copy the board's trained parameters (``values[(layer, tensor)]``) into ``module``."""
    named = dict(module.named_parameters())
    with torch.no_grad():
        for entry in program.params:
            for tensor, name in ((0, entry.weight_name), (1, entry.bias_name)):
                named[name].copy_(values[(entry.layer, tensor)].reshape(named[name].shape))


__all__ = ["McuLayerParams", "McuModelError", "McuProgram", "load_parameters", "mcu_model", "parameter_tensors"]
