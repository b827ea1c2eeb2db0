"""What the board is, for the coordinator's RegisterRequest: RAM, memory limit, flash, CPUs, meters, runtime RSS.

The memory limit is what the coordinator derives an ``auto`` RAM budget from. It is the smaller of
the process's memory cgroup limit (cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, of
its own cgroup and every ancestor, since a parent's limit binds too) and ``--memory-limit``; which
one won is stated in :attr:`MemoryLimit.source` for the logs.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BoardFacts", "MemoryLimit", "cgroup_memory_limit", "collect_facts", "detect_meters", "format_bytes",
    "memory_limit", "parse_bytes", "runtime_rss_bytes",
]

# Kernels write "no limit" as a huge page-aligned number in v1 (PAGE_COUNTER_MAX * page size).
_UNLIMITED_FROM_BYTES = 1 << 60
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
# systemd's MemoryMax= convention: K, M, G, T are powers of 1024; KB, MB, GB, TB powers of 1000.
_UNITS = {"": 1, "B": 1}
for _i, _letter in enumerate("KMGT", start=1):
    _UNITS[_letter] = _UNITS[f"{_letter}IB"] = 1024**_i
    _UNITS[f"{_letter}B"] = 1000**_i


def parse_bytes(text: str | int | float) -> int:
    """A byte count from ``4294967296``, ``512M``, ``2G``, ``512MiB`` or ``1.5GB`` (K/M/G/T and KiB..TiB are
    powers of 1024, KB..TB of 1000); ValueError for anything else, zero, negative, NaN or infinite."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.fullmatch(str(text))
        if str(text).strip().lower() in ("nan", "inf", "-inf", "infinity"):
            raise ValueError(f"memory limit {text!r} is not a number of bytes; give e.g. 536870912, 512M or 2G")
        if not match:
            if str(text).strip().startswith("-"):
                raise ValueError(f"memory limit {text!r} is negative; give a positive size such as 512M or 2G")
            raise ValueError(f"memory limit {text!r} is not a size; give bytes (536870912) or a size with a unit "
                             "(512M, 2G, 512MiB, 1.5GB)")
        value, unit = float(match.group(1)), match.group(2).upper()
        if unit not in _UNITS:
            raise ValueError(f"memory limit {text!r}: unknown unit {match.group(2)!r}; use K, M, G, T (powers of "
                             "1024, also KiB..TiB) or KB, MB, GB, TB (powers of 1000)")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"memory limit {text!r} is not a finite number of bytes")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory limit {text!r} must be more than 0 bytes")
    return size


def format_bytes(size: int | float) -> str:
    """Decimal units, as the host's display does: 1.2 GB, 512.0 MB, 800 B."""
    size = float(size)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def _read_limit(path: Path) -> int | None:
    """A cgroup limit file's value in bytes; None for "max", unlimited, or a file that is not there."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < _UNLIMITED_FROM_BYTES else None


def _candidates(base: Path, cgroup_path: str, file_name: str) -> list[Path]:
    """``file_name`` in the cgroup's directory under ``base`` and in every ancestor up to ``base``."""
    parts = [p for p in cgroup_path.strip().split("/") if p]
    directory = base.joinpath(*parts)
    if not directory.is_dir():
        # In a cgroup namespace (a container) /proc/self/cgroup names a path outside our view: the mount is ours.
        return [base / file_name]
    found = []
    while True:
        found.append(directory / file_name)
        if directory == base:
            return found
        directory = directory.parent


