"""`poet mcu run`: train a model on Cortex-M firmware under its POET schedule and compare with PyTorch.

One shot, on this machine: build the firmware if needed (its Makefile), boot it on QEMU's mps2-an386 (or use a
board on a serial line), package the model as the coordinator does (torch.export archive and node grouping),
solve its schedule for the board (platform ``m4``, the RAM budget within the board's arena), send the weights,
the schedule and each step's batch, and compare the board's parameters with plain PyTorch training of the same
program on the same batches. ``link_corrupt`` puts a fault-injecting proxy on the link (a share of the bytes
corrupted, some dropped); the link retransmits, and the parameters must come out the same.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from host.run.errors import InputError

FIRMWARE_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "firmware" / "cortex_m"
FIRMWARE_ELF = "poet_fw.elf"
PLATFORM = "m4"
TOLERANCE = 1e-5  # relative; the board sums in fp32 in a fixed order where torch's BLAS blocks its sums
BUILD_TIMEOUT_S = 600.0


@dataclass
class McuCounts:
    computes: int
    page_ins: int
    page_outs: int


@dataclass
class McuRunReport:
    """What `poet mcu run --json` prints. Memory in bytes, time in seconds; ``ticks`` are the board's clock."""

    ok: bool
    model: str
    board: str
    emulated: bool
    steps: int
    batch_size: int
    max_rel_param_diff: float
    tolerance: float
    arena_high_water_bytes: int
    arena_bytes: int
    ram_budget_bytes: float
    planned: McuCounts
    executed: McuCounts
    losses: list[float]
    step_ticks: list[int]
    step_s: list[float]  # from ticks: the board's clock (under QEMU: emulated, not a real board's timing)
    timing_source: str
    frames_sent: int
    frames_retransmitted: int
    crc_errors: int
    link_corrupt: float
    link: dict[str, Any] = field(default_factory=dict)  # per side, and throughput
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_firmware(log: Callable[[str], None] = lambda message: None, build_dir: Path | None = None) -> Path:
    """The firmware ELF, built (incrementally) with its Makefile; a clear error when the toolchain is missing."""
    import shutil

    if not (FIRMWARE_DIR / "Makefile").is_file():
        raise InputError("the firmware's sources come with a checkout of poet-edge (device_agent/firmware/cortex_m), "
                         "not with the wheel: run from a checkout, or pass --serial URL to a board already flashed")
    missing = [tool for tool in ("make", "arm-none-eabi-gcc", "protoc") if shutil.which(tool) is None]
    if missing:
        raise InputError(f"cannot build the firmware: {', '.join(missing)} not found; run `make setup`, which "
                         "installs Debian's gcc-arm-none-eabi, libnewlib-arm-none-eabi, qemu-system-arm, nanopb and "
                         "protobuf-compiler")
    argv = ["make", "-s", "-C", str(FIRMWARE_DIR)]
    if build_dir is not None:
        argv.append(f"BUILD_DIR={build_dir}")
    log("building the firmware (make -C device_agent/firmware/cortex_m)")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"building the firmware failed (make exited {done.returncode}):\n{tail}")
    return Path(build_dir or FIRMWARE_DIR / "build") / FIRMWARE_ELF


@contextlib.contextmanager
def _board_log_on_link_error(qemu):
    """A link error on an emulated board carries the end of QEMU's log (the firmware's console, a fault)."""
    from device_agent.serial_bridge.link import LinkError

    try:
        yield
    except LinkError as error:
        raise type(error)(f"{error}\nthe emulated board's log ({qemu.log_path}) ends with:\n{qemu.log_tail()}") \
            from error


def _batches(package, steps: int, seed: int):
    """Seeded random batches of the model's input shape and class count (the data never matters to exactness)."""
    generator = torch.Generator().manual_seed(seed)
    shape = tuple(package.grouping.batch_shape)
    classes = int(package.grouping.num_classes)
    label_shape = tuple(package.grouping.class_index_shape)
    for _ in range(steps):
        yield (torch.randn(*shape, generator=generator),
               torch.randint(0, classes, label_shape, generator=generator))


