"""Turn a ``--model`` string into a TrainingGraph: a zoo name, ``poet2022:<name>``, or ``module:callable``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from device_agent.errors import UserError
from host.graph.training_graph import TrainingGraph

if TYPE_CHECKING:
    from host.graph.trace import TracedModel
    from host.graph.zoo import ModelBundle

POET2022_PREFIX = "poet2022:"


class UnknownModelNameError(UserError, KeyError):
    """A model name that is none of: zoo name, poet2022:<name>, module:callable."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class ResolvedModel:
    """A model's training graph, plus (for real models) its bundle and trace for the executor."""

    graph: TrainingGraph
    bundle: ModelBundle | None = None
    traced: TracedModel | None = None


def model_names() -> list[str]:
    from host.graph.poet2022 import POET2022_MODELS
    from host.graph.zoo import ZOO

    return list(ZOO) + [POET2022_PREFIX + name for name in POET2022_MODELS]


def load_bundle(
    model: str, *, input_shape: tuple[int, ...] | None = None, batch_size: int | None = None, seed: int = 0
) -> ModelBundle:
    """The real PyTorch model behind a zoo name or a ``module:callable`` factory."""
    from host.graph.model_source import load_factory_bundle
    from host.graph.zoo import ZOO

    if model in ZOO:
        return ZOO[model].bundle(batch_size=batch_size, seed=seed)
    if ":" in model and not model.startswith(POET2022_PREFIX):
        return load_factory_bundle(model, input_shape, seed=seed)
    raise UnknownModelNameError(
        f"unknown model {model!r}. Valid names: {', '.join(model_names())}; "
        "or a factory as module:callable (with --input-shape for a bare nn.Module)"
    )


def resolve_model(
    model: str,
    *,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int | None = None,
    granularity: str = "layer",
    seed: int = 0,
) -> ResolvedModel:
    if model.startswith(POET2022_PREFIX):
        from host.graph.poet2022 import POET2022_MODELS, build_poet2022_graph

        name = model[len(POET2022_PREFIX) :]
        if name not in POET2022_MODELS:
            raise UnknownModelNameError(
                f"unknown reference graph {model!r}. Valid names: "
                + ", ".join(POET2022_PREFIX + n for n in POET2022_MODELS)
            )
        return ResolvedModel(build_poet2022_graph(name, batch_size=batch_size or 1))
    from host.graph.trace import trace_model

    bundle = load_bundle(model, input_shape=input_shape, batch_size=batch_size, seed=seed)
    traced = trace_model(bundle, granularity=granularity)
    return ResolvedModel(traced.graph, bundle, traced)
