"""Models users bring: resolve a ``--model module:callable`` string to a :class:`ModelBundle`.

The callable is imported and called with no arguments. It may return

* an ``nn.Module``: the caller supplies ``--input-shape`` (batch first); inputs are seeded randn,
  labels are seeded class indices for the output's last dimension, the loss is cross-entropy;
* a :class:`ModelBundle`: used as is (the factory chooses inputs, labels and loss);
* a dict with ``module`` and optionally ``inputs`` (a tensor or a tuple of tensors; else made from
  ``--input-shape``), ``labels``, ``loss_fn`` and ``name``; missing entries get the bare-module defaults.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from device_agent.errors import UserError
from host.graph.zoo import ModelBundle, default_loss, output_tensor, seeded_labels

__all__ = ["ModelSourceError", "load_factory_bundle", "parse_input_shape"]

_DICT_KEYS = ("module", "inputs", "labels", "loss_fn", "name")


class ModelSourceError(UserError, ValueError):
    """A ``--model module:callable`` or ``--input-shape`` value that cannot be turned into a model bundle."""


def parse_input_shape(text: str) -> tuple[int, ...]:
    """Parse a comma-separated ``--input-shape`` such as ``"32,64"`` (batch dimension first) into a tuple."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ModelSourceError(
            f"--input-shape {text!r}: expected comma-separated positive integers, batch first, e.g. 32,64"
        )
    shape: list[int] = []
    for part in parts:
        try:
            size = int(part)
        except ValueError:
            raise ModelSourceError(
                f"--input-shape {text!r}: {part!r} is not an integer (expected e.g. 32,64)"
            ) from None
        if size <= 0:
            raise ModelSourceError(f"--input-shape {text!r}: every dimension must be positive, got {size}")
        shape.append(size)
    return tuple(shape)


