"""Model transfer over real mutual TLS: chunks to a .part file, resume after a cut, corruption, full flash."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from device_agent.agent.transfer import DiskFullError, ModelFetchError, ModelStore
from tests.device_agent.agent.fleet_double import FakeFleet, Server, channel, fleet_pb2_grpc, make_certs

CHUNK = 1024


@pytest.fixture(scope="module")
def cert_root(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs") / "fleet", "node-a")


@pytest.fixture
def fleet(cert_root):
    fake = FakeFleet(chunk_bytes=CHUNK)
    server = Server(cert_root, fake).start()
    chan = channel(cert_root, "node-a", server.target)
    fake.stub = fleet_pb2_grpc.FleetStub(chan)
    yield fake
    chan.close()
    server.stop()


def _archive(size: int = 10 * CHUNK + 123) -> bytes:
    return os.urandom(size)


def _no_wait(_exc) -> None:
    return None


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_fetch_writes_verified_archive_and_reuses_the_cache(fleet, tmp_path):
    data = _archive()
    digest = fleet.add_model(data)
    store = ModelStore(tmp_path, margin_bytes=0)
    path = store.fetch(fleet.stub, digest, len(data))
    assert path == tmp_path / "models" / f"{digest}.pt2" and path.read_bytes() == data
    assert _files(tmp_path / "models") == [f"{digest}.pt2"]  # no .part, no temporary file left
    assert fleet.fetch_offsets == [0]
    assert store.fetch(fleet.stub, digest, len(data)) == path
    assert fleet.fetch_offsets == [0]  # the cached archive verified: nothing fetched again


def test_resume_after_a_cut_mid_stream(fleet, tmp_path):
    data = _archive()
    digest = fleet.add_model(data)
    fleet.cut_after_chunks = [3, 4]
    retries = []
    path = ModelStore(tmp_path, margin_bytes=0).fetch(fleet.stub, digest, len(data), wait_retry=retries.append)
    assert path.read_bytes() == data
    assert fleet.fetch_offsets == [0, 3 * CHUNK, 7 * CHUNK]  # each attempt asks from the bytes on disk
    assert len(retries) == 2


def test_a_cut_without_retry_keeps_the_part_for_the_next_attempt(fleet, tmp_path):
    import grpc

    data = _archive()
    digest = fleet.add_model(data)
    fleet.cut_after_chunks = [2]
    store = ModelStore(tmp_path, margin_bytes=0)
    with pytest.raises(grpc.RpcError):
        store.fetch(fleet.stub, digest, len(data))
    assert store.part_path(digest).stat().st_size == 2 * CHUNK
    assert store.fetch(fleet.stub, digest, len(data)).read_bytes() == data
    assert fleet.fetch_offsets == [0, 2 * CHUNK]


@pytest.mark.parametrize("knob", ["corrupt_calls", "corrupt_archive_calls"])
def test_corruption_is_refetched_never_accepted(fleet, tmp_path, knob):
    data = _archive()
    digest = fleet.add_model(data)
    setattr(fleet, knob, 1)
    logs = []
    path = ModelStore(tmp_path, margin_bytes=0, log=logs.append).fetch(fleet.stub, digest, len(data))
    assert path.read_bytes() == data
    assert fleet.fetch_offsets == [0, 0]  # the damaged part was deleted, the refetch starts over
    assert any("arrived corrupted" in line for line in logs)


def test_corrupted_every_time_fails_with_a_clear_error(fleet, tmp_path):
    data = _archive()
    digest = fleet.add_model(data)
    fleet.corrupt_calls = 10
    with pytest.raises(ModelFetchError, match=f"model {digest} arrived corrupted 3 times"):
        ModelStore(tmp_path, margin_bytes=0).fetch(fleet.stub, digest, len(data))
    assert _files(tmp_path / "models") == []
    assert len(fleet.fetch_offsets) == 3


def test_damaged_cache_is_fetched_again(fleet, tmp_path):
    data = _archive()
    digest = fleet.add_model(data)
    store = ModelStore(tmp_path, margin_bytes=0)
    store.path_for(digest).write_bytes(data[:-1] + b"x")
    assert store.fetch(fleet.stub, digest, len(data)).read_bytes() == data
    assert fleet.fetch_offsets == [0]


def test_unknown_model_and_bad_digest(fleet, tmp_path):
    store = ModelStore(tmp_path, margin_bytes=0)
    with pytest.raises(ModelFetchError, match="coordinator refused model .*NOT_FOUND"):
        store.fetch(fleet.stub, "0" * 64, 10)
    with pytest.raises(ModelFetchError, match="not 64 lowercase hex"):
        store.fetch(fleet.stub, "../../etc/passwd", 10)


@contextlib.contextmanager
def _tiny_filesystem(directory, size="1M"):
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs here ({mounted.stderr.strip() or 'not root'}); the full-disk "
                    "path needs one")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def test_full_flash_is_refused_before_fetching(fleet, tmp_path):
    data = _archive(2 * 1024 * 1024)
    digest = fleet.add_model(data)
    with _tiny_filesystem(tmp_path / "state") as state:
        store = ModelStore(state, margin_bytes=0)
        with pytest.raises(DiskFullError, match="not enough free space"):
            store.fetch(fleet.stub, digest, len(data))
        assert _files(state / "models") == []
        assert fleet.fetch_offsets == []


def test_enospc_mid_write_leaves_no_partial_file(fleet, tmp_path):
    data = _archive(2 * 1024 * 1024)
    digest = fleet.add_model(data)
    with _tiny_filesystem(tmp_path / "state") as state:
        store = ModelStore(state, margin_bytes=0)
        with pytest.raises(DiskFullError, match="flash full while writing"):
            store.fetch(fleet.stub, digest, 100_000)  # the job understates the size: the write itself hits ENOSPC
        assert _files(state / "models") == []
        assert fleet.fetch_offsets == [0]
