"""Local datasets: the training data a board keeps in its ``--data-dir`` and never sends anywhere.

Format (a job names a dataset; the agent reads ``DATA_DIR/NAME/``):

- ``NAME`` is 1-64 characters of letters, digits, ``.``, ``_`` and ``-``, starting with a letter or
  digit (a name arrives in a job from the network, so it can never be a path).
- ``DATA_DIR/NAME/*.npz`` are shards, each holding two arrays: ``x`` of shape ``(samples, features...)``
  (floating or integer dtype; a float ``x`` must be finite) and ``y`` of shape ``(samples,)``
  (integer class labels, or floating targets). Write one with ``numpy.savez(path, x=x, y=y)``.
- Shards whose file name starts with ``heldout`` form the optional held-out split (accuracy before
  and after a job is measured on it); every other ``.npz`` shard is training data. Shards are read
  in file-name order. Files starting with ``.`` (temporaries of an atomic write) and files that are
  not ``.npz`` (such as ``source.json``) are ignored.
- All shards of a dataset share the per-sample shape of ``x`` and the dtypes of ``x`` and ``y``.

Shards are read with ``allow_pickle=False``: an object array (which only pickle could rebuild) is
refused, never unpickled. Every problem is a :class:`DatasetError` naming the file and the fix.

A dataset is loaded whole into RAM when opened (a board's datasets are small next to its model);
:meth:`LocalDataset.batches` then walks a deterministic stream of shuffled epochs, addressed by a
sample index, so a job resumed from a checkpoint continues from the same data position.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = [
    "HELDOUT_PREFIX",
    "Batch",
    "DatasetError",
    "DatasetSummary",
    "LocalDataset",
    "SYNTHETIC_DATASET",
    "SyntheticDataset",
    "check_dataset_name",
    "list_datasets",
]

HELDOUT_PREFIX = "heldout"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SAVE_HINT = "write shards with numpy.savez(path, x=x, y=y)"


class DatasetError(ValueError):
    """A dataset that cannot be used as it is; the message names the file and how to fix it."""


class Batch(NamedTuple):
    """One batch; ``next_index`` is the data position to store in a checkpoint to resume after it."""

    x: np.ndarray
    y: np.ndarray
    next_index: int


@dataclass(frozen=True)
class DatasetSummary:
    """What ``poet-agent datasets list`` prints for one dataset."""

    name: str
    shards: int
    samples: int
    heldout_shards: int
    heldout_samples: int
    sample_shape: tuple[int, ...] = ()  # one sample's shape
    classes: int = 0  # the largest training label + 1 (0 for an empty label set)


def check_dataset_name(name: str) -> str:
    """``name`` if it is a valid dataset name, else :class:`DatasetError` (a name is never a path)."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise DatasetError(
            f"invalid dataset name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def _shard_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(training shards, held-out shards) of a dataset directory, each in file-name order."""
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.suffix != ".npz" or not path.is_file():
            continue
        (heldout if path.name.startswith(HELDOUT_PREFIX) else train).append(path)
    return train, heldout


def _load_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of one shard, checked on their own (shapes, dtypes, lengths, finiteness)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = set(archive.files)
            missing = [a for a in ("x", "y") if a not in names]
            if missing:
                raise DatasetError(
                    f"{path}: missing array {' and '.join(repr(m) for m in missing)} "
                    f"(has: {', '.join(sorted(names)) or 'none'}); {_SAVE_HINT}"
                )
            arrays = {}
            for key in ("x", "y"):
                try:
                    arrays[key] = archive[key]
                except ValueError as exc:  # an object array: only pickle could load it
                    raise DatasetError(
                        f"{path}: array {key!r} needs pickle to load ({exc}); pickled data is refused, "
                        f"save numeric arrays instead"
                    ) from None
    except DatasetError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: not a readable .npz file ({exc}); rewrite it ({_SAVE_HINT})") from None
    x, y = arrays["x"], arrays["y"]
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DatasetError(f"{path}: x has dtype {x.dtype}; it must be a floating or integer dtype")
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DatasetError(
            f"{path}: y has dtype {y.dtype}; it must be integer class labels (e.g. int64) or floating targets"
        )
    if x.ndim < 2:
        raise DatasetError(
            f"{path}: x has shape {x.shape}; it must be (samples, features...), e.g. reshape(-1, 1) for one feature"
        )
    if y.ndim != 1:
        raise DatasetError(f"{path}: y has shape {y.shape}; it must be (samples,), one label per sample")
    if len(x) != len(y):
        raise DatasetError(f"{path}: x has {len(x)} samples but y has {len(y)}; both must have one row per sample")
    for key, array in (("x", x), ("y", y)):
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise DatasetError(f"{path}: {key} has {bad} NaN or infinite values; clean or drop those samples")
    return x, y


def _load_split(paths: list[Path], reference: tuple[Path, np.ndarray, np.ndarray] | None):
    """Concatenated ``x`` and ``y`` of ``paths``; every shard must match the first one (or ``reference``)."""
    xs, ys = [], []
    for path in paths:
        x, y = _load_shard(path)
        if reference is None:
            reference = (path, x, y)
        ref_path, ref_x, ref_y = reference
        if x.shape[1:] != ref_x.shape[1:]:
            raise DatasetError(
                f"{path}: x has {x.shape[1:]} per sample but {ref_path.name} has {ref_x.shape[1:]}; "
                f"all shards of a dataset must share the sample shape"
            )
        if x.dtype != ref_x.dtype or y.dtype != ref_y.dtype:
            raise DatasetError(
                f"{path}: dtypes x={x.dtype}, y={y.dtype} differ from {ref_path.name} "
                f"(x={ref_x.dtype}, y={ref_y.dtype}); all shards of a dataset must share them"
            )
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys), reference