def run_mcu(model: Any, *, steps: int, ram_budget: Any, batch_size: int | None = None, learning_rate: float = 0.05,
            momentum: float = 0.9, runtime_budget: float = 2.0, link_corrupt: float = 0.0, seed: int = 0,
            serial: str | None = None, work_dir: str | Path | None = None, time_limit_s: float = 60.0,
            paging: bool = True, remat: bool = True, log: Callable[[str], None] = lambda message: None) -> McuRunReport:
    """Train ``model`` for ``steps`` steps on the firmware (QEMU unless ``serial`` names a board's line)."""
    from device_agent.agent.program import load_module
    from device_agent.serde import schedule_to_proto
    from device_agent.serial_bridge.board import McuBoard
    from device_agent.serial_bridge.link import Link
    from device_agent.serial_bridge.model import mcu_model, parameter_tensors
    from host.fleet.model_package import package_model
    from host.mcu.model import TorchReference, max_relative_difference
    from host.run.solve import solve

    if not 0 <= link_corrupt < 0.5:
        raise InputError(f"--link-corrupt {link_corrupt} is not a share of the bytes in [0, 0.5) (e.g. 0.01 for 1%)")
    if steps < 1:
        raise InputError(f"steps must be >= 1, not {steps}")
    with contextlib.ExitStack() as stack:
        work = Path(work_dir) if work_dir is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="poet-mcu-")))
        elf = None if serial else build_firmware(log)
        log(f"packaging {model} as the coordinator does")
        package = package_model(model, work / "models", batch_size=batch_size, seed=seed)
        module = load_module(package.path)
        # refused here, before a board is booted, when the firmware cannot train it (the graph's nodes and deps
        # are the schedule's)
        program = mcu_model(module, package.grouping, package.graph, learning_rate=learning_rate, momentum=momentum)
        if serial is None:
            from device_agent.serial_bridge.qemu import QemuBoard

            log("booting the firmware on QEMU (mps2-an386)")
            qemu = stack.enter_context(QemuBoard(elf, flash_dir=work / "flash"))
            stack.enter_context(_board_log_on_link_error(qemu))
            serial = qemu.serial_url
        link_options: dict[str, Any] = {}
        hello_options: dict[str, Any] = {}
        if link_corrupt:
            from device_agent.serial_bridge.link import ack_timeout_s_for, fragment_bytes_for
            from device_agent.serial_bridge.proxy import FaultProxy

            host, _, port = serial.removeprefix("socket://").rpartition(":")
            if not serial.startswith("socket://"):
                raise InputError("--link-corrupt needs a socket:// line (QEMU's): the proxy sits on TCP")
            proxy = stack.enter_context(FaultProxy(host, int(port), corrupt_probability=link_corrupt, seed=seed))
            serial = f"socket://127.0.0.1:{proxy.port}"
            fragment, ack_timeout_s = fragment_bytes_for(link_corrupt), ack_timeout_s_for(fragment_bytes_for(link_corrupt))
            link_options.update(fragment_bytes=fragment, ack_timeout_s=ack_timeout_s)
            hello_options.update(max_fragment_bytes=fragment, ack_timeout_ms=max(1, round(ack_timeout_s * 1000)))
            log(f"fault-injecting proxy on the link: {link_corrupt:.2%} of the bytes corrupted, "
                f"{proxy.drop_probability:.2%} dropped; frames of {fragment} payload bytes")
        link = stack.enter_context(Link.connect(serial, **link_options))
        board = McuBoard(link)
        info = board.hello(**hello_options)
        log(f"board {info.board}: arena {info.arena_bytes} bytes, flash {info.flash_bytes} bytes"
            f"{' (emulated)' if info.emulated else ''}")

        log(f"solving for {info.board} ({PLATFORM}) at RAM budget {ram_budget}")
        report = solve(model=model, platform=PLATFORM, ram_budget=ram_budget, batch_size=batch_size, seed=seed,
                       runtime_budget=runtime_budget, time_limit_s=time_limit_s, solve_threads=1, paging=paging,
                       remat=remat)
        schedule = report.schedule
        if schedule is None:
            raise InputError(f"no schedule for {model} at RAM budget {ram_budget}: {report.message}")
        if schedule.graph_fingerprint != package.graph.fingerprint():
            raise RuntimeError("the solved graph differs from the packaged one (tracing is not deterministic here)")
        if schedule.ram_budget_bytes > info.arena_bytes:
            raise InputError(f"RAM budget {schedule.ram_budget_bytes:.0f} bytes exceeds the board's activation arena "
                             f"({info.arena_bytes} bytes); give --ram-budget of at most {info.arena_bytes}")
        reference = TorchReference(module, program)
        started = time.monotonic()
        board.load_model(program.model)
        board.load_schedule(schedule_to_proto(schedule))
        board.write_params(parameter_tensors(module, program))
        log(f"sent the model, the schedule and {sum(v.numel() for _, _, v in parameter_tensors(module, program))} "
            f"parameters in {time.monotonic() - started:.1f} s")

        planned = schedule.counts()
        losses, ticks, executed, high_water, problems = [], [], None, 0, []
        for step, (inputs, labels) in enumerate(_batches(package, steps, seed), start=1):
            _, done = board.run_step(step, inputs, labels)
            reference_loss = reference.step(inputs, labels)
            losses.append(float(done.loss))
            ticks.append(int(done.ticks))
            high_water = max(high_water, int(done.arena_high_water_bytes))
            step_counts = McuCounts(done.computes, done.page_ins, done.page_outs)
            if step_counts != McuCounts(planned["computes"], planned["page_ins"], planned["page_outs"]):
                problems.append(f"step {step} executed {asdict(step_counts)}, the schedule plans "
                                f"{ {k: planned[k] for k in ('computes', 'page_ins', 'page_outs')} }")
            executed = step_counts
            log(f"step {step}/{steps}: loss {done.loss:.4f} (PyTorch {reference_loss:.4f}), "
                f"{done.ticks / info.tick_hz * 1e3:.3f} ms on the board's clock, arena high-water {high_water} bytes")
        board_params = board.read_params()
        transfer_s = time.monotonic() - started
        difference = max_relative_difference(board_params, reference.params())
        if difference > TOLERANCE:
            problems.append(f"parameters differ from PyTorch's by {difference:.3g} (relative), over {TOLERANCE:g}")
        if high_water > schedule.ram_budget_bytes:
            problems.append(f"arena high-water {high_water} bytes exceeds the budget {schedule.ram_budget_bytes:.0f}")
        host = link.counters
        last = done
        link_figures = {
            "host": asdict(host),
            "board": {"crc_errors": int(last.link_crc_errors), "frames_retransmitted": int(last.link_retransmissions)},
            "payload_bytes": host.payload_bytes_sent + host.payload_bytes_received,
            "wire_bytes": host.bytes_written + host.bytes_read,
            "seconds": round(transfer_s, 3),
        }
        return McuRunReport(
            ok=not problems, model=package.model, board=info.board, emulated=bool(info.emulated), steps=steps,
            batch_size=package.batch_size, max_rel_param_diff=difference, tolerance=TOLERANCE,
            arena_high_water_bytes=high_water, arena_bytes=int(info.arena_bytes),
            ram_budget_bytes=float(schedule.ram_budget_bytes),
            planned=McuCounts(planned["computes"], planned["page_ins"], planned["page_outs"]),
            executed=executed, losses=losses, step_ticks=ticks, step_s=[t / info.tick_hz for t in ticks],
            timing_source=f"emulated:qemu-{info.board}" if info.emulated else "measured:board-clock",
            frames_sent=host.frames_sent, frames_retransmitted=host.frames_retransmitted + int(last.link_retransmissions),
            crc_errors=host.crc_errors + int(last.link_crc_errors), link_corrupt=link_corrupt, link=link_figures,
            problems=problems)


__all__ = ["FIRMWARE_DIR", "McuCounts", "McuRunReport", "build_firmware", "run_mcu"]
