"""The firmware on QEMU trains through a line that corrupts 1% of the bytes (FaultProxy) exactly as on a clean one.

At 1% per byte a 4 KB frame practically never arrives whole (0.99**4100 = 1e-18), so both ends fragment every
message: the host by Link(fragment_bytes=...), the board by the hello's max_fragment_bytes, in frames sized by
fragment_bytes_for(0.01) (47 payload bytes) with ACK timeouts of tens of ms. The same firmware, weights and batches
on a clean link give bit-identical parameters and losses; both ends count the CRC errors and resends they saw.
The run prints the link's figures: payload bytes per second each way, frames per message, wire bytes per payload
byte.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from device_agent.agent.program import load_module
from device_agent.serde import schedule_to_proto
from device_agent.serial_bridge.board import McuBoard
from device_agent.serial_bridge.link import Link, LinkCounters, ack_timeout_s_for, fragment_bytes_for
from device_agent.serial_bridge.model import mcu_model, parameter_tensors
from device_agent.serial_bridge.proxy import FaultProxy
from device_agent.serial_bridge.qemu import QemuBoard
from host.fleet.model_package import package_model

FIRMWARE_DIR = Path(__file__).resolve().parents[3] / "device_agent" / "firmware" / "cortex_m"
ELF = FIRMWARE_DIR / "build" / "poet_fw.elf"
BATCH, STEPS, LR, MOMENTUM = 8, 2, 0.05, 0.9
CORRUPT = 0.01

_TOOLS = ("make", "arm-none-eabi-gcc", "qemu-system-arm", "protoc", "protoc-gen-nanopb")
_missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"firmware toolchain missing: {', '.join(_missing)}")


@pytest.fixture(scope="module")
def firmware_elf() -> Path:
    """The firmware, built with its Makefile (incremental)."""
    done = subprocess.run(["make", "-C", str(FIRMWARE_DIR)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"make in {FIRMWARE_DIR} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return ELF


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The zoo mlp at batch 8 as the coordinator packages it, its keep-all schedule, McuModel, weights, batches."""
    from poet_edge import solve

    schedule = solve(model="mlp", platform="m4", ram_budget="100%", batch_size=BATCH, time_limit_s=60,
                     solve_threads=1).schedule
    assert schedule is not None
    package = package_model("mlp", tmp_path_factory.mktemp("package"), batch_size=BATCH)
    assert package.graph.fingerprint() == schedule.graph_fingerprint
    module = load_module(package.path)
    program = mcu_model(module, package.grouping, schedule, learning_rate=LR, momentum=MOMENTUM)
    generator = torch.Generator().manual_seed(BATCH)
    batches = [(torch.randn(BATCH, 64, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
               for _ in range(STEPS)]
    return schedule_to_proto(schedule), program, parameter_tensors(module, program), batches


@dataclass
class Run:
    params: dict
    losses: list
    done: object  # the last McuStepDone
    info: object
    host: LinkCounters
    up_bytes_per_s: float  # payload, while the weights go to the board
    down_bytes_per_s: float  # payload, while they come back
    up: LinkCounters  # the host's counters over the weights' upload ...
    down: LinkCounters  # ... and over their download
    corrupted: int = 0


def _delta(after: LinkCounters, before: LinkCounters) -> LinkCounters:
    return LinkCounters(**{name: getattr(after, name) - getattr(before, name) for name in after.__dataclass_fields__})


def _train(elf: Path, flash_dir: Path, job, corrupt: float = 0.0) -> Run:
    """Boot the board, load the job, upload the weights, run STEPS steps, read the weights back."""
    schedule, program, params, batches = job
    link_options, hello_options = {}, {}
    if corrupt:
        fragment = fragment_bytes_for(corrupt)
        timeout_s = ack_timeout_s_for(fragment)
        link_options = {"fragment_bytes": fragment, "ack_timeout_s": timeout_s}
        hello_options = {"max_fragment_bytes": fragment, "ack_timeout_ms": round(timeout_s * 1000)}
    with contextlib.ExitStack() as stack:
        qemu = stack.enter_context(QemuBoard(elf, flash_dir=flash_dir))
        url, proxy = qemu.serial_url, None
        if corrupt:
            host, _, port = url.removeprefix("socket://").rpartition(":")
            proxy = stack.enter_context(FaultProxy(host, int(port), corrupt_probability=corrupt, seed=7))
            url = f"socket://127.0.0.1:{proxy.port}"
        link = stack.enter_context(Link.connect(url, **link_options))
        mcu = McuBoard(link)
        info = mcu.hello(timeout_s=30, **hello_options)
        mcu.load_model(program.model)
        mcu.load_schedule(schedule)
        before, started = link.counters, time.monotonic()
        mcu.write_params(params)
        up_s, after_up = time.monotonic() - started, link.counters
        losses = []
        for step, (inputs, labels) in enumerate(batches, start=1):
            _, done = mcu.run_step(step, inputs, labels)
            losses.append(done.loss)
        before_down, started = link.counters, time.monotonic()
        trained = mcu.read_params()
        down_s, after = time.monotonic() - started, link.counters
        up, down = _delta(after_up, before), _delta(after, before_down)
        return Run(trained, losses, done, info, after, up.payload_bytes_sent / up_s,
                   down.payload_bytes_received / down_s, up, down, proxy.bytes_corrupted if proxy else 0)


@pytest.mark.slow  # ~60 s: 104 KB of weights each way in 47-byte fragments, a third of them hit
def test_training_through_1_percent_corrupted_bytes_equals_a_clean_link(firmware_elf, job, tmp_path):
    clean = _train(firmware_elf, tmp_path / "clean", job)
    lossy = _train(firmware_elf, tmp_path / "lossy", job, corrupt=CORRUPT)

    fragment = fragment_bytes_for(CORRUPT)
    assert (clean.info.max_fragment_bytes, clean.info.ack_timeout_ms) == (4096, 100)  # the board's defaults
    timeout_ms = round(ack_timeout_s_for(fragment) * 1000)
    assert (lossy.info.max_fragment_bytes, lossy.info.ack_timeout_ms) == (fragment, timeout_ms)  # applied
    # same firmware, same weights, same batches: the same bits
    assert lossy.losses == clean.losses
    assert lossy.params.keys() == clean.params.keys()
    for key, values in clean.params.items():
        assert torch.equal(lossy.params[key], values), key
    assert not torch.equal(clean.params[(1, 0)], job[2][0][2].reshape(-1))  # training moved the weights

    assert lossy.corrupted > 0
    assert lossy.done.link_crc_errors > 0 and lossy.done.link_retransmissions > 0  # the board's, since boot
    assert lossy.host.crc_errors > 0 and lossy.host.frames_retransmitted > 0
    assert clean.done.link_crc_errors == 0 and clean.host.crc_errors == 0
    assert lossy.up.fragments_sent > 10 * lossy.up.messages_sent  # ~87 fragments per 4 KB parameter chunk
    assert lossy.down.fragments_received > 10 * lossy.down.messages_received
    assert clean.up.fragments_sent == clean.up.messages_sent

    figures = {}
    for name, run in (("clean", clean), ("1%", lossy)):
        figures[name] = {
            "up_payload_B_per_s": round(run.up_bytes_per_s),
            "down_payload_B_per_s": round(run.down_bytes_per_s),
            "up_frames_per_message": round(run.up.fragments_sent / run.up.messages_sent, 1),
            "down_frames_per_message": round(run.down.fragments_received / run.down.messages_received, 1),
            "up_wire_B_per_payload_B": round(run.up.bytes_written / run.up.payload_bytes_sent, 3),
            "down_wire_B_per_payload_B": round(run.down.bytes_read / run.down.payload_bytes_received, 3),
            "host_retransmissions": run.host.frames_retransmitted,
            "host_crc_errors": run.host.crc_errors,
            "board_retransmissions": run.done.link_retransmissions,
            "board_crc_errors": run.done.link_crc_errors,
        }
    print(f"\nlink figures: {figures}")
