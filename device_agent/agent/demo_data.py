"""``poet-agent datasets make-demo``: one board's class-skewed share of scikit-learn's bundled ``digits``.

``digits`` (1,797 8×8 images of the digits 0-9) ships inside scikit-learn, so nothing is downloaded.
Shard I of N gets a disjoint share of the images: classes ``c`` with ``c % N == (I - 1) % N`` are
"its" classes and it gets most of their images; of the other classes it gets a small share. So each
board has its own data to personalize on. A fifth of the shard's images of every class is held out
(``heldout.npz``), so the held-out split has the shard's own skewed distribution. ``x`` is float32 in
[0, 1] (64 features), ``y`` int64. The split depends only on (seed, N), so shards 1..N of one seed
never share an image.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from device_agent.agent.datasets import DatasetError, LocalDataset, check_dataset_name
from device_agent.fileio import atomic_write_bytes, atomic_write_text

__all__ = ["INSTALL_HINT", "make_demo", "parse_shard"]

INSTALL_HINT = "install it with `pip install 'poet-edge[demo]'` (or `pip install scikit-learn`)"
OWN_CLASS_WEIGHT = 1.0
OTHER_CLASS_WEIGHT = 0.1  # relative share of another board's classes
HELDOUT_FRACTION = 0.2
DIGITS_MAX_PIXEL = 16.0  # digits pixels are integers 0..16


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` → (I, N), shards counted from 1."""
    try:
        index_text, count_text = text.split("/")
        index, count = int(index_text), int(count_text)
    except ValueError:
        raise DatasetError(f"--shard {text!r}: expected I/N, e.g. 1/2 (shards count from 1)") from None
    if count < 1 or not 1 <= index <= count:
        raise DatasetError(f"--shard {text!r}: I must be between 1 and N and N at least 1 (shards count from 1)")
    return index, count


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DatasetError(f"make-demo needs scikit-learn, which is not installed; {INSTALL_HINT}") from None
    digits = load_digits()
    return np.asarray(digits.data), np.asarray(digits.target)


def _shard_indices(y: np.ndarray, index: int, count: int, seed: int) -> np.ndarray:
    """Indices of shard ``index`` of ``count``: each class's images split among shards by weight."""
    rng = np.random.default_rng([seed, count])
    chosen = []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        own = int(label) % count
        weights = np.array([OWN_CLASS_WEIGHT if s == own else OTHER_CLASS_WEIGHT for s in range(count)])
        bounds = np.round(np.cumsum(weights) / weights.sum() * len(members)).astype(int)
        start = 0 if index == 1 else bounds[index - 2]
        chosen.append(members[start : bounds[index - 1]])
    return np.concatenate(chosen)


def _npz_bytes(x: np.ndarray, y: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    return buffer.getvalue()


def make_demo(
    data_dir: str | os.PathLike, name: str = "digits", shard: tuple[int, int] = (1, 1), seed: int = 0,
    force: bool = False,
) -> LocalDataset:
    """Write ``data_dir/name/`` (train.npz, heldout.npz, source.json) and return it, loaded and validated.

    The files are written into a temporary directory beside the target, then renamed into place, so
    a reader sees the whole dataset or none. An existing dataset is kept unless ``force``.
    """
    check_dataset_name(name)
    index, count = shard
    data_dir = Path(data_dir)
    target = data_dir / name
    if target.exists() and not force:
        raise DatasetError(f"{target} already exists; pass --force to replace it, or choose another --name")
    x_all, y_all = _load_digits()
    picked = _shard_indices(y_all, index, count, seed)
    rng = np.random.default_rng([seed, count, index])
    train_idx, heldout_idx = [], []
    for label in np.unique(y_all[picked]):
        members = rng.permutation(picked[y_all[picked] == label])
        held = int(round(len(members) * HELDOUT_FRACTION))
        heldout_idx.append(members[:held])
        train_idx.append(members[held:])
    train_idx = rng.permutation(np.concatenate(train_idx))
    heldout_idx = rng.permutation(np.concatenate(heldout_idx))

    def arrays(idx):
        return (x_all[idx] / DIGITS_MAX_PIXEL).astype(np.float32), y_all[idx].astype(np.int64)

    source = {
        "source": "sklearn.datasets.load_digits",
        "shard": f"{index}/{count}",
        "seed": seed,
        "own_classes": [c for c in range(10) if c % count == (index - 1) % count],
        "train_class_counts": np.bincount(y_all[train_idx], minlength=10).tolist(),
        "heldout_class_counts": np.bincount(y_all[heldout_idx], minlength=10).tolist(),
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=data_dir))
    try:
        atomic_write_bytes(staging / "train.npz", _npz_bytes(*arrays(train_idx)))
        atomic_write_bytes(staging / "heldout.npz", _npz_bytes(*arrays(heldout_idx)))
        atomic_write_text(staging / "source.json", json.dumps(source, indent=2) + "\n")
        os.chmod(staging, 0o755)
        if target.exists():  # only with force: move the old one aside, then drop it once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".old", dir=data_dir))
            os.replace(target, old / name)
            os.rename(staging, target)
            shutil.rmtree(old)
        else:
            os.rename(staging, target)  # fails if another writer created it meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return LocalDataset(data_dir, name)
