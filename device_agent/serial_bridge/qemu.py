"""The firmware under QEMU (mps2-an386): UART0 served on a loopback TCP port, semihosted files in flash_dir.

Tests and demos run the real firmware this way; its semihosting console and QEMU's messages go to a log file.
"""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

from device_agent.errors import UserError

__all__ = ["DEFAULT_MACHINE", "QEMU_BINARY", "QemuBoard", "QemuError", "find_qemu", "free_loopback_port"]

QEMU_BINARY = "qemu-system-arm"
DEFAULT_MACHINE = "mps2-an386"  # Cortex-M4 with FPU
DEFAULT_START_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
_PORT_ATTEMPTS = 5
_LOG_TAIL_LINES = 20


class QemuError(UserError, RuntimeError):
    """QEMU is missing, did not start, or stopped; the message carries the end of its log."""


def find_qemu(path: str | None = None) -> str:
    """The qemu-system-arm executable on ``path`` (default: PATH), or QemuError saying how to install it."""
    found = shutil.which(QEMU_BINARY, path=path)
    if found is None:
        raise QemuError(f"{QEMU_BINARY} not found: run `make setup`, which installs Debian's qemu-system-arm")
    return found


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 free right now (bound to 0 and closed; the caller retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class QemuBoard:
    """A running emulated board (started by the constructor); ``stop()``, ``reset()``, or use it as a context."""

    def __init__(self, elf_path: str | Path, *, flash_dir: str | Path, machine: str = DEFAULT_MACHINE,
                 log_path: str | Path | None = None, qemu: str | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        self.elf_path = Path(elf_path).resolve()
        if not self.elf_path.is_file():
            raise FileNotFoundError(f"no firmware image at {self.elf_path}: build the firmware first")
        self.flash_dir = Path(flash_dir).resolve()
        self.flash_dir.mkdir(parents=True, exist_ok=True)
        self.machine = machine
        self.log_path = Path(log_path).resolve() if log_path is not None else self.flash_dir / "qemu.log"
        self.qemu = qemu or find_qemu()
        self.start_timeout_s = float(start_timeout_s)
        self.port: int | None = None
        self._process: subprocess.Popen | None = None
        self._log = None
        self._log_start = 0  # where the current start's part of the log begins
        self.start()

    @property
    def serial_url(self) -> str:
        """The UART as a pyserial URL (``socket://127.0.0.1:PORT``)."""
        if self.port is None:
            raise QemuError("the board is not running: start() it first")
        return f"socket://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self, port: int) -> list[str]:
        """The qemu-system-arm command line with UART0 served on 127.0.0.1:``port``."""
        return [self.qemu, "-machine", self.machine, "-nographic", "-monitor", "none",
                "-semihosting-config", "enable=on,target=native",
                "-chardev", f"socket,id=uart0,host=127.0.0.1,port={port},server=on,wait=off,nodelay=on",
                "-serial", "chardev:uart0", "-kernel", str(self.elf_path)]

    def start(self) -> None:
        """Boot the board and wait until its UART port accepts; the previous port is tried first."""
        if self.running:
            raise QemuError(f"the board is already running (pid {self._process.pid})")
        previous = self.port
        for attempt in range(_PORT_ATTEMPTS):
            port = previous if attempt == 0 and previous is not None else free_loopback_port()
            if self._launch(port):
                self.port = port
                return
        raise QemuError(f"{QEMU_BINARY} found no free loopback port in {_PORT_ATTEMPTS} attempts; "
                        f"its log ({self.log_path}) ends with:\n{self._log_tail()}")

    def stop(self) -> int | None:
        """Terminate QEMU (kill it after STOP_GRACE_S); returns its exit status, None if it was not running."""
        process, self._process = self._process, None
        status = None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            status = process.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return status

    def reset(self) -> None:
        """A board reset: stop and boot again on the same flash_dir (the same port when it is still free)."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines QEMU and the firmware's semihosting console wrote since the last start."""
        return self._log_tail(lines)

    def __enter__(self) -> QemuBoard:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _launch(self, port: int) -> bool:
        """Start QEMU on ``port``; True once the port accepts, False if the port was taken (QemuError otherwise)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # QEMU writes to it until stop() closes it
        self._log_start = self._log.tell()
        command = self.command(port)
        self._log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        self._log.flush()
        try:
            self._process = subprocess.Popen(command, cwd=self.flash_dir, stdin=subprocess.DEVNULL,
                                             stdout=self._log, stderr=subprocess.STDOUT)
        except OSError as error:
            self.stop()
            raise QemuError(f"cannot run {self.qemu}: {error}") from error
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            status = self._process.poll()
            if status is not None:
                tail = self._log_tail()
                self.stop()
                if "Address already in use" in tail:
                    return False
                raise QemuError(f"{QEMU_BINARY} exited with status {status} while booting {self.elf_path.name}; "
                                f"its log ({self.log_path}) ends with:\n{tail}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                # QEMU exits at once if it cannot bind; a live process after the connect means the port is its own
                time.sleep(0.1)
                if self._process.poll() is None:
                    return True
                continue
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise QemuError(f"{QEMU_BINARY} did not open its UART port {port} within {self.start_timeout_s:g} "
                                f"s; its log ({self.log_path}) ends with:\n{tail}")
            time.sleep(0.05)

    def _log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode("utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"
