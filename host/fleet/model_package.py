"""A model as it travels to boards: its torch.export archive (content-addressed) plus the node grouping.

The coordinator traces the model once, writes the exported program to ``CACHE_DIR/<sha256>.pt2`` and
keeps the grouping the schedule is solved on. A board loads the archive and splits it by the grouping with
the same code the host used (:mod:`device_agent.executor.split`), then checks the schedule's fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_agent.agent.program import save_archive
from device_agent.fileio import atomic_write_chunks
from device_agent.serde import grouping_to_proto
from host.graph.partition import partition_spec
from host.graph.training_graph import TrainingGraph
from host.run.errors import InputError
from host.run.sources import ModelSource

ARCHIVE_SUFFIX = ".pt2"
_READ_CHUNK_BYTES = 1 << 20


@dataclass
class ModelPackage:
    """One traced model ready to send: the archive on disk, its digest, and what the schedule is solved on."""

    model: str
    digest: str  # sha256 hex of the archive
    path: Path  # cache_dir / f"{digest}.pt2"
    size_bytes: int
    grouping: Any  # poet.v1.NodeGrouping
    graph: TrainingGraph
    batch_size: int


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def package_model(model: str, cache_dir: str | os.PathLike, *, batch_size: int | None = None,
                  seed: int = 0, granularity: str = "layer") -> ModelPackage:
    """Trace ``model`` (a zoo name or module:callable) at ``granularity`` (layer, block or op: the schedulable nodes)
    and write its archive into ``cache_dir`` (InputError)."""
    source = ModelSource(model, batch_size=batch_size, seed=seed, granularity=granularity)
    resolved = source.resolve()
    traced, bundle = resolved.traced, resolved.bundle
    if traced is None or traced.exported is None or bundle is None:
        raise InputError(f"{model!r} is a reference graph without weights; boards need a real PyTorch model "
                         "(a zoo name or module:callable)")
    first = bundle.inputs[0]
    grouping = grouping_to_proto(partition_spec(traced), batch_shape=tuple(first.shape),
                                 batch_dtype=str(first.dtype).removeprefix("torch."), num_classes=_num_classes(bundle),
                                 class_index_shape=tuple(bundle.labels.shape))
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    # torch.export.save writes a zip it may seek in: write it beside the cache, then move it into place
    # under its digest (atomic, fsynced), so a reader never sees a partial archive.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".packing-") as scratch:
        staged = Path(scratch) / "model.pt2"
        save_archive(traced.exported, staged)
        digest = sha256_file(staged)
        path = cache / f"{digest}{ARCHIVE_SUFFIX}"
        if not path.is_file() or sha256_file(path) != digest:
            with open(staged, "rb") as handle:
                atomic_write_chunks(path, iter(lambda: handle.read(_READ_CHUNK_BYTES), b""))
    return ModelPackage(model=source.name, digest=digest, path=path, size_bytes=path.stat().st_size,
                        grouping=grouping, graph=traced.graph, batch_size=int(first.shape[0]))


def _num_classes(bundle) -> int:
    """Classes of a classification model: the last dimension of its output on the example batch."""
    import torch

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        training = bundle.module.training
        bundle.module.eval()
        try:
            output = bundle.module(*bundle.inputs)
        finally:
            bundle.module.train(training)
    return int(output.shape[-1])
