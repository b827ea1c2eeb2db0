"""Page directories of runs that died: the next store removes them and says so; a live run's stay.

Real processes and real signals: a child pages two tensors out and waits; it is SIGKILLed (as the OOM
killer does) or SIGTERMed without a handler, which leaves its page files behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from device_agent.executor import EntryBuilder, FlashPageStore, ScheduleExecutor, page_store, remove_stale_page_dirs
from tests.device_agent.executor.helpers import case, schedule_for

REPO = Path(__file__).resolve().parents[3]

_PAGING_CHILD = """
import sys, time, torch
from device_agent.executor import EntryBuilder, FlashPageStore
store = FlashPageStore(sys.argv[1])
for node in range(2):
    builder = EntryBuilder(node)
    builder.add_named("x", torch.full((1000,), float(node)))
    store.write(node, f"layer.{node}", builder.build())
print(store.directory, flush=True)
time.sleep(600)
"""


def _start_paging_child(flash_dir: Path) -> tuple[subprocess.Popen, str]:
    """A child holding two pages on ``flash_dir``; returns it and its page directory."""
    child = subprocess.Popen([sys.executable, "-c", _PAGING_CHILD, str(flash_dir)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    directory = child.stdout.readline().strip()
    if not directory:
        child.kill()
        raise AssertionError(f"the paging child failed: {child.stderr.read()}")
    return child, directory


def _kill(child: subprocess.Popen, sig: int) -> None:
    if child.poll() is None:
        child.send_signal(sig)
    child.wait(timeout=30)


def _page_files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".page"))


def test_pages_of_a_killed_run_are_removed_and_a_live_runs_are_kept(tmp_path):
    killed, killed_dir = _start_paging_child(tmp_path)
    alive, alive_dir = _start_paging_child(tmp_path)
    try:
        _kill(killed, signal.SIGKILL)
        assert killed.returncode == -signal.SIGKILL
        assert _page_files(killed_dir) == ["node-000000.page", "node-000001.page"]  # what a kill leaves behind

        messages: list[str] = []
        store = FlashPageStore(tmp_path, log=messages.append)
        assert store.stale_removed_count == 1
        [stale] = store.stale_removed
        assert stale.path == killed_dir and stale.owner_pid == killed.pid and stale.files == 2
        assert stale.bytes == sum(os.path.getsize(os.path.join(alive_dir, f)) for f in _page_files(alive_dir))
        assert not os.path.exists(killed_dir)
        assert len(messages) == 1 and killed_dir in messages[0] and f"pid {killed.pid}" in messages[0]
        assert "2 file(s)" in messages[0]
        # The live child's directory is untouched, and so is this store's own once it has one.
        assert _page_files(alive_dir) == ["node-000000.page", "node-000001.page"]
        builder = EntryBuilder(7)
        builder.add_named("y", torch.ones(10))
        store.write(7, "mine", builder.build())
        assert remove_stale_page_dirs(tmp_path) == []
        assert os.path.exists(store.path_of(7)) and _page_files(alive_dir)

        _kill(alive, signal.SIGTERM)  # no handler: SIGTERM leaves pages behind too
        assert alive.returncode == -signal.SIGTERM
        swept = remove_stale_page_dirs(tmp_path)
        assert [s.path for s in swept] == [alive_dir] and not os.path.exists(alive_dir)
        store.close()
        assert os.listdir(tmp_path) == []
    finally:
        for child in (killed, alive):
            _kill(child, signal.SIGKILL)


def test_the_executor_sweeps_the_flash_dir_and_reports_on_its_log(tmp_path):
    killed, killed_dir = _start_paging_child(tmp_path)
    _kill(killed, signal.SIGKILL)
    current = case("mlp")
    schedule, _ = schedule_for("mlp", "none")  # does not page: the flash dir is still swept
    messages: list[str] = []
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(tmp_path), log=messages.append) as executor:
        assert [s.path for s in executor.stale_page_dirs] == [killed_dir]
    assert len(messages) == 1 and f"pid {killed.pid}" in messages[0]
    assert os.listdir(tmp_path) == []


def test_a_recorded_live_pid_does_not_protect_a_directory_whose_lock_is_free(tmp_path):
    """PIDs are reused: what counts is the lock, which the kernel drops when its holder dies."""
    directory, lock_fd = page_store._create_owned_directory(str(tmp_path))  # records this very process
    assert remove_stale_page_dirs(tmp_path) == []  # held
    os.close(lock_fd)  # released, as a dying owner's is; the record still names a live PID (ours)
    [stale] = remove_stale_page_dirs(tmp_path)
    assert stale.path == directory and stale.owner_pid == os.getpid()
    assert os.listdir(tmp_path) == []


def test_unmarked_and_staging_directories(tmp_path):
    legacy = tmp_path / ".poet-pages-legacy"  # made before owner marks: nothing can own it
    legacy.mkdir()
    (legacy / "node-000003.page").write_bytes(b"x" * 100)
    young = tmp_path / ".poet-staging-young"  # may be another process between mkdtemp and flock
    young.mkdir()
    old = tmp_path / ".poet-staging-old"
    old.mkdir()
    (old / "owner.lock").write_bytes(b"{}")
    past = time.time() - page_store.STAGING_GRACE_S - 5
    os.utime(old, (past, past))
    unrelated = tmp_path / "poet-pages-not-hidden"
    unrelated.mkdir()
    swept = {Path(s.path).name: s for s in remove_stale_page_dirs(tmp_path)}
    assert set(swept) == {".poet-pages-legacy", ".poet-staging-old"}
    assert swept[".poet-pages-legacy"].owner_pid is None and swept[".poet-pages-legacy"].bytes == 100
    assert sorted(os.listdir(tmp_path)) == [".poet-staging-young", "poet-pages-not-hidden"]


def test_close_is_idempotent_and_refuses_later_page_outs(tmp_path):
    store = FlashPageStore(tmp_path)
    builder = EntryBuilder(0)
    builder.add_named("x", torch.ones(100))
    store.write(0, "a", builder.build())
    lock_fd = store._lock_fd
    store.close()
    store.close()
    store.clear()
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):
        os.fstat(lock_fd)  # the lock's descriptor was closed (once: a second close would have raised above)
    with pytest.raises(page_store.PageStoreError, match="closed"):
        store.write(1, "b", builder.build())
    assert os.listdir(tmp_path) == []


_SIGTERM_CHILD = """
import signal, sys, torch
from device_agent.executor import EntryBuilder, FlashPageStore
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # what the CLI does: unwind through the finally blocks
builder = EntryBuilder(0)
builder.add_named("x", torch.randn(50_000))
entry = builder.build()
with FlashPageStore(sys.argv[1], drop_cache=False) as store:
    store.write(0, "warm-up", entry)
    print("ready", flush=True)
    node = 1
    while True:  # create the directory, page out, free (the directory goes with the last page), again
        store.write(node, "x", entry)
        store.delete(node)
        node += 1
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2])
def test_sigterm_unwinding_through_the_store_leaves_nothing(tmp_path, delay_s):
    """SIGTERM may land anywhere in a page-out or a free; the exception path's close finishes the cleanup."""
    child = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD, str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(delay_s)
        _kill(child, signal.SIGTERM)
        assert child.returncode == 143, child.stderr.read()
        assert os.listdir(tmp_path) == []
    finally:
        _kill(child, signal.SIGKILL)


