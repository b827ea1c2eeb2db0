"""The Cortex-M firmware (device_agent/firmware/cortex_m) built with make and booted on QEMU's mps2-an386 trains
the zoo's ``mlp`` under POET schedules as PyTorch does: same initial weights, same batches, SGD with momentum.

Parameters are compared after every schedule's steps as max over tensors of max|board - torch| / max|torch|;
they are not bit-identical because the board sums in a fixed order (k ascending, fp32) where torch's BLAS blocks
and vectorises its sums, and expf/logf differ in the last ulp; the target is <= 1e-5. The board's own accounting
is checked against the schedule: one event per instruction (kind, node, bytes moved, arena in use equal to the
schedule's replay), the executed counts, and the arena high-water mark, which must stay within the RAM budget.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from device_agent.agent.program import load_module
from device_agent.replay import replay
from device_agent.schedule import Schedule
from device_agent.serde import schedule_to_proto
from device_agent.serial_bridge.board import McuBoard, McuBoardError, schedule_pb2
from device_agent.serial_bridge.link import Link
from device_agent.serial_bridge.model import mcu_model, parameter_tensors
from device_agent.serial_bridge.qemu import QemuBoard
from host.fleet.model_package import package_model
from host.graph import zoo
from host.mcu import McuModelError, TorchReference, max_relative_difference

FIRMWARE_DIR = Path(__file__).resolve().parents[3] / "device_agent" / "firmware" / "cortex_m"
ELF = FIRMWARE_DIR / "build" / "poet_fw.elf"
FLASH_FILE = "poet_flash.bin"  # src/flash_semihost.c
PAGE_MAGIC = 0x50474550  # src/pages.c
PAGE_HEADER_BYTES = 16
TOLERANCE = 1e-5
LR, MOMENTUM, STEPS = 0.05, 0.9, 3

_TOOLS = ("make", "arm-none-eabi-gcc", "qemu-system-arm", "protoc", "protoc-gen-nanopb")
_missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
needs_toolchain = pytest.mark.skipif(bool(_missing), reason=f"firmware toolchain missing: {', '.join(_missing)}")
needs_host_cc = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("make") is None,
                                   reason="no host C compiler")


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def firmware_elf() -> Path:
    """The firmware, built with its Makefile (incremental; fetches nanopb's runtime once)."""
    done = subprocess.run(["make", "-C", str(FIRMWARE_DIR)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"make in {FIRMWARE_DIR} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    assert ELF.is_file()
    return ELF


@pytest.fixture
def board(firmware_elf, tmp_path):
    """A freshly booted emulated board, its session opened: (McuBoard, QemuBoard)."""
    with QemuBoard(firmware_elf, flash_dir=tmp_path / "flash") as qemu:
        link = Link.connect(qemu.serial_url)
        try:
            mcu = McuBoard(link)
            info = mcu.hello()
            assert (info.board, info.platform, info.emulated) == ("mps2-an386", "m4", True)
            assert info.session_id != 0 and info.tick_hz == 25_000_000
            yield mcu, qemu
        finally:
            link.close()


def _solve(batch_size: int, ram_budget, **options) -> Schedule:
    from poet_edge import solve

    report = solve(model="mlp", platform="m4", ram_budget=ram_budget, batch_size=batch_size, time_limit_s=60,
                   solve_threads=1, **options)
    assert report.schedule is not None, report.message
    return report.schedule


class Setup:
    """The mlp at one batch size, as a board receives it: the exported program and its grouping (as the coordinator
    packages it), its McuModel, its initial weights, a PyTorch reference, its batches."""

    def __init__(self, batch_size: int, schedule: Schedule, cache_dir: Path) -> None:
        package = package_model("mlp", cache_dir, batch_size=batch_size)
        assert package.graph.fingerprint() == schedule.graph_fingerprint
        self.module = load_module(package.path)
        self.program = mcu_model(self.module, package.grouping, schedule, learning_rate=LR, momentum=MOMENTUM)
        self.params = parameter_tensors(self.module, self.program)
        self.initial = {(layer, tensor): values.reshape(-1).clone() for layer, tensor, values in self.params}
        self.reference = TorchReference(self.module, self.program)
        self.generator = torch.Generator().manual_seed(batch_size)
        self.batch_size = batch_size
        self.step = 0

    def batch(self):
        inputs = torch.randn(self.batch_size, 64, generator=self.generator)
        labels = torch.randint(0, 10, (self.batch_size,), generator=self.generator)
        return inputs, labels

    def start(self, mcu, schedule: Schedule, *, weights: bool = True) -> None:
        """Load the model and the schedule; send the initial weights (without them the board's are zeros)."""
        mcu.load_model(self.program.model)
        mcu.load_schedule(schedule)
        if weights:
            mcu.write_params(self.params)
        else:
            self.initial = {key: torch.zeros_like(values) for key, values in self.initial.items()}


def _train(mcu, setup: Setup, schedule: Schedule, steps: int = STEPS) -> dict:
    """``steps`` steps on the board and in torch; checks every event and count; returns the figures."""
    trace = replay(schedule.nodes, schedule.instructions, graph_label="mlp", ram_budget_bytes=schedule.ram_budget_bytes)
    counts = schedule.counts()
    frees = sum(1 for ins in schedule.instructions if ins.kind == "free")
    paged_out = sum(schedule.nodes[ins.node].output_bytes for ins in schedule.instructions if ins.kind == "page_out")
    walls, ticks, high_water = [], [], 0
    for _ in range(steps):
        setup.step += 1
        inputs, labels = setup.batch()
        started = time.monotonic()
        events, done = mcu.run_step(setup.step, inputs, labels)
        walls.append(time.monotonic() - started)
        torch_loss = setup.reference.step(inputs, labels)

        assert len(events) == len(schedule.instructions)
        for position, (event, ins) in enumerate(zip(events, schedule.instructions, strict=True)):
            assert (event.step, event.position, event.node) == (setup.step, position, ins.node)
            assert event.kind == {"compute": 1, "page_out": 2, "page_in": 3, "free": 4}[ins.kind]
            moved = schedule.nodes[ins.node].output_bytes if ins.kind in ("page_in", "page_out") else 0
            assert event.bytes_moved == moved, f"instruction {position} {ins}"
            assert event.arena_in_use_bytes == trace.ram_timeline_bytes[position], f"instruction {position} {ins}"
        assert done.step == setup.step
        assert (done.computes, done.page_ins, done.page_outs, done.frees) == (
            counts["computes"], counts["page_ins"], counts["page_outs"], frees)
        assert done.bytes_paged_out == done.bytes_paged_in == paged_out
        assert done.arena_high_water_bytes == trace.peak_ram_bytes <= schedule.ram_budget_bytes
        assert done.ticks >= sum(event.ticks for event in events) > 0
        assert abs(done.loss - torch_loss) <= TOLERANCE * abs(torch_loss), (done.loss, torch_loss)
        ticks.append(done.ticks)
        high_water = done.arena_high_water_bytes
    board_params = mcu.read_params()
    difference = max_relative_difference(board_params, setup.reference.params())
    moved = max_relative_difference(board_params, setup.initial)
    assert moved > 1e-3, "training did not change the parameters"
    assert difference <= TOLERANCE, f"max relative difference {difference:.3g} > {TOLERANCE}"
    figures = {"max_rel_diff": difference, "high_water_bytes": high_water, "budget_bytes": schedule.ram_budget_bytes,
               "step_ticks": ticks, "wall_s_per_step": [round(w, 3) for w in walls], "counts": counts}
    print(f"\nbatch {setup.batch_size}, {counts}: {figures}")
    return figures


# ------------------------------------------------------------------------------------------------ tests
@needs_host_cc
def test_c_page_store_arena_and_link_on_the_host(tmp_path):
    """The C tests, on the host: src/pages.c over a RAM flash device (flipped data, header or CRC bytes are refused
    on page-in), src/arena.c (declared-byte accounting, compaction) and src/link.c against a scripted peer
    (framing.py's golden frames, hello, sequence numbers, CRC errors, resends, giving up)."""
    done = subprocess.run(["make", "-C", str(FIRMWARE_DIR), f"BUILD_DIR={tmp_path}", "host-test"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED: 0 failure(s)") == 3, done.stdout
    assert "FAIL" not in done.stdout
    assert "ok   a flipped data bit is refused on page-in (CRC-32)" in done.stdout
    assert "ok   DATA frame bytes equal framing.py's golden frame" in done.stdout


@pytest.mark.slow  # ~12 s: 104 KB of weights cross the emulated UART at ~30 KB/s
@needs_toolchain
def test_keep_all_and_recompute_schedules_train_like_torch(board, tmp_path):
    mcu, _ = board
    keep_all = _solve(8, "100%")
    remat = _solve(8, 12288)  # the minimum RAM of the graph: recomputes two forward nodes
    assert keep_all.counts()["recomputes"] == 0 and remat.counts()["recomputes"] > 0
    setup = Setup(8, keep_all, tmp_path)
    setup.start(mcu, keep_all)
    first = _train(mcu, setup, keep_all)
    assert first["high_water_bytes"] == 16384
    # the same training continues under the recomputing schedule: momentum buffers and weights carry over
    mcu.load_schedule(remat)
    second = _train(mcu, setup, remat)
    assert second["high_water_bytes"] == 12288


@pytest.mark.slow  # ~12 s: 104 KB of weights cross the emulated UART at ~30 KB/s
@needs_toolchain
def test_paging_schedule_trains_where_plain_training_does_not_fit(board, tmp_path):
    """Batch 160: plain training needs 320 KiB of activations, more than the board's 256 KiB arena. The keep-all
    schedule is refused by the board; the POET schedule at 250,000 bytes pages to flash and trains as torch."""
    mcu, qemu = board
    info = mcu.info
    keep_all = _solve(160, "100%")
    paging = _solve(160, 250_000, remat=False)
    assert keep_all.ram_budget_bytes > info.arena_bytes >= paging.ram_budget_bytes
    assert paging.counts()["page_outs"] >= 1 and paging.counts()["recomputes"] == 0
    setup = Setup(160, paging, tmp_path)
    setup.start(mcu, keep_all)
    inputs, labels = setup.batch()
    with pytest.raises(McuBoardError, match=r"instruction \d+ \(compute node \d+ .*arena full"):
        mcu.run_step(1, inputs, labels)
    assert max_relative_difference(mcu.read_params(), setup.initial) == 0.0  # a failed step changes nothing
    setup.generator.manual_seed(160)
    mcu.load_schedule(paging)
    figures = _train(mcu, setup, paging)
    assert figures["high_water_bytes"] <= paging.ram_budget_bytes < 262_144
    assert (qemu.flash_dir / FLASH_FILE).stat().st_size >= PAGE_HEADER_BYTES + 160 * 128 * 4


@needs_toolchain
def test_corrupted_page_is_refused_on_page_in(board, tmp_path):
    """Between the page-out and the page-in of node 2 one byte of its page changes in the flash file: the board
    refuses the page-in with the CRC-32, leaves the parameters alone, and the next clean step runs."""
    mcu, qemu = board
    paging = _solve(8, 12288, remat=False)
    page_out = next(i for i in paging.instructions if i.kind == "page_out")
    page_in_at = next(p for p, i in enumerate(paging.instructions) if i.kind == "page_in" and i.node == page_out.node)
    setup = Setup(8, paging, tmp_path)
    setup.start(mcu, paging, weights=False)  # zero weights still page the same bytes: spare the upload
    flash = qemu.flash_dir / FLASH_FILE
    corrupted = []

    def corrupt(event):
        # the board waits for this event to be taken before its next instruction, so the page is on flash now
        # and the page-in, several instructions later, has not run
        if event.kind == 2 and not corrupted:
            with open(flash, "r+b") as f:
                magic, node, size, _ = struct.unpack("<4I", f.read(PAGE_HEADER_BYTES))
                assert (magic, node, size) == (PAGE_MAGIC, page_out.node, paging.nodes[page_out.node].output_bytes)
                f.seek(PAGE_HEADER_BYTES + 1000)
                byte = f.read(1)[0]
                f.seek(PAGE_HEADER_BYTES + 1000)
                f.write(bytes([byte ^ 0x10]))
            corrupted.append(event.position)

    inputs, labels = setup.batch()
    with pytest.raises(McuBoardError) as refused:
        mcu.run_step(1, inputs, labels, on_event=corrupt)
    assert corrupted
    message = refused.value.board_message
    assert f"instruction {page_in_at} (page_in node {page_out.node} " in message
    assert "fails its CRC-32" in message
    assert max_relative_difference(mcu.read_params(), setup.initial) == 0.0  # a failed step changes nothing
    events, done = mcu.run_step(1, inputs, labels)  # the same batch again, uncorrupted: the board recovered
    assert len(events) == len(paging.instructions)
    assert (done.page_outs, done.page_ins) == (1, 1) and done.bytes_paged_in == 4096


@needs_toolchain
def test_board_refuses_what_breaks_the_schedule(board, tmp_path):
    """McuError names the instruction's position and node: an op writing more than its node declares, a compute
    whose inputs are not in RAM, a free of a copy that is not there, a schedule for another graph."""
    mcu, _ = board
    keep_all = _solve(8, "100%")
    setup = Setup(8, keep_all, tmp_path)
    setup.start(mcu, keep_all, weights=False)
    inputs, labels = setup.batch()

    def refused(message, pattern):
        mcu.load_schedule(message)
        with pytest.raises(McuBoardError, match=pattern):
            mcu.run_step(1, inputs, labels)

    short = schedule_to_proto(keep_all)
    short.nodes[3].output_bytes -= 4  # linear '2' writes 8 x 128 floats
    refused(short, r"instruction 4 \(compute node 3 '2'\): the op writes 4096 bytes; the schedule declares 4092")

    swapped = schedule_to_proto(keep_all)
    swapped.instructions[1].node, swapped.instructions[2].node = 2, 1
    refused(swapped, r"instruction 1 \(compute node 2 '1'\): needs node 1 '0' in RAM")

    double_free = schedule_to_proto(keep_all)
    double_free.instructions.append(schedule_pb2.Instruction(kind=4, node=12, location=1))
    refused(double_free, r"instruction 26 \(free node 12 'bwd:0' @ram\): cannot free from RAM")

    no_free = schedule_to_proto(keep_all)
    del no_free.instructions[-1]
    refused(no_free, r"node 12 'bwd:0' is still in RAM")

    other = schedule_to_proto(keep_all)
    other.nodes[3].deps[0] = 1  # linear '2' reading linear '0': not this model's chain
    with pytest.raises(McuBoardError, match=r"node 3 '2': its dep 1 must be the forward node of layer 2"):
        mcu.load_schedule(other)
    assert max_relative_difference(mcu.read_params(), setup.initial) == 0.0


def _program(module: nn.Module, tmp_path: Path, loss_fn=None, **options):
    """The McuModel of ``module`` on a batch of 4 x 64, as a board receives it (packaged, then mapped)."""
    from poet_edge import solve

    bundle = zoo.ModelBundle("m", module, (torch.randn(4, 64),), torch.randint(0, 10, (4,)),
                             loss_fn or zoo.default_loss)
    package = package_model(bundle, tmp_path)
    schedule = solve(model=bundle, platform="m4", ram_budget="100%", time_limit_s=60, solve_threads=1).schedule
    return mcu_model(load_module(package.path), package.grouping, schedule, learning_rate=0.1, **options)


def test_the_mapping_refuses_what_the_firmware_cannot_train(tmp_path):
    program = _program(zoo.ZOO["mlp"].bundle().module, tmp_path)
    assert [layer.op for layer in program.model.layers] == [1, 2, 3, 2, 3, 2, 4]
    assert list(program.model.node_layer) == [0, 1, 2, 3, 4, 5, 6, 6, 5, 4, 3, 2, 1]
    assert [(p.layer, p.weight_name) for p in program.params] == [(1, "model.0.weight"), (3, "model.2.weight"),
                                                                 (5, "model.4.weight")]
    with pytest.raises(McuModelError, match=r"node '1' runs aten.tanh.default; the firmware trains linear, ReLU"):
        _program(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), tmp_path)
    with pytest.raises(McuModelError, match=r"node '0': the firmware's linear layers have a bias"):
        _program(nn.Sequential(nn.Linear(64, 10, bias=False)), tmp_path)
    smoothed = lambda output, labels: nn.functional.cross_entropy(output, labels, label_smoothing=0.1)  # noqa: E731
    with pytest.raises(McuModelError, match=r"the cross-entropy sets label_smoothing=0.1"):
        _program(nn.Sequential(nn.Linear(64, 10)), tmp_path, smoothed)
    with pytest.raises(McuModelError, match=r"momentum must be in \[0, 1\)"):
        _program(nn.Sequential(nn.Linear(64, 10)), tmp_path, momentum=1.5)