def cgroup_memory_limit(proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                        cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> tuple[int | None, str]:
    """The tightest memory limit of this process's cgroups: ``(bytes or None, the file it came from)``.

    cgroup v2: the ``0::PATH`` line, ``ROOT/PATH/memory.max`` (also under ``ROOT/unified``, the hybrid
    layout); cgroup v1: the line whose controllers include ``memory``, ``ROOT/memory/PATH/
    memory.limit_in_bytes``. Ancestors count: a parent's limit binds its children.
    """
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None, ""
    files: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            for base in (root, root / "unified"):
                if (base / "cgroup.controllers").exists() or base == root:
                    files += _candidates(base, path, "memory.max")
        elif "memory" in controllers.split(","):
            files += _candidates(root / "memory", path, "memory.limit_in_bytes")
    best: tuple[int | None, str] = (None, "")
    for file in files:
        value = _read_limit(file)
        if value is not None and (best[0] is None or value < best[0]):
            best = (value, str(file))
    return best


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int | None  # None: no limit known
    source: str  # "cgroup FILE", "--memory-limit", or "none"

    def describe(self) -> str:
        if self.bytes is None:
            return "no memory limit"
        return f"memory limit {format_bytes(self.bytes)} from {self.source}"


def memory_limit(override: int | None = None, **cgroup_paths) -> MemoryLimit:
    """The smaller of the cgroup limit and ``override`` (``--memory-limit``), naming which."""
    cgroup, path = cgroup_memory_limit(**cgroup_paths)
    if override is not None and (cgroup is None or override <= cgroup):
        note = f" (the cgroup allows {format_bytes(cgroup)})" if cgroup is not None else ""
        return MemoryLimit(int(override), f"--memory-limit{note}")
    if cgroup is not None:
        note = f" (smaller than --memory-limit {format_bytes(override)})" if override is not None else ""
        return MemoryLimit(cgroup, f"cgroup {path}{note}")
    return MemoryLimit(None, "none")


def detect_meters(sysfs_root: str | os.PathLike = "/", path: str | None = None) -> list[str]:
    """Names of the energy meters this board can read, best first, or ``["modelled"]`` when none is found.

    One place: :func:`device_agent.meters.registry.meter_names` (``sysfs_root`` prefixes ``/sys``;
    ``path`` is searched for ``vcgencmd``).
    """
    from device_agent.meters.registry import meter_names

    return meter_names(sysfs_root, path)


def runtime_rss_bytes() -> int:
    """Resident memory with torch and the executor imported: what the agent costs before any job."""
    import torch  # noqa: F401

    import device_agent.executor  # noqa: F401  (the import is the point: its RSS is measured)
    from device_agent.meters.memory import RssSampler

    sampler = RssSampler()
    try:
        return sampler.rss_bytes()
    finally:
        sampler.close()


def agent_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("poet-edge")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class BoardFacts:
    platform: str
    ram_total_bytes: int
    ram_available_bytes: int
    memory_limit: MemoryLimit
    flash_capacity_bytes: int
    flash_free_bytes: int
    cpu_count: int
    torch_version: str
    meters: tuple[str, ...]
    runtime_rss_bytes: int
    agent_version: str
    activation_arena_bytes: int = 0  # a microcontroller behind the serial bridge: its static activation arena
    board: str = ""  # the serial bridge: the microcontroller it drives
    # the data dir's usable datasets (name, sample shape, samples, classes); None: not reported (nothing is checked)
    datasets: tuple | None = None

    def register_request(self, fleet_pb2):
        """The RegisterRequest message (``fleet_pb2``: the generated module, passed to keep imports lazy)."""
        return fleet_pb2.RegisterRequest(
            protocol_version=fleet_pb2.PROTOCOL_VERSION_1, platform=self.platform,
            ram_total_bytes=self.ram_total_bytes, ram_available_bytes=self.ram_available_bytes,
            memory_limit_bytes=self.memory_limit.bytes or 0, flash_capacity_bytes=self.flash_capacity_bytes,
            flash_free_bytes=self.flash_free_bytes, cpu_count=self.cpu_count, torch_version=self.torch_version,
            meters=list(self.meters), runtime_rss_bytes=self.runtime_rss_bytes, agent_version=self.agent_version,
            activation_arena_bytes=self.activation_arena_bytes, board=self.board,
            datasets=[fleet_pb2.DatasetFacts(name=d.name, item_shape=list(d.sample_shape), item_count=d.samples,
                                             classes=d.classes) for d in self.datasets or ()],
            datasets_reported=self.datasets is not None,
        )


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_training_threads(environ=os.environ) -> int | None:
    """Torch threads a board trains with when ``--threads`` is not given: ``None`` (torch's own choice) where
    ``OMP_NUM_THREADS`` is set, else one fewer than the cores this process may use, at least 1.

    One core stays for the agent's own threads (telemetry, gRPC, page transfers) and whatever else shares the
    board: training with as many threads as cores stalls each time another process takes one of them (measured
    on a 2-core machine shared with the coordinator: resnet18_cifar steps 4x slower and 2-5x noisier).
    """
    if environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, cpu_count() - 1)


def collect_facts(*, platform: str, flash_dir: str | os.PathLike, memory_limit_override: int | None = None,
                  measure_rss: bool = True, data_dir: str | os.PathLike | None = None) -> BoardFacts:
    """Everything RegisterRequest carries. ``measure_rss=False`` skips importing torch (the RSS is then 0).
    ``data_dir``: report its usable datasets (a broken one is left out, as `poet-agent datasets list` flags it)."""
    import psutil

    memory = psutil.virtual_memory()
    disk = shutil.disk_usage(flash_dir)
    rss = runtime_rss_bytes() if measure_rss else 0
    torch_version = sys.modules["torch"].__version__ if "torch" in sys.modules else _torch_version()
    return BoardFacts(
        platform=platform, ram_total_bytes=int(memory.total), ram_available_bytes=int(memory.available),
        memory_limit=memory_limit(memory_limit_override), flash_capacity_bytes=int(disk.total),
        flash_free_bytes=int(disk.free), cpu_count=cpu_count(), torch_version=torch_version,
        meters=tuple(detect_meters()), runtime_rss_bytes=rss, agent_version=agent_version(),
        datasets=None if data_dir is None else usable_datasets(data_dir),
    )


def usable_datasets(data_dir: str | os.PathLike) -> tuple:
    """The summaries of ``data_dir``'s datasets that load (none when the directory does not exist yet)."""
    from device_agent.agent.datasets import DatasetError, DatasetSummary, list_datasets

    try:
        found = list_datasets(data_dir)
    except DatasetError:
        return ()
    return tuple(summary for _, summary in found if isinstance(summary, DatasetSummary))


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"
