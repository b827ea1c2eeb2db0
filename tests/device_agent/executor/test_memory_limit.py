"""The physical proof: under a memory limit that kills plain training, the scheduled training completes.

The test creates memory cgroups below its own (cgroup v1 ``memory.limit_in_bytes``, or v2
``memory.max``), measures the training-phase peak of plain and scheduled training of the same model,
sets the limit half way between, and runs both again under it: plain training must be OOM-killed and
the scheduled one must finish. Without a memory cgroup it can create, it skips and says why.

``poet train --cgroup DIR`` joins the cgroup after tracing and solving (tracing runs the model once
with every activation alive, so it needs as much memory as plain training). To repeat this on a
board (cgroup v2; on v1 use /sys/fs/cgroup/memory/poet and memory.limit_in_bytes)::

    sudo mkdir /sys/fs/cgroup/poet
    echo 300M | sudo tee /sys/fs/cgroup/poet/memory.max
    echo 0 | sudo tee /sys/fs/cgroup/poet/memory.swap.max
    poet train --model resnet18_cifar --batch-size 256 --platform local --ram-budget 35% --no-remat \\
        --flash-dir /mnt/flash --steps 2 --cgroup /sys/fs/cgroup/poet           # completes
    poet train --model resnet18_cifar --batch-size 256 --platform local --ram-budget 35% \\
        --steps 2 --plain --cgroup /sys/fs/cgroup/poet                          # killed (exit 137)

Pick the limit between the two runs' peaks (``memory.peak`` / ``memory.max_usage_in_bytes`` of an
unlimited cgroup).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TRAIN = ["--model", "resnet18_cifar", "--batch-size", "256", "--platform", "a72", "--ram-budget", "35%",
         "--no-remat", "--steps", "2", "--threads", "2", "--json"]
MIN_GAP_BYTES = 100 << 20  # the two peaks must be this far apart for the limit to separate them


class MemoryCgroup:
    """A child memory cgroup (v1 or v2) of this process's own, removed on close."""

    def __init__(self, parent: str, version: int, name: str):
        self.version = version
        self.path = os.path.join(parent, name)
        os.mkdir(self.path)
        limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
        if not os.path.exists(os.path.join(self.path, limit_file)):
            os.rmdir(self.path)
            raise OSError(f"{self.path} has no {limit_file}: the memory controller is not enabled there")

    def limit(self, limit_bytes: int) -> None:
        if self.version == 2:
            Path(self.path, "memory.max").write_text(str(limit_bytes))
            _write_quietly(Path(self.path, "memory.swap.max"), "0")
        else:
            Path(self.path, "memory.limit_in_bytes").write_text(str(limit_bytes))
            _write_quietly(Path(self.path, "memory.memsw.limit_in_bytes"), str(limit_bytes))

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int(Path(self.path, name).read_text())

    def close(self) -> None:
        for _ in range(50):
            pids = [int(p) for p in Path(self.path, "cgroup.procs").read_text().split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)  # only our own children can be in this cgroup
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def _write_quietly(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass  # no swap accounting here


def _own_memory_cgroup() -> tuple[str, int] | str:
    """(directory of this process's memory cgroup, version), or why there is none."""
    if not sys.platform.startswith("linux"):
        return "memory cgroups exist on Linux only"
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            for fields in mounts:
                separator = fields.index("-")
                fstype, options = fields[separator + 1], fields[separator + 3]
                if fstype == "cgroup" and "memory" in options.split(","):
                    return os.path.join(fields[4], path.lstrip("/")), 1
    for line in lines:
        if line.startswith("0::"):
            for fields in mounts:
                if fields[fields.index("-") + 1] == "cgroup2":
                    directory = os.path.join(fields[4], line[3:].lstrip("/"))
                    controllers = Path(directory, "cgroup.controllers")
                    if controllers.exists() and "memory" in controllers.read_text().split():
                        return directory, 2
    return "no memory cgroup controller is mounted for this process"


def _train(cgroup: MemoryCgroup, flash_dir: Path, plain: bool) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "host.cli", "train", *TRAIN, "--flash-dir", str(flash_dir),
            "--cgroup", cgroup.path]
    if plain:
        argv.append("--plain")
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.mark.slow
def test_scheduled_training_survives_a_memory_limit_that_kills_plain_training(tmp_path):
    found = _own_memory_cgroup()
    if isinstance(found, str):
        pytest.skip(f"no cgroup memory control here: {found}")
    parent, version = found
    cgroups: list[MemoryCgroup] = []

    def cgroup(name: str) -> MemoryCgroup:
        try:
            made = MemoryCgroup(parent, version, f"poet-test-{os.getpid()}-{name}")
        except OSError as error:
            pytest.skip(f"cannot create a memory cgroup below {parent} (v{version}): {error}")
        cgroups.append(made)
        return made

    try:
        peaks = {}
        for mode in ("plain", "schedule"):
            probe = cgroup(f"probe-{mode}")
            result = _train(probe, tmp_path, plain=mode == "plain")
            assert result.returncode == 0, result.stderr[-2000:]
            peaks[mode] = probe.peak_bytes()
        gap = peaks["plain"] - peaks["schedule"]
        assert gap >= MIN_GAP_BYTES, f"training-phase peaks too close to separate: {peaks}"
        limit = peaks["schedule"] + gap // 2

        limited = {}
        for mode in ("plain", "schedule"):
            box = cgroup(f"limit-{mode}")
            box.limit(limit)
            limited[mode] = _train(box, tmp_path, plain=mode == "plain")
        plain, scheduled = limited["plain"], limited["schedule"]
        assert plain.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (
            f"plain training should be killed under {limit} bytes (peaks {peaks}); got {plain.returncode}"
        )
        assert scheduled.returncode == 0, scheduled.stderr[-2000:]
        print(f"\nmemory cgroup v{version}: training-phase peak plain {peaks['plain']:,} B, scheduled "
              f"{peaks['schedule']:,} B; under a {limit:,} B limit plain exited {plain.returncode}, scheduled 0")
        assert os.listdir(tmp_path) == []  # the killed run left no page files (it never paged)
    finally:
        for made in cgroups:
            made.close()
