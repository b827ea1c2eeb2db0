"""`poet-agent bridge` end to end: the Cortex-M firmware booted in QEMU (mps2-an386), presented to a real
`poet serve` by the bridge as one more agent, trains the coordinator's runs on the board.

Every command runs in its own process from the installed console scripts, as in test_fleet_e2e.py: `poet serve`,
`poet-agent bridge --serial socket://127.0.0.1:PORT` (QEMU's UART), `poet run`, `poet runs show`, `poet fleet list`.
The digits dataset lives in the bridge's data dir (`poet-agent datasets make-demo`); batches go from there to the
board over the serial line, never to the coordinator. VERIFY runs compare the board's trained parameters with
plain PyTorch training of the same program on the bridge's host (max relative difference <= 1e-5).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import POET_AGENT, Process, dump
from tests.host.cli.helpers import test_env

FIRMWARE_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "firmware" / "cortex_m"
ELF = FIRMWARE_DIR / "build" / "poet_fw.elf"
BOARD, ARENA_BYTES = "mps2-an386", 262_144
NODE = "b1"
TOLERANCE = 1e-5
LR = "0.05"

_TOOLS = ("make", "arm-none-eabi-gcc", "qemu-system-arm", "protoc", "protoc-gen-nanopb")
_missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
needs_toolchain = pytest.mark.skipif(bool(_missing), reason=f"firmware toolchain missing: {', '.join(_missing)}")


@pytest.fixture(scope="module")
def firmware_elf() -> Path:
    """The firmware, built with its Makefile (incremental)."""
    done = subprocess.run(["make", "-C", str(FIRMWARE_DIR)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"make in {FIRMWARE_DIR} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return ELF


@pytest.fixture
def qemu(firmware_elf, tmp_path):
    """A freshly booted emulated board (its UART on a loopback port)."""
    from device_agent.serial_bridge.qemu import QemuBoard

    with QemuBoard(firmware_elf, flash_dir=tmp_path / "board-flash") as board:
        yield board


def bridge_argv(serial_url: str, coordinator: str, certs: Path, root: Path, *extra: str) -> list[str]:
    return [str(POET_AGENT), "bridge", "--serial", serial_url, "--coordinator", coordinator, "--certs", str(certs),
            "--data-dir", str(root / "data"), "--state-dir", str(root / "state"), *extra]


def start_bridge(fleet, qemu, name: str = NODE) -> Process:
    """`poet-agent datasets make-demo` in the bridge's data dir, then `poet-agent bridge` until it registered."""
    root = fleet.tmp / "bridge"
    made = subprocess.run([str(POET_AGENT), "datasets", "make-demo", "--data-dir", str(root / "data")],
                          capture_output=True, text=True, timeout=120, env=test_env())
    assert made.returncode == 0, made.stderr
    env = test_env() | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "POET_AGENT_MAX_BACKOFF_S": "1"}
    bridge = Process(bridge_argv(qemu.serial_url, fleet.coordinator.address, fleet.cert_dir / name, root,
                                 "--board", BOARD, "--max-backoff-s", "1"), env, f"poet-agent bridge {name}")
    fleet.processes.append(bridge)
    bridge.wait_for(r"registered with ")
    return bridge


def run(fleet, *, steps: int, batch_size: int, budget: str = "auto", wait: bool = True, extra=()) -> dict:
    argv = ["run", "--model", "mlp", "--dataset", "digits", "--steps", str(steps), "--ram-budget", budget,
            "--agents", NODE, "--kind", "verify", "--batch-size", str(batch_size), "--lr", LR, *extra]
    if wait:
        argv.append("--wait")
    runs = fleet.poet_json(*argv, timeout_s=600)["runs"]
    assert len(runs) == 1, dump(runs)
    return runs[0]


def check_done(fleet, run_id: str, steps: int) -> dict:
    shown = fleet.wait_settled(run_id, timeout_s=600)
    assert shown["status"] == "done", dump(shown)
    assert shown["steps_done"] == steps, dump(shown)
    assert shown["events_emitted"] > 0 and shown["events_stored"] == shown["events_emitted"], dump(shown)
    assert shown["max_rel_param_diff"] is not None and shown["max_rel_param_diff"] <= TOLERANCE, dump(shown)
    assert shown["accuracy_after"] is not None
    return shown