def load_factory_bundle(spec: str, input_shape: tuple[int, ...] | None, seed: int = 0) -> ModelBundle:
    """Import ``module:callable``, call it and turn the result into a :class:`ModelBundle`.

    The factory runs with the torch RNG seeded by ``seed`` (the caller's RNG state is restored), so
    its weights are reproducible. ``input_shape`` (batch first) is needed only when it returns a bare
    module; when it returns its own inputs, a given ``input_shape`` must match the first input.
    """
    factory = _resolve_callable(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            result = factory()
        except Exception as error:
            raise ModelSourceError(f"model factory {spec!r} raised {type(error).__name__}: {error}") from error

    if isinstance(result, ModelBundle):
        bundle = result
    elif isinstance(result, nn.Module):
        if input_shape is None:
            raise ModelSourceError(
                f"model factory {spec!r} returned a bare nn.Module, so the input shape is unknown: "
                "pass --input-shape with the batch dimension first, e.g. --input-shape 32,64"
            )
        bundle = _bundle_from_parts(spec, {"module": result}, input_shape, seed)
    elif isinstance(result, Mapping):
        bundle = _bundle_from_parts(spec, result, input_shape, seed)
    else:
        raise ModelSourceError(
            f"model factory {spec!r} returned {type(result).__name__}; expected an nn.Module, a ModelBundle "
            "or a dict with 'module' and 'inputs'"
        )

    _check_bundle(spec, bundle)
    if input_shape is not None and tuple(bundle.inputs[0].shape) != tuple(input_shape):
        raise ModelSourceError(
            f"model factory {spec!r} supplies inputs of shape {tuple(bundle.inputs[0].shape)}, but --input-shape "
            f"is {tuple(input_shape)}; drop --input-shape or make them agree"
        )
    return bundle


# ----------------------------------------------------------------------------- helpers
def _resolve_callable(spec: str) -> Callable[[], Any]:
    """The object named by ``module:attr`` (``attr`` may be dotted, e.g. ``Net.create``); it must be callable."""
    module_name, colon, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not colon or not module_name or not attr_path:
        raise ModelSourceError(
            f"--model {spec!r} is not a zoo model; a custom model is given as 'module:callable', "
            "e.g. mypkg.models:make_net"
        )
    try:
        module = _import_from_here(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise ModelSourceError(
                f"cannot import module {module_name!r} for --model {spec!r}: not found; check that its "
                "directory is on PYTHONPATH (or run from that directory)"
            ) from error
        raise ModelSourceError(
            f"importing module {module_name!r} failed: it needs {missing!r}, which is not installed"
        ) from error
    except Exception as error:
        raise ModelSourceError(f"importing module {module_name!r} raised {type(error).__name__}: {error}") from error

    target: Any = module
    walked: list[str] = []
    for attr in attr_path.split("."):
        walked.append(attr)
        if not hasattr(target, attr):
            raise ModelSourceError(
                f"module {module_name!r} has no attribute {'.'.join(walked)!r} (from --model {spec!r})"
            )
        target = getattr(target, attr)
    if not callable(target):
        raise ModelSourceError(f"{spec!r} names a {type(target).__name__}, not a callable model factory")
    return target


def _import_from_here(module_name: str):
    """Import ``module_name``; when it is not found, look in the current directory too.

    The `poet` console script's ``sys.path`` starts with its own bin directory, not the current one, so
    ``--model mymodel:make`` run next to ``mymodel.py`` would not find it. The current directory is
    appended (never prepended: it must not shadow installed packages) only when the import fails.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        top = module_name.partition(".")[0]
        if error.name != top or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)


def _bundle_from_parts(
    spec: str, parts: Mapping[str, Any], input_shape: tuple[int, ...] | None, seed: int
) -> ModelBundle:
    """Fill in a bundle from a factory's parts; missing inputs come from ``input_shape`` (seeded randn),
    missing labels from probing the output shape, a missing loss is cross-entropy."""
    unknown = sorted(set(parts) - set(_DICT_KEYS))
    if unknown:
        raise ModelSourceError(
            f"model factory {spec!r} returned unknown dict keys {unknown}; allowed: {list(_DICT_KEYS)}"
        )
    module = parts.get("module")
    if not isinstance(module, nn.Module):
        raise ModelSourceError(f"model factory {spec!r}: 'module' must be an nn.Module, got {type(module).__name__}")

    if parts.get("inputs") is not None:
        inputs = _as_input_tuple(spec, parts["inputs"])
    elif input_shape is not None:
        generator = torch.Generator().manual_seed(seed)
        inputs = (torch.randn(tuple(input_shape), generator=generator, dtype=torch.float32),)
    else:
        raise ModelSourceError(
            f"model factory {spec!r} returned a dict without 'inputs': add a tensor (or tuple of tensors) under "
            "'inputs', or pass --input-shape with the batch dimension first, e.g. --input-shape 32,64"
        )

    labels = parts.get("labels")
    if labels is None:
        labels = seeded_labels(_probe_output_shape(spec, module, inputs), seed)
    loss_fn = parts.get("loss_fn") or default_loss
    name = parts.get("name") or spec
    return ModelBundle(name=str(name), module=module, inputs=inputs, labels=labels, loss_fn=loss_fn)


def _as_input_tuple(spec: str, inputs: Any) -> tuple[torch.Tensor, ...]:
    """A tensor or a sequence of tensors as the tuple of forward() arguments."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, Sequence) and inputs and all(isinstance(item, torch.Tensor) for item in inputs):
        return tuple(inputs)
    raise ModelSourceError(f"model factory {spec!r}: 'inputs' must be a tensor or a non-empty tuple of tensors")


def _probe_output_shape(spec: str, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """Run the module once to learn its output shape for the labels.

    The probe runs in eval mode under no_grad so BatchNorm running statistics are not updated; the
    module's train/eval flags are restored afterwards.
    """
    modes = {submodule: submodule.training for submodule in module.modules()}
    try:
        module.eval()
        with torch.no_grad():
            output = output_tensor(module(*inputs))
    except Exception as error:
        raise ModelSourceError(
            f"running the model from {spec!r} on inputs of shape {[tuple(t.shape) for t in inputs]} failed "
            f"({type(error).__name__}: {error}); check --input-shape (batch dimension first)"
        ) from error
    finally:
        for submodule, training in modes.items():
            submodule.training = training
    if not isinstance(output, torch.Tensor) or output.dim() < 1:
        raise ModelSourceError(
            f"the model from {spec!r} must return one tensor with classes on its last dimension to get default "
            f"labels, but it returned {type(output).__name__}; return a ModelBundle or a dict with 'labels' and 'loss_fn'"
        )
    return tuple(output.shape)


def _check_bundle(spec: str, bundle: ModelBundle) -> None:
    """Reject a bundle whose fields have the wrong types, naming the factory."""
    if not isinstance(bundle.module, nn.Module):
        raise ModelSourceError(
            f"model factory {spec!r}: bundle.module is {type(bundle.module).__name__}, not an nn.Module"
        )
    if (
        not isinstance(bundle.inputs, tuple)
        or not bundle.inputs
        or not all(isinstance(t, torch.Tensor) for t in bundle.inputs)
    ):
        raise ModelSourceError(f"model factory {spec!r}: bundle.inputs must be a non-empty tuple of tensors")
    if not isinstance(bundle.labels, torch.Tensor):
        raise ModelSourceError(f"model factory {spec!r}: bundle.labels must be a tensor")
    if not callable(bundle.loss_fn):
        raise ModelSourceError(f"model factory {spec!r}: bundle.loss_fn must be callable")