def test_an_interrupted_removal_is_finished_by_the_next_close(tmp_path):
    """A signal handler's exception can land between two unlinks; the exception path's close completes it.

    The exception is raised at a chosen point by a trace function (Python runs signal handlers at exactly
    such points between bytecodes), so the test does not depend on a signal's timing.
    """
    store = FlashPageStore(tmp_path)
    for node in range(3):
        builder = EntryBuilder(node)
        builder.add_named("x", torch.ones(100))
        store.write(node, f"n{node}", builder.build())
    directory = store.directory
    unlinks = []

    def interrupt_second_unlink(frame, event, arg):
        if event == "call" and frame.f_code is page_store._unlink_quietly.__code__:
            unlinks.append(frame.f_locals["path"])
            if len(unlinks) == 2:
                raise KeyboardInterrupt
        return None

    sys.settrace(interrupt_second_unlink)
    try:
        with pytest.raises(KeyboardInterrupt):
            store.clear()
    finally:
        sys.settrace(None)
    assert len(os.listdir(directory)) == 3  # one page gone; two pages and the owner lock remain
    store.close()  # what the exception path runs
    assert os.listdir(tmp_path) == []
    assert store.directory is None


def test_a_ctrl_c_while_the_page_directory_is_made_lands_once_it_is_owned(tmp_path):
    """The signal arrives mid-creation: the store already owns the directory when KeyboardInterrupt lands."""
    store = FlashPageStore(tmp_path)
    real_create = page_store._create_owned_directory

    def create_with_a_ctrl_c_in_the_middle(flash_dir):
        made = real_create(flash_dir)
        signal.raise_signal(signal.SIGINT)  # as a Ctrl-C delivered to any thread would be, right now
        assert store.directory is None  # the handler has not run yet: nothing owns the directory
        return made

    builder = EntryBuilder(0)
    builder.add_named("x", torch.ones(4))
    page_store._create_owned_directory = create_with_a_ctrl_c_in_the_middle
    try:
        with pytest.raises(KeyboardInterrupt):
            store.write(0, "x", builder.build())
    finally:
        page_store._create_owned_directory = real_create
    assert store.directory is not None and os.path.isdir(store.directory)  # owned, so the store removes it
    store.close()
    assert os.listdir(tmp_path) == []
