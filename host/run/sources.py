"""Where a run's model and platform come from: a name, a ``module:callable``, or an ``nn.Module`` with its batch."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from host.graph.granularity import granularity_text, parse_granularity
from host.run import values
from host.run.errors import InputError

if TYPE_CHECKING:
    from host.costs import PlatformProfile
    from host.graph.resolve import ResolvedModel
    from host.graph.zoo import ModelBundle

LOCAL_PLATFORM = "local"  # profile this machine (quick micro-benchmarks) instead of loading a file


@dataclass
class ModelSource:
    """A model to trace: a name as the CLI takes it, or an ``nn.Module`` (or ModelBundle) with its batch."""

    model: Any  # str | nn.Module | ModelBundle
    inputs: Any = None  # a tensor or tuple of tensors: the module's forward() arguments, batch first
    labels: Any = None
    loss_fn: Callable | None = None  # (output, labels) -> scalar loss; default cross-entropy
    input_shape: tuple[int, ...] | None = None
    batch_size: int | None = None
    granularity: str = "layer"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size is not None:
            self.batch_size = values.checked("batch_size", values.count, self.batch_size)
        self.seed = values.checked("seed", values.seed, self.seed)
        try:
            self.granularity = granularity_text(*parse_granularity(self.granularity))
        except ValueError as error:
            raise InputError(str(error)) from None
        if isinstance(self.input_shape, str):
            from host.graph.model_source import parse_input_shape

            self.input_shape = parse_input_shape(self.input_shape)
        elif self.input_shape is not None:
            self.input_shape = tuple(values.checked("input_shape", values.count, d) for d in self.input_shape)
        if isinstance(self.model, str):
            if self.inputs is not None or self.labels is not None or self.loss_fn is not None:
                raise InputError("inputs, labels and loss_fn go with an nn.Module; a named model brings its own batch")
        elif not self._is_bundle():
            from torch import nn

            if not isinstance(self.model, nn.Module):
                raise InputError(
                    f"model: expected a name (str), an nn.Module or a ModelBundle, got {type(self.model).__name__}"
                )
            if self.inputs is None or self.labels is None:
                raise InputError("an nn.Module needs its batch: pass inputs=<tensor or tuple> and labels=<tensor>")

    @property
    def name(self) -> str:
        if isinstance(self.model, str):
            return self.model
        if self._is_bundle():
            return self.model.name
        return type(self.model).__name__

    def _is_bundle(self) -> bool:
        from host.graph.zoo import ModelBundle

        return isinstance(self.model, ModelBundle)

    def bundle(self) -> ModelBundle:
        """The real PyTorch model and its batch (a named model is built afresh from ``seed``)."""
        import torch

        from host.graph.resolve import load_bundle
        from host.graph.zoo import ModelBundle, default_loss

        if isinstance(self.model, str):
            return load_bundle(self.model, input_shape=self.input_shape, batch_size=self.batch_size, seed=self.seed)
        if self._is_bundle():
            return self.model
        inputs = (self.inputs,) if isinstance(self.inputs, torch.Tensor) else tuple(self.inputs)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise InputError("inputs: expected a tensor or a non-empty tuple of tensors")
        if not isinstance(self.labels, torch.Tensor):
            raise InputError(f"labels: expected a tensor, got {type(self.labels).__name__}")
        return ModelBundle(name=self.name, module=self.model, inputs=inputs, labels=self.labels,
                           loss_fn=self.loss_fn or default_loss)

    def copy(self) -> ModelSource:
        """The same model with its own weights (an ``nn.Module`` is deep-copied; a name is rebuilt anyway)."""
        if isinstance(self.model, str):
            return replace(self)
        if self._is_bundle():
            return replace(self, model=replace(self.model, module=copy.deepcopy(self.model.module)))
        return replace(self, model=copy.deepcopy(self.model))

    def resolve(self) -> ResolvedModel:
        """Trace the model into its training graph (a ``poet2022:`` name gives the reference graph)."""
        from host.graph.resolve import POET2022_PREFIX, ResolvedModel, resolve_model

        if isinstance(self.model, str):
            if self.model.startswith(POET2022_PREFIX) and self.input_shape:
                raise InputError(f"{self.model} is a reference graph: it takes no input_shape")
            return resolve_model(self.model, input_shape=self.input_shape, batch_size=self.batch_size,
                                 granularity=self.granularity, seed=self.seed)
        from host.graph.trace import trace_model

        bundle = self.bundle()
        traced = trace_model(bundle, granularity=self.granularity)
        return ResolvedModel(traced.graph, bundle, traced)


def load_platform(platform: Any, *, flash_dir: str | os.PathLike = ".",
                  log: Callable[[str], None] = lambda message: None) -> PlatformProfile:
    """A shipped platform name, a profile file, a PlatformProfile, or ``"local"``/None: measure this machine."""
    from host.costs import PlatformProfile, load_profile

    if isinstance(platform, PlatformProfile):
        return platform
    if platform is None or platform == LOCAL_PLATFORM:
        from host.costs.local_bench import profile_local_machine

        log("profiling this machine (quick; pass a platform name to skip)")
        return profile_local_machine(os.fspath(flash_dir), name=LOCAL_PLATFORM, quick=True,
                                     progress=lambda message: log(f"  {message}"))
    if not isinstance(platform, (str, os.PathLike)):
        raise InputError(f"platform: expected a name, a profile file or a PlatformProfile, got {type(platform).__name__}")
    return load_profile(os.fspath(platform))


def ensure_flash_dir(flash_dir: str | os.PathLike, log: Callable[[str], None] = lambda message: None) -> str:
    """Create the flash directory if it is missing (saying so), then check that pages can be written there."""
    from device_agent.executor import check_flash_dir

    path = Path(flash_dir)
    if not path.exists():
        try:
            path.mkdir(parents=True)
        except OSError as error:
            raise InputError(f"flash dir {os.fspath(path)!r} does not exist and cannot be created: "
                             f"{error.strerror}") from None
        log(f"created flash dir {os.fspath(path)}")
    check_flash_dir(path)
    return os.fspath(path)
