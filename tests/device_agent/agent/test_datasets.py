"""Local datasets: the format's checks, deterministic resumable batches, and `poet-agent datasets` run as a process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_agent.agent.datasets import DatasetError, LocalDataset, list_datasets

AGENT = [sys.executable, "-m", "device_agent.cli"]


def _agent(*args, check_rc: int | None = 0, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run([*AGENT, *map(str, args)], capture_output=True, text=True, timeout=120, **kwargs)
    if check_rc is not None:
        assert run.returncode == check_rc, f"{args}: rc {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run


def _write(path: Path, **arrays) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


def _good(n=10, features=3, offset=0):
    x = (np.arange(n * features, dtype=np.float32).reshape(n, features) + offset) / 100
    return {"x": x, "y": np.arange(n, dtype=np.int64) + offset}


def test_loads_shards_in_name_order_and_the_heldout_split(tmp_path):
    _write(tmp_path / "d" / "b.npz", **_good(4, offset=100))
    _write(tmp_path / "d" / "a.npz", **_good(6))
    _write(tmp_path / "d" / "heldout-1.npz", **_good(3, offset=500))
    (tmp_path / "d" / "README.txt").write_text("ignored")
    _write(tmp_path / "d" / ".a.npz.123.tmp.npz", x=np.zeros(2))  # a temporary of an atomic write: ignored
    ds = LocalDataset(tmp_path, "d")
    assert len(ds) == 10 and [p.name for p in ds.shard_paths] == ["a.npz", "b.npz"]
    assert ds.y.tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 102, 103]
    hx, hy = ds.heldout()
    assert hy.tolist() == [500, 501, 502] and hx.shape == (3, 3)
    assert ds.summary().heldout_samples == 3

    _write(tmp_path / "e" / "only.npz", **_good(5))
    assert LocalDataset(tmp_path, "e").heldout() is None


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((3, 2), np.float32)}, "missing array 'y'"),
        ({"x": np.zeros((3, 2), np.float32), "y": np.zeros(2, np.int64)}, "x has 3 samples but y has 2"),
        ({"x": np.array([[0.0, np.nan], [1.0, 2.0]]), "y": np.zeros(2, np.int64)}, "1 NaN or infinite"),
        ({"x": np.array([[0.0, np.inf]]), "y": np.zeros(1, np.int64)}, "NaN or infinite"),
        ({"x": np.array([["a", "b"]]), "y": np.zeros(1, np.int64)}, "x has dtype <U1"),
        ({"x": np.zeros((2, 2), np.complex64), "y": np.zeros(2, np.int64)}, "x has dtype complex64"),
        ({"x": np.zeros((2, 2)), "y": np.array(["a", "b"])}, "y has dtype <U1"),
        ({"x": np.zeros(4), "y": np.zeros(4, np.int64)}, "(samples, features...)"),
        ({"x": np.zeros((2, 2)), "y": np.zeros((2, 1), np.int64)}, "it must be (samples,)"),
    ],
)
def test_a_bad_shard_is_refused_naming_the_file_and_the_fix(tmp_path, arrays, message):
    shard = _write(tmp_path / "d" / "s.npz", **arrays)
    with pytest.raises(DatasetError) as caught:
        LocalDataset(tmp_path, "d")
    assert str(shard) in str(caught.value) and message in str(caught.value)


def test_pickled_arrays_are_refused_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"

    class Boom:  # unpickling this would create the marker file
        def __reduce__(self):
            return (Path.touch, (marker,))

    y = np.empty(1, dtype=object)
    y[0] = Boom()
    shard = _write(tmp_path / "d" / "s.npz", x=np.zeros((1, 2)), y=y)
    with pytest.raises(DatasetError, match="needs pickle") as caught:
        LocalDataset(tmp_path, "d")
    assert str(shard) in str(caught.value)
    assert not marker.exists()


def test_missing_dirs_no_shards_garbage_and_mismatched_shards(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        LocalDataset(tmp_path / "nowhere", "d")
    _write(tmp_path / "other" / "s.npz", **_good())
    with pytest.raises(DatasetError, match=r"no dataset 'd'.*available: other.*make-demo"):
        LocalDataset(tmp_path, "d")
    _write(tmp_path / "h" / "heldout.npz", **_good())
    with pytest.raises(DatasetError, match="no training shards"):
        LocalDataset(tmp_path, "h")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "s.npz").write_bytes(b"not a zip at all")
    with pytest.raises(DatasetError, match=r"g/s.npz: not a readable .npz"):
        LocalDataset(tmp_path, "g")
    _write(tmp_path / "m" / "a.npz", **_good(features=3))
    _write(tmp_path / "m" / "b.npz", **_good(features=4))
    with pytest.raises(DatasetError, match=r"m/b.npz: x has \(4,\) per sample but a.npz has \(3,\)"):
        LocalDataset(tmp_path, "m")
    _write(tmp_path / "t" / "a.npz", **_good())
    _write(tmp_path / "t" / "heldout.npz", x=_good()["x"].astype(np.float64), y=_good()["y"])
    with pytest.raises(DatasetError, match=r"t/heldout.npz: dtypes x=float64"):
        LocalDataset(tmp_path, "t")
    for bad in ("../other", "a/b", "", ".hidden"):
        with pytest.raises(DatasetError, match="invalid dataset name"):
            LocalDataset(tmp_path, bad)


def test_batches_are_deterministic_full_and_resume_from_a_data_position(tmp_path):
    _write(tmp_path / "d" / "s.npz", **_good(n=10))
    ds = LocalDataset(tmp_path, "d")
    run = list(ds.batches(batch_size=4, seed=7, count=6))  # 24 samples: spans three epochs
    assert all(len(b.y) == 4 and len(b.x) == 4 for b in run)
    stream = np.concatenate([b.y for b in run])
    for epoch in range(2):  # each epoch is a permutation of all ten samples
        assert sorted(stream[epoch * 10 : (epoch + 1) * 10].tolist()) == list(range(10))
    assert stream[:10].tolist() != stream[10:20].tolist()
    assert [b.next_index for b in run] == [4, 8, 12, 16, 20, 24]
    again = list(ds.batches(batch_size=4, seed=7, count=6))
    assert all(np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) for a, b in zip(run, again, strict=True))
    resumed = list(ds.batches(batch_size=4, seed=7, start_index=run[2].next_index, count=3))
    assert [b.y.tolist() for b in resumed] == [b.y.tolist() for b in run[3:]]
    other_seed = np.concatenate([b.y for b in ds.batches(batch_size=4, seed=8, count=6)])
    assert other_seed.tolist() != stream.tolist()
    assert np.array_equal(run[0].x, ds.x[[int(v) for v in run[0].y]])  # x and y stay paired


@pytest.mark.slow  # about 7-18 s: the fast suite stays under 5 minutes
def test_make_demo_writes_disjoint_skewed_shards_and_refuses_to_overwrite(tmp_path):
    pytest.importorskip("sklearn", reason="make-demo needs scikit-learn (the `demo` extra)")
    data = tmp_path / "data"
    out = _agent("datasets", "make-demo", "--data-dir", data, "--shard", "1/2", "--seed", "3").stdout
    assert "wrote" in out and "digits" in out
    _agent("datasets", "make-demo", "--data-dir", data, "--name", "second", "--shard", "2/2", "--seed", "3")
    first, second = LocalDataset(data, "digits"), LocalDataset(data, "second")
    for ds in (first, second):
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64 and ds.x.shape[1] == 64
        assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0 and ds.x.max() > 0.9
        assert ds.heldout_samples > 0
    # Skew: shard 1 of 2 holds mostly the even digits, shard 2 the odd ones, in training and held out.
    for ds, own in ((first, 0), (second, 1)):
        for y in (ds.y, ds.heldout()[1]):
            assert np.mean(y % 2 == own) > 0.8
    # Disjoint: no image is in both boards' data (the digits images are distinct rows).
    rows = lambda ds: {r.tobytes() for r in np.concatenate([ds.x, ds.heldout()[0]])}  # noqa: E731
    assert not rows(first) & rows(second)
    assert not {r.tobytes() for r in first.x} & {r.tobytes() for r in first.heldout()[0]}

    before = (data / "digits" / "train.npz").read_bytes()
    refused = _agent("datasets", "make-demo", "--data-dir", data, "--shard", "2/2", check_rc=2)
    assert "already exists" in refused.stderr and "--force" in refused.stderr
    assert (data / "digits" / "train.npz").read_bytes() == before
    _agent("datasets", "make-demo", "--data-dir", data, "--shard", "2/2", "--seed", "3", "--force")
    assert (data / "digits" / "train.npz").read_bytes() == (data / "second" / "train.npz").read_bytes()
    assert sorted(p.name for p in data.iterdir()) == ["digits", "second"]  # no staging dirs left

    bad_shard = _agent("datasets", "make-demo", "--data-dir", data, "--name", "x", "--shard", "0/2", check_rc=2)
    assert "counted from 1" in bad_shard.stderr or "count from 1" in bad_shard.stderr


def test_make_demo_without_scikit_learn_says_how_to_install_it(tmp_path):
    blocker = "import sys; sys.modules['sklearn'] = None; from device_agent.cli import main; sys.exit(main())"
    run = subprocess.run(
        [sys.executable, "-c", blocker, "datasets", "make-demo", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "scikit-learn" in run.stderr and "poet-edge[demo]" in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_list_prints_each_dataset_and_flags_unusable_ones(tmp_path):
    _write(tmp_path / "alpha" / "a.npz", **_good(6))
    _write(tmp_path / "alpha" / "b.npz", **_good(4))
    _write(tmp_path / "alpha" / "heldout.npz", **_good(3))
    out = _agent("datasets", "list", "--data-dir", tmp_path).stdout.splitlines()
    assert out[0].split() == ["NAME", "SHARDS", "SAMPLES", "HELDOUT_SAMPLES"]
    assert out[1].split() == ["alpha", "2", "10", "3"]
    _write(tmp_path / "broken" / "a.npz", x=np.zeros((2, 2)))
    run = _agent("datasets", "list", "--data-dir", tmp_path, "--json", check_rc=2)
    listed = {d["name"]: d for d in json.loads(run.stdout)["datasets"]}
    assert listed["alpha"]["samples"] == 10 and listed["alpha"]["heldout_samples"] == 3
    assert listed["broken"]["valid"] is False and "missing array 'y'" in listed["broken"]["error"]
    assert "broken" in run.stderr
    assert [name for name, _ in list_datasets(tmp_path)] == ["alpha", "broken"]
    help_text = _agent("datasets", "--help").stdout
    assert "heldout*.npz" in help_text and "numpy.savez" in help_text
    assert "usage: poet-agent" in _agent("--help").stdout


def test_the_synthetic_dataset_is_seeded_random_samples_of_the_models_shape():
    from device_agent.agent.datasets import SYNTHETIC_DATASET, SyntheticDataset, check_dataset_name

    with pytest.raises(DatasetError):  # never a directory name, so it shadows no board's dataset
        check_dataset_name(SYNTHETIC_DATASET)
    a = SyntheticDataset((3, 4, 4), 10, 8, seed=1)
    b = SyntheticDataset((3, 4, 4), 10, 8, seed=1)
    assert a.x.shape[1:] == (3, 4, 4) and a.x.dtype == np.float32 and a.y.dtype == np.int64
    assert 0 <= a.y.min() and a.y.max() < 10 and a.heldout() is None
    first = list(a.batches(8, 0, count=6))
    assert all(batch.x.shape == (8, 3, 4, 4) for batch in first)
    assert np.array_equal(first[5].x, list(b.batches(8, 0, count=6))[5].x)  # same seed, same batches
    resumed = next(a.batches(8, 0, start_index=first[2].next_index, count=1))
    assert np.array_equal(resumed.x, first[3].x)
