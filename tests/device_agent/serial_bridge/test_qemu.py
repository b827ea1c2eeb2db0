"""QemuBoard: clear errors when QEMU, the image or the machine is wrong; ports, stop and reset on a real QEMU with a
ten-byte spin image; and, when an arm-none-eabi-gcc is installed, that semihosting writes land in flash_dir and
the UART is the serial_url (a tiny echo program built here)."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from device_agent.serial_bridge import qemu
from device_agent.serial_bridge.qemu import QemuBoard, QemuError, find_qemu

needs_qemu = pytest.mark.skipif(shutil.which(qemu.QEMU_BINARY) is None, reason="qemu-system-arm is not installed")
needs_gcc = pytest.mark.skipif(shutil.which("arm-none-eabi-gcc") is None, reason="arm-none-eabi-gcc is not installed")

_ECHO_C = r"""
#include <stdint.h>
#define UART0 ((volatile uint32_t *)0x40004000u) /* CMSDK UART: DATA, STATE, CTRL, INTSTATUS, BAUDDIV */

static int semihost(int op, const void *arg) {
    register int r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm__ volatile("bkpt 0xab" : "+r"(r0) : "r"(r1) : "memory");
    return r0;
}

void reset_handler(void) {
    static const char name[] = "probe.txt", text[] = "written by semihosting\n", banner[] = "echo firmware up\n";
    uint32_t open_args[3] = {(uint32_t)name, 4 /* "w" */, sizeof(name) - 1};
    int handle = semihost(0x01, open_args);
    uint32_t write_args[3] = {(uint32_t)handle, (uint32_t)text, sizeof(text) - 1};
    semihost(0x05, write_args);
    semihost(0x02, &handle);
    semihost(0x04, banner);
    UART0[4] = 16;
    UART0[2] = 3;
    for (;;) {
        if (UART0[1] & 2u) {
            uint32_t byte = UART0[0];
            while (UART0[1] & 1u) {}
            UART0[0] = byte;
        }
    }
}

__attribute__((section(".vectors"), used)) void (*const vectors[2])(void) = {
    (void (*)(void))0x20010000u, reset_handler};
"""
_LINKER_SCRIPT = """
MEMORY { CODE (rx) : ORIGIN = 0x00000000, LENGTH = 4M }
SECTIONS { .text : { KEEP(*(.vectors)) *(.text*) *(.rodata*) } > CODE }
"""


@pytest.fixture(scope="module")
def spin_image(tmp_path_factory) -> Path:
    """A raw Cortex-M image (QEMU loads a non-ELF -kernel at 0): stack pointer, reset vector, ``b .``."""
    path = tmp_path_factory.mktemp("image") / "spin.bin"
    path.write_bytes(struct.pack("<IIH", 0x2000_1000, 0x9, 0xE7FE))
    return path


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_find_qemu_says_how_to_install_it(tmp_path):
    with pytest.raises(QemuError, match=r"qemu-system-arm not found: run `make setup`, which installs Debian's "):
        find_qemu(path=str(tmp_path))


def test_a_missing_image_or_qemu_binary_is_named(tmp_path, spin_image):
    with pytest.raises(FileNotFoundError, match="no firmware image at .*missing.elf"):
        QemuBoard(tmp_path / "missing.elf", flash_dir=tmp_path / "flash", qemu="unused")
    with pytest.raises(QemuError, match="cannot run .*no-such-qemu"):
        QemuBoard(spin_image, flash_dir=tmp_path / "flash", qemu=str(tmp_path / "no-such-qemu"))


@needs_qemu
def test_a_qemu_that_exits_is_reported_with_its_log(tmp_path, spin_image):
    with pytest.raises(QemuError, match=r"exited with status 1(.|\n)*unsupported machine type"):
        QemuBoard(spin_image, flash_dir=tmp_path / "flash", machine="no-such-board")
    assert (tmp_path / "flash" / "qemu.log").is_file()


@needs_qemu
def test_start_stop_reset_and_the_serial_url(tmp_path, spin_image):
    log = tmp_path / "logs" / "board.log"
    with QemuBoard(spin_image, flash_dir=tmp_path / "flash", log_path=log) as board:
        assert board.running and board.serial_url == f"socket://127.0.0.1:{board.port}"
        assert _accepts(board.port)
        first_pid, port = board.pid, board.port
        assert "-machine mps2-an386" in log.read_text() and f"port={port}" in log.read_text()
        board.reset()
        assert board.running and board.pid != first_pid and board.port == port  # same port after a reset
        assert _accepts(port)
        process_pid = board.pid
    assert not board.running
    with pytest.raises(ProcessLookupError):
        os.kill(process_pid, 0)
    assert not _accepts(port)
    assert board.stop() is None  # stopping twice is harmless


@needs_qemu
def test_a_taken_port_is_retried_on_another(tmp_path, spin_image, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: QEMU's bind fails, nothing answers a connect
        offered = [taken.getsockname()[1]]
        real = qemu.free_loopback_port
        monkeypatch.setattr(qemu, "free_loopback_port", lambda: offered.pop(0) if offered else real())
        with QemuBoard(spin_image, flash_dir=tmp_path) as board:
            assert board.port != taken.getsockname()[1] and _accepts(board.port)
            assert "Address already in use" not in board.log_tail()  # the tail is this start's only
        assert "Address already in use" in (tmp_path / "qemu.log").read_text()


@needs_qemu
def test_a_port_that_never_opens_times_out_with_the_log(tmp_path, spin_image, monkeypatch):
    monkeypatch.setattr(QemuBoard, "command", lambda self, port: [self.qemu, "-machine", "none", "-nographic",
                                                                     "-monitor", "none"])
    started = time.monotonic()
    with pytest.raises(QemuError, match=r"did not open its UART port \d+ within 1 s"):
        QemuBoard(spin_image, flash_dir=tmp_path, start_timeout_s=1)
    assert time.monotonic() - started < 10


@needs_qemu
@needs_gcc
def test_semihosting_writes_into_flash_dir_and_the_uart_is_the_serial_url(tmp_path):
    (tmp_path / "echo.c").write_text(_ECHO_C)
    (tmp_path / "echo.ld").write_text(_LINKER_SCRIPT)
    elf = tmp_path / "echo.elf"
    subprocess.run(["arm-none-eabi-gcc", "-mcpu=cortex-m4", "-mthumb", "-Os", "-nostdlib", "-nostartfiles",
                    "-T", str(tmp_path / "echo.ld"), "-o", str(elf), str(tmp_path / "echo.c")],
                   check=True, capture_output=True)
    flash = tmp_path / "flash"
    with QemuBoard(elf, flash_dir=flash) as board:
        probe = flash / "probe.txt"
        _wait_for(probe.is_file)
        assert probe.read_text() == "written by semihosting\n"
        _wait_for(lambda: "echo firmware up" in board.log_tail())
        with socket.create_connection(("127.0.0.1", board.port), timeout=5) as uart:
            uart.sendall(b"\x7eping\x7d\x00")
            echoed = b""
            while len(echoed) < 7:
                echoed += uart.recv(64)
        assert echoed == b"\x7eping\x7d\x00"
        probe.unlink()
        board.reset()
        _wait_for(probe.is_file)  # the same flash_dir after the reset


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