def link_figures(bridge: Process, run_id: str) -> str:
    """The bridge's per-run line: median wall seconds and bytes over the link per step, frames resent."""
    match = bridge.wait_for(rf"run {run_id}: \d+ steps on {BOARD}, ([0-9.]+) s wall per step .*?, ([0-9]+) bytes "
                            r"over the link per step .*?, ([0-9]+) frames resent", timeout_s=30)
    return f"{float(match.group(1)):.3f} s/step, {match.group(2)} link bytes/step, {match.group(3)} frames resent"


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.slow  # 40-65 s: QEMU, a coordinator, two runs (weights cross the emulated UART at ~30 KB/s)
@needs_toolchain
def test_board_registers_trains_verifies_and_pages_through_the_coordinator(fleet, qemu):
    fleet.serve()
    bridge = start_bridge(fleet, qemu)

    agents = {a["name"]: a for a in fleet.fleet_list()}
    assert set(agents) == {NODE}, dump(agents)
    board = agents[NODE]
    assert (board["platform"], board["activation_arena_bytes"], board["board"], board["online"]) == (
        "m4", ARENA_BYTES, BOARD, True), dump(board)
    assert board["flash_capacity_bytes"] > 0 and board["ram_total_bytes"] < 1 << 20, dump(board)

    # batch 16: plain training fits the arena; `auto` is the arena
    steps = 6
    submitted = run(fleet, steps=steps, batch_size=16)
    assert submitted["ram_budget_bytes"] == ARENA_BYTES, dump(submitted)
    shown = check_done(fleet, submitted["run_id"], steps)
    assert shown["measured"]["peak_ram_bytes"] <= ARENA_BYTES
    plain = link_figures(bridge, submitted["run_id"])

    # batch 160: the no-remat peak (320 KiB of activations) is over the 256 KiB arena; paging only (the solver
    # would rather recompute here): the schedule pages activations to the board's flash and back
    steps = 3
    submitted = run(fleet, steps=steps, batch_size=160, extra=("--no-remat",))
    shown = check_done(fleet, submitted["run_id"], steps)
    assert shown["page_outs"] > 0, dump(shown)
    assert shown["ram_budget_bytes"] == ARENA_BYTES, dump(shown)
    assert 0 < shown["measured"]["peak_ram_bytes"] <= shown["ram_budget_bytes"], dump(shown)
    print(f"\nthrough the bridge: batch 16: {plain}; batch 160 (paging): {link_figures(bridge, submitted['run_id'])}")
    assert not bridge.has(r"Traceback|internal error"), bridge.log()


@pytest.mark.slow  # 35-45 s: QEMU, a coordinator, one run restarted after the board's reset
@needs_toolchain
def test_board_reset_mid_job_restarts_the_job_cleanly(fleet, qemu):
    fleet.serve()
    bridge = start_bridge(fleet, qemu)
    steps = 20
    submitted = run(fleet, steps=steps, batch_size=32, wait=False)
    run_id = submitted["run_id"]
    fleet.wait_steps(run_id, 3, timeout_s=300)
    qemu.reset()  # a power cycle: QEMU stops and boots the firmware again on the same UART port
    bridge.wait_for(r"BoardResetError: the board on \S+ answers with session 0x[0-9a-f]+ instead of 0x[0-9a-f]+",
                    timeout_s=120)
    bridge.wait_for(rf"run {run_id} .*starting the job again from its initial weights", timeout_s=10)
    check_done(fleet, run_id, steps)
    print(f"\nafter the reset (batch 32): {link_figures(bridge, run_id)}")
    restarts = [line for line in bridge.log().splitlines() if "starting the job again" in line]
    # The reset restarts the job once; a link that stalls for its whole ACK timeout after it (QEMU starved of the CPU
    # on a loaded machine: 41 transmissions over 12.3 s once) restarts it again, as it should, and says why.
    assert len([line for line in restarts if "BoardResetError" in line]) == 1, bridge.log()
    assert all("BoardResetError" in line or "LinkTimeoutError" in line for line in restarts), bridge.log()
    assert not bridge.has(r"Traceback|internal error"), bridge.log()


def _bridge_exits(argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=test_env())
    done.elapsed_s = time.monotonic() - started
    return done


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, f"exit {done.returncode}:\n{done.stderr}"
    assert lines[0].startswith("poet-agent bridge: ")
    return lines[0]


@pytest.mark.slow  # ~8 s: the bridge waits out its connect timeout
def test_no_board_on_the_serial_line_is_a_one_line_error(cert_dir, tmp_path):
    from device_agent.serial_bridge.qemu import free_loopback_port

    (tmp_path / "data").mkdir()
    # nothing listens on the port: retried until --connect-timeout-s, then one line
    url = f"socket://127.0.0.1:{free_loopback_port()}"
    done = _bridge_exits(bridge_argv(url, "127.0.0.1:1", cert_dir / NODE, tmp_path, "--connect-timeout-s", "1"))
    line = _one_line(done)
    assert f"no poet-edge firmware answered on {url} within 1 s" in line, line
    assert "check the port, the baud rate" in line
    # something listens but never answers the hello (not the firmware, or a wrong baud rate on a real port)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"socket://127.0.0.1:{silent.getsockname()[1]}"
        done = _bridge_exits(bridge_argv(url, "127.0.0.1:1", cert_dir / NODE, tmp_path, "--connect-timeout-s", "1"))
    line = _one_line(done)
    assert f"no poet-edge firmware answered on {url} within 1 s (no ACK from the board" in line, line
    # a device that does not exist: at once
    done = _bridge_exits(bridge_argv(str(tmp_path / "ttyACM9"), "127.0.0.1:1", cert_dir / NODE, tmp_path))
    assert f"no serial device {tmp_path / 'ttyACM9'}" in _one_line(done)
    assert done.elapsed_s < 20


@needs_toolchain
def test_wrong_board_on_the_serial_line_is_a_one_line_error(cert_dir, qemu, tmp_path):
    (tmp_path / "data").mkdir()
    done = _bridge_exits(bridge_argv(qemu.serial_url, "127.0.0.1:1", cert_dir / NODE, tmp_path,
                                     "--board", "nucleo-f446re"))
    line = _one_line(done)
    assert f"the board on {qemu.serial_url} is '{BOARD}', not 'nucleo-f446re' (--board)" in line, line
