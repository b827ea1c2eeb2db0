"""Measure THIS machine into a platform profile (``poet profile --local``, and a board's PROFILE job).

The profile is returned in the profile file format (what ``poet profile --local`` writes; the host validates
it with ``host.costs.PlatformProfile.from_dict``),
so a board measures itself without the host's packages.

Measured: compute throughput per op class (torch on CPU, median of timed repetitions after warm-up)
and page-out / page-in latency and throughput to files in ``flash_dir`` (write + fsync; read back
after dropping the file from the OS page cache), fitted as time = latency + bytes / throughput.

NOT measured: energy. There is no power meter here, so energy is MODELLED as time x an assumed power
(``energy_source = "modelled:cpu-time×power"``, no ``energy_per_flop_j``). The assumed figures are
below and are written into the profile's ``sources``; override them with the keyword arguments.

FLOP conventions follow POET's power_computation.py: matmul 2·M·N·K; conv 2·k²·C_in·C_out·H_out·W_out
per sample; relu and add 1 per element; batch norm 2 per element; pooling 2·k² per output element.
Op classes without a benchmark (input, loss, other) use "default", set to the elementwise rate
(little arithmetic per byte, like most of those ops).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from device_agent.errors import UserError
from device_agent.meters.modelled import CPU_POWER_PER_THREAD_W, STORAGE_POWER_W, assumed_machine
from device_agent.meters.modelled import SOURCE as MODELLED_SOURCE

ENERGY_SOURCE = MODELLED_SOURCE  # the label of every figure a local profile prices
PROFILE_SCHEMA_VERSION = 1  # of the profile file format (host.costs.profile.SCHEMA_VERSION; a test checks they agree)

# Page file sizes (bytes) and repetitions per size.
_PAGE_SIZES_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
_PAGE_SIZES_QUICK_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)
_PAGE_REPS = 5
_PAGE_REPS_QUICK = 2


class LocalBenchError(UserError, RuntimeError):
    """The local benchmark cannot run (e.g. a missing or read-only flash directory)."""


def _log(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


# --------------------------------------------------------------------------- compute
def _median_time_s(run: Callable[[], object], reps: int, warmup: int, budget_s: float) -> float:
    """Median wall time of ``run`` over ``reps`` calls (fewer if ``budget_s`` runs out, at least 3)."""
    for _ in range(warmup):
        run()
    times_s: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times_s) < reps and (len(times_s) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        run()
        times_s.append(time.perf_counter() - start)
    return statistics.median(times_s)


def _compute_cases(quick: bool) -> dict[str, list[tuple[str, Callable[[], object], int]]]:
    """op_class -> [(description, callable, FLOPs per call)], on freshly allocated CPU tensors."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    mm_n = 256 if quick else 512
    a, b = rand(mm_n, mm_n), rand(mm_n, mm_n)
    batch, channels, side, kernel = (2, 32, 16, 3) if quick else (4, 64, 32, 3)
    image = rand(batch, channels, side, side)
    weight = rand(channels, channels, kernel, kernel)
    conv_flops = 2 * kernel * kernel * channels * channels * side * side * batch  # padding keeps H, W
    numel = (1 << 18) if quick else (1 << 22)
    x, y = rand(numel), rand(numel)
    feat_batch, feat_channels, feat_side = (4, 32, 32) if quick else (8, 64, 56)  # norm / pool input
    features = rand(feat_batch, feat_channels, feat_side, feat_side)
    mean, var = torch.zeros(feat_channels), torch.ones(feat_channels)
    gamma, beta = torch.ones(feat_channels), torch.zeros(feat_channels)
    feat_shape = f"N={feat_batch} C={feat_channels} {feat_side}x{feat_side}"
    pool_out_numel = feat_batch * feat_channels * (feat_side // 2) * (feat_side // 2)
    return {
        "matmul": [(f"torch.mm {mm_n}x{mm_n}x{mm_n}", lambda: torch.mm(a, b), 2 * mm_n**3)],
        "conv": [
            (
                f"conv2d N={batch} C_in=C_out={channels} {side}x{side} k={kernel} pad=1",
                lambda: F.conv2d(image, weight, padding=kernel // 2),
                conv_flops,
            )
        ],
        "elementwise": [
            (f"relu {numel} elements", lambda: torch.relu(x), numel),
            (f"add {numel} elements", lambda: torch.add(x, y), numel),
        ],
        "norm": [
            (
                f"batch_norm (training) {feat_shape}",
                lambda: F.batch_norm(features, mean.clone(), var.clone(), gamma, beta, training=True),
                2 * features.numel(),
            )
        ],
        "pool": [
            (
                f"max_pool2d k=2 stride=2 on {feat_shape}",
                lambda: F.max_pool2d(features, 2, 2),
                2 * 2 * 2 * pool_out_numel,
            )
        ],
    }


def measure_compute_flops_per_s(
    *, quick: bool = False, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, float], dict[str, str]]:
    """FLOP/s per op class (plus "default") on the CPU with torch, and a provenance note per class."""
    import torch

    reps, warmup, budget_s = (5, 1, 0.3) if quick else (15, 3, 2.0)
    flops_per_s: dict[str, float] = {}
    notes: dict[str, str] = {}
    with torch.inference_mode():
        for op_class, cases in _compute_cases(quick).items():
            total_flops, total_s, described = 0, 0.0, []
            for description, run, flops in cases:
                seconds = _median_time_s(run, reps, warmup, budget_s)
                total_flops += flops
                total_s += seconds
                described.append(f"{description} ({flops} FLOP)")
            flops_per_s[op_class] = total_flops / max(total_s, 1e-9)
            notes[f"compute.flops_per_s.{op_class}"] = (
                f"measured: {' + '.join(described)}; median of up to {reps} runs after {warmup} warm-up, "
                f"{torch.get_num_threads()} torch threads"
            )
            _log(progress, f"compute {op_class}: {flops_per_s[op_class] / 1e9:.2f} GFLOP/s")
    notes["compute.flops_per_s.default"] = "= the elementwise rate; used for input, loss and other nodes"
    return {"default": flops_per_s["elementwise"], **flops_per_s}, notes


# --------------------------------------------------------------------------- paging
def check_flash_dir(flash_dir: str) -> None:
    """Raise LocalBenchError (naming the directory and the fix) unless ``flash_dir`` is a writable directory."""
    if not os.path.exists(flash_dir):
        raise LocalBenchError(
            f"flash dir {flash_dir!r} does not exist: create it (mkdir -p {flash_dir}) or pass --flash-dir "
            "a directory on the storage activations are paged to"
        )
    if not os.path.isdir(flash_dir):
        raise LocalBenchError(f"flash dir {flash_dir!r} is not a directory: pass --flash-dir an existing directory")
    if not os.access(flash_dir, os.W_OK | os.X_OK):
        raise LocalBenchError(
            f"flash dir {flash_dir!r} is not writable by this user: fix its permissions (chmod u+w) "
            "or pass --flash-dir a writable directory"
        )


def _write_file_s(path: str, payload: bytes) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _drop_from_page_cache(path: str) -> bool:
    """Ask the OS to forget the file's cached pages, so the next read hits the device."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _read_file_s(path: str, size_bytes: int) -> float:
    buffer = bytearray(size_bytes)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        view, done = memoryview(buffer), 0
        while done < size_bytes:
            got = handle.readinto(view[done:])
            if not got:
                break
            done += got
    elapsed_s = time.perf_counter() - start
    if done != size_bytes:
        raise LocalBenchError(f"read back {done} of {size_bytes} bytes from {path!r}")
    return elapsed_s


def fit_latency_throughput(sizes_bytes: list[int], times_s: list[float]) -> tuple[float, float]:
    """Least-squares fit time_s = latency_s + bytes / throughput; returns (latency_s >= 0, bytes/s > 0)."""
    x = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    slope_s_per_byte, latency_s = np.polyfit(x, t, 1)
    if latency_s < 0:  # clamp the latency and refit the slope through the origin
        latency_s = 0.0
        slope_s_per_byte = float(np.dot(x, t) / np.dot(x, x))
    if not np.isfinite(slope_s_per_byte) or slope_s_per_byte <= 0:  # degenerate (flat or noisy): overall rate
        latency_s = 0.0
        slope_s_per_byte = max(float(t.sum()), 1e-12) / float(x.sum())
    return float(latency_s), float(1.0 / slope_s_per_byte)


def measure_paging(
    flash_dir: str, *, quick: bool = False, progress: Callable[[str], None] | None = None
) -> tuple[tuple[float, float], tuple[float, float], dict[str, str]]:
    """((page_out latency_s, bytes/s), (page_in latency_s, bytes/s), notes) for files in ``flash_dir``.

    Files go to a private subdirectory that is removed afterwards, even on error.
    """
    check_flash_dir(flash_dir)
    sizes = _PAGE_SIZES_QUICK_BYTES if quick else _PAGE_SIZES_BYTES
    reps = _PAGE_REPS_QUICK if quick else _PAGE_REPS
    try:
        work_dir = tempfile.mkdtemp(prefix=".poet-bench-", dir=flash_dir)
    except OSError as error:
        raise LocalBenchError(
            f"cannot create files in flash dir {flash_dir!r} ({error.strerror}): fix its permissions "
            "or pass --flash-dir a writable directory"
        ) from None
    write_s: list[float] = []
    read_s: list[float] = []
    cache_dropped = True
    try:
        payload = np.random.default_rng(0).integers(0, 256, size=max(sizes), dtype=np.uint8).tobytes()
        for size in sizes:
            writes, reads = [], []
            for rep in range(reps):
                path = os.path.join(work_dir, f"page-{size}-{rep}.bin")
                writes.append(_write_file_s(path, payload[:size]))
                cache_dropped = _drop_from_page_cache(path) and cache_dropped
                reads.append(_read_file_s(path, size))
                os.unlink(path)
            write_s.append(statistics.median(writes))
            read_s.append(statistics.median(reads))
            _log(
                progress, f"paging {size} bytes: write+fsync {write_s[-1] * 1e3:.3f} ms, read {read_s[-1] * 1e3:.3f} ms"
            )
    except OSError as error:
        raise LocalBenchError(f"paging benchmark in flash dir {flash_dir!r} failed: {error}") from None
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    page_out = fit_latency_throughput(list(sizes), write_s)
    page_in = fit_latency_throughput(list(sizes), read_s)
    fit = f"least-squares fit of time = latency + bytes / throughput over {len(sizes)} sizes {sizes[0]}..{sizes[-1]} bytes, median of {reps} runs each, latency clamped >= 0"
    cache_note = (
        "after fsync + posix_fadvise(DONTNEED)"
        if cache_dropped
        else "page cache NOT dropped (no posix_fadvise here): reads may be cached"
    )
    notes = {
        "page_out.latency_s": f"measured: open + write + fsync + close of files in --flash-dir; {fit}",
        "page_in.latency_s": f"measured: open + read + close of the same files {cache_note}; {fit}",
    }
    notes["page_out.throughput_bytes_per_s"] = notes["page_out.latency_s"]
    notes["page_in.throughput_bytes_per_s"] = notes["page_in.latency_s"]
    return page_out, page_in, notes


# --------------------------------------------------------------------------- profile
def profile_local_machine(
    flash_dir: str,
    *,
    name: str = "local",
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    compute_power_w: float | None = None,
    memory_power_w: float | None = None,
) -> dict:
    """Benchmark this machine's CPU (torch) and ``flash_dir`` storage into a profile with modelled energy.

    ``quick`` keeps the run to a few seconds (tests); the default run takes well under 30 s.
    ``compute_power_w`` / ``memory_power_w`` override the documented power assumptions.
    """
    import torch

    check_flash_dir(flash_dir)  # fail before spending time on the compute benchmark
    machine = platform.machine() or "unknown"
    threads = torch.get_num_threads()
    known_machine = assumed_machine(machine)
    sources: dict[str, str] = {}

    _log(progress, f"benchmarking compute on {machine} with {threads} torch threads")
    flops_per_s, notes = measure_compute_flops_per_s(quick=quick, progress=progress)
    sources.update(notes)
    _log(progress, "benchmarking paging in the flash dir")
    (out_latency_s, out_throughput), (in_latency_s, in_throughput), notes = measure_paging(
        flash_dir, quick=quick, progress=progress
    )
    sources.update(notes)

    if compute_power_w is None:
        per_thread_w = CPU_POWER_PER_THREAD_W[known_machine]
        compute_power_w = per_thread_w * threads
        sources["compute.compute_power_w"] = (
            f"ASSUMPTION (no power meter): {per_thread_w} W per busy CPU thread on {known_machine} x {threads} "
            "torch threads; see device_agent/meters/modelled.py"
        )
    else:
        sources["compute.compute_power_w"] = "given by the user (compute_power_w)"
    if memory_power_w is None:
        memory_power_w = STORAGE_POWER_W[known_machine]
        sources["memory_power_w"] = (
            f"ASSUMPTION (no power meter): storage active power on {known_machine}; see device_agent/meters/modelled.py"
        )
    else:
        sources["memory_power_w"] = "given by the user (memory_power_w)"
    sources["board_power_w"] = "= compute_power_w (no separate whole-board figure)"
    sources["bytes_per_element"] = "float32"
    sources["energy_source"] = (
        "MODELLED, not measured: compute energy = compute time x compute_power_w, paging energy = paging time x memory_power_w"
    )

    description = (
        f"this machine: {machine}, {os.cpu_count()} CPUs, torch {torch.__version__} with {threads} threads, "
        f"measured by poet profile --local{' (quick)' if quick else ''}; energy is modelled (time x assumed power)"
    )
    compute = {"flops_per_s": dict(flops_per_s), "compute_power_w": float(compute_power_w)}
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": name,
        "description": description,
        "compute": compute,
        "page_in": {"latency_s": in_latency_s, "throughput_bytes_per_s": in_throughput},
        "page_out": {"latency_s": out_latency_s, "throughput_bytes_per_s": out_throughput},
        "memory_power_w": float(memory_power_w),
        "board_power_w": float(compute_power_w),
        "bytes_per_element": 4,
        "energy_source": ENERGY_SOURCE,
        "sources": sources,
    }