class LocalDataset:
    """A validated dataset ``data_dir/name`` held in RAM, with deterministic batches and its held-out split."""

    def __init__(self, data_dir: str | os.PathLike, name: str) -> None:
        self.name = check_dataset_name(name)
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise DatasetError(f"data dir {data_dir} does not exist; create it or pass the right --data-dir")
        self.path = data_dir / name
        if not self.path.is_dir():
            available = [p.name for p in sorted(data_dir.iterdir()) if p.is_dir() and _NAME.fullmatch(p.name)]
            raise DatasetError(
                f"no dataset {name!r} in {data_dir} (expected a directory {self.path} of .npz shards); "
                f"available: {', '.join(available) or 'none'}; make a demo one with "
                f"`poet-agent datasets make-demo --data-dir {data_dir} --name {name}`"
            )
        train, heldout = _shard_files(self.path)
        if not train:
            raise DatasetError(
                f"{self.path}: no training shards (.npz files not named {HELDOUT_PREFIX}*); "
                f"add at least one ({_SAVE_HINT})"
            )
        self.shard_paths = tuple(train)
        self.heldout_paths = tuple(heldout)
        self.x, self.y, reference = _load_split(train, None)
        if len(self.y) == 0:
            raise DatasetError(f"{self.path}: the training shards hold no samples; add samples ({_SAVE_HINT})")
        if heldout:
            self._heldout_x, self._heldout_y, _ = _load_split(heldout, reference)
        else:
            self._heldout_x = self._heldout_y = None

    def __len__(self) -> int:
        return len(self.y)

    @property
    def heldout_samples(self) -> int:
        return 0 if self._heldout_y is None else len(self._heldout_y)

    def heldout(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(x, y)`` of the held-out split, or None when the dataset has none."""
        if self._heldout_x is None:
            return None
        return self._heldout_x, self._heldout_y

    def summary(self) -> DatasetSummary:
        return DatasetSummary(
            self.name, len(self.shard_paths), len(self), len(self.heldout_paths), self.heldout_samples,
            tuple(int(d) for d in self.x.shape[1:]), int(self.y.max()) + 1 if self.y.size else 0,
        )

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """The sample order of one epoch: a permutation fixed by (seed, epoch) alone."""
        return np.random.default_rng([int(seed), int(epoch)]).permutation(len(self))

    def batches(
        self, batch_size: int, seed: int, start_index: int = 0, count: int | None = None
    ) -> Iterator[Batch]:
        """Batches of ``batch_size`` samples from the stream of epochs, starting at sample ``start_index``.

        The stream is epoch 0's permutation, then epoch 1's, and so on; a batch may span two epochs,
        so every batch is full. Sample ``i`` of the stream is always the same, whatever the starting
        point: a job resumed with ``start_index`` = the ``next_index`` of its last batch sees exactly
        the batches an uninterrupted run would. Endless unless ``count`` batches are asked for.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if start_index < 0:
            raise ValueError(f"start_index must be non-negative, got {start_index}")
        n = len(self)
        index = int(start_index)
        epoch, cached = -1, None
        produced = 0
        while count is None or produced < count:
            take = np.empty(batch_size, dtype=np.int64)
            filled = 0
            while filled < batch_size:
                e, offset = divmod(index + filled, n)
                if e != epoch:
                    epoch, cached = e, self.order(seed, e)
                part = cached[offset : offset + batch_size - filled]
                take[filled : filled + len(part)] = part
                filled += len(part)
            index += batch_size
            produced += 1
            yield Batch(self.x[take], self.y[take], index)


SYNTHETIC_DATASET = ":synthetic"  # not a valid dataset name, so it never shadows a directory
_SYNTHETIC_BATCHES = 4


class SyntheticDataset(LocalDataset):
    """Seeded random samples of the model's shape and class count, made on the board: what calibration runs train
    on (their step times, not what they learn, are the point), so a board needs no dataset of every calibration
    model's shape. Batches, order and resume behave as a LocalDataset's; it has no held-out split."""

    def __init__(self, sample_shape: tuple[int, ...], num_classes: int, batch_size: int, seed: int,
                 label_shape: tuple[int, ...] = ()) -> None:
        """``label_shape``: one sample's class indices (``()``: one class per sample; a sequence model's: one per
        token). Samples are uniform in [0, 1); a model taking integer ids gets them as 0 once cast."""
        rng = np.random.default_rng([int(seed), 0x5EED])
        count = max(1, int(batch_size)) * _SYNTHETIC_BATCHES
        self.name = SYNTHETIC_DATASET
        self.path = None
        self.shard_paths = self.heldout_paths = ()
        self.x = rng.random((count, *sample_shape), dtype=np.float32)
        self.y = rng.integers(0, max(1, int(num_classes)), size=(count, *label_shape), dtype=np.int64)
        self._heldout_x = self._heldout_y = None


def list_datasets(data_dir: str | os.PathLike) -> list[tuple[str, DatasetSummary | DatasetError]]:
    """Every dataset directory in ``data_dir`` with its summary, or the error that makes it unusable."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DatasetError(f"data dir {data_dir} does not exist; create it or pass the right --data-dir")
    found: list[tuple[str, DatasetSummary | DatasetError]] = []
    for path in sorted(data_dir.iterdir()):
        if not path.is_dir() or _NAME.fullmatch(path.name) is None:
            continue
        try:
            found.append((path.name, LocalDataset(data_dir, path.name).summary()))
        except DatasetError as exc:
            found.append((path.name, exc))
    return found
