"""Free space on flash is checked before training, against the schedule's peak of page files.

The real test mounts a small tmpfs (root only; skipped with the reason where mounting is not allowed)
and fills it with a real file, so the device really is full.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

import pytest

from device_agent.executor import EventStream, FlashFullError, FlashSpaceError, ScheduleExecutor
from device_agent.replay import replay
from device_agent.schedule import Instruction
from tests.device_agent.executor.helpers import case, schedule_for


@dataclass
class _Node:
    name: str
    output_bytes: int
    deps: tuple[int, ...] = ()
    workspace_bytes: int = 0


def test_replay_reports_the_peak_of_pages_on_flash():
    nodes = [_Node("a", 100), _Node("b", 1000, (0,)), _Node("c", 10, (1,))]

    def c(n):
        return Instruction("compute", n)

    def out(n):
        return Instruction("page_out", n)

    def pin(n):
        return Instruction("page_in", n)

    def free_ram(n):
        return Instruction("free", n, "ram")

    def free_flash(n):
        return Instruction("free", n, "flash")

    instructions = [
        c(0), out(0), c(1), out(1), free_ram(0), free_ram(1),  # a and b on flash: 1100 bytes, 2 pages
        pin(1), free_flash(1), c(2), out(2), free_ram(2),  # b leaves flash, c joins: 110 bytes, 2 pages
        free_ram(1), pin(2), free_flash(2), free_ram(2), free_flash(0),
    ]
    trace = replay(nodes, instructions, graph_label="toy")
    assert (trace.peak_flash_bytes, trace.peak_flash_pages) == (1100, 2)
    no_paging = replay(nodes, [c(0), c(1), free_ram(0), c(2), free_ram(1), free_ram(2)], graph_label="toy")
    assert (no_paging.peak_flash_bytes, no_paging.peak_flash_pages) == (0, 0)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "flash"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _fill_until_free(mount_point, filler, free_bytes: int) -> int:
    """Grow or shrink ``filler`` (a real file) so the device has ``free_bytes`` free; returns the free bytes."""
    current = os.path.getsize(filler) if filler.exists() else 0
    size = current + os.statvfs(mount_point).f_bavail * os.statvfs(mount_point).f_frsize - free_bytes
    with open(filler, "ab") as handle:
        handle.truncate(0)
        handle.write(b"\xff" * size)  # written, not sparse: tmpfs charges the pages
    statvfs = os.statvfs(mount_point)
    return statvfs.f_bavail * statvfs.f_frsize


def test_a_full_flash_device_is_refused_before_training_and_just_enough_space_trains(small_tmpfs):
    current = case("resnet18_cifar")
    schedule, _ = schedule_for("resnet18_cifar", "paging")
    nodes = current.partition.nodes
    block_bytes = os.statvfs(small_tmpfs).f_frsize

    # On a roomy device: what the executor asks for covers what its page files really occupy.
    events = EventStream()
    on_flash_payload, used_blocks = [0], [0]
    base_used = os.statvfs(small_tmpfs).f_blocks - os.statvfs(small_tmpfs).f_bfree

    def observe(event):
        pages = [e for e in os.listdir(small_tmpfs) if e.startswith(".poet-pages-")]
        files = [f for d in pages for f in os.listdir(small_tmpfs / d)]
        payload = sum(nodes[int(m.group(1))].output_bytes for f in files if (m := re.match(r"node-(\d+)\.page$", f)))
        on_flash_payload[0] = max(on_flash_payload[0], payload)
        statvfs = os.statvfs(small_tmpfs)
        used_blocks[0] = max(used_blocks[0], statvfs.f_blocks - statvfs.f_bfree - base_used)

    events.subscribe(observe)
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(small_tmpfs), events=events) as executor:
        executor.train_step(current.bundle.inputs, current.bundle.labels)
        needed = executor.flash_needed_bytes
        assert executor.peak_flash_bytes == on_flash_payload[0] > 100_000  # replay's peak = the files seen
    assert used_blocks[0] * block_bytes <= needed
    assert os.listdir(small_tmpfs) == []

    # One block short: refused before anything is written, with the numbers and the fix.
    filler = small_tmpfs / "filler"
    free = _fill_until_free(small_tmpfs, filler, (needed - 1) // block_bytes * block_bytes)
    assert needed - block_bytes <= free < needed
    current.reset()
    with pytest.raises(FlashSpaceError) as raised:
        ScheduleExecutor(current.partition, schedule, flash_dir=str(small_tmpfs))
    message = str(raised.value)
    assert isinstance(raised.value, FlashFullError)
    assert repr(str(small_tmpfs)) in message and f"{free} bytes free" in message and f"({needed} bytes" in message
    assert "--flash-dir" in message
    assert os.listdir(small_tmpfs) == ["filler"]

    # Just enough (needed, rounded up to a block): training runs without hitting ENOSPC.
    free = _fill_until_free(small_tmpfs, filler, -(-needed // block_bytes) * block_bytes)
    assert needed <= free < needed + block_bytes
    current.reset()
    with ScheduleExecutor(current.partition, schedule, flash_dir=str(small_tmpfs)) as executor:
        for _ in range(2):
            executor.train_step(current.bundle.inputs, current.bundle.labels)
    assert os.listdir(small_tmpfs) == ["filler"]
