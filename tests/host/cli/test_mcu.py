"""`poet mcu run` as a user runs it: the real command, the firmware built with its Makefile and booted on QEMU's
mps2-an386, its JSON on stdout (progress on stderr), its exit codes."""

from __future__ import annotations

import shutil
import subprocess

import psutil
import pytest

from tests.host.cli.helpers import POET, one_json_object, poet, test_env

_TOOLS = ("make", "arm-none-eabi-gcc", "qemu-system-arm", "protoc", "protoc-gen-nanopb")
needs_toolchain = pytest.mark.skipif(any(shutil.which(t) is None for t in _TOOLS),
                                     reason="firmware toolchain missing (make setup installs it)")
TINY = "host.graph.examples:tiny_mlp"
ARENA_BYTES = 262_144  # boards/mps2_an386.c


@pytest.mark.slow  # ~20 s: 104 KB of weights cross the emulated UART, and two steps of batch 160
@needs_toolchain
def test_a_model_that_does_not_fit_the_arena_trains_under_a_paging_schedule_as_pytorch(tmp_path):
    """mlp at batch 160: plain training needs 320 KiB of activations, more than the 256 KiB arena; the schedule at
    250,000 bytes pages to flash, and the board's parameters equal PyTorch's."""
    done = poet("mcu", "run", "--qemu", "--model", "mlp", "--batch-size", "160", "--ram-budget", "250000",
                "--no-remat", "--steps", "2", "--work-dir", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    report = one_json_object(done.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["max_rel_param_diff"] <= 1e-5
    assert report["arena_bytes"] == ARENA_BYTES
    assert report["arena_high_water_bytes"] <= report["ram_budget_bytes"] == 250_000 < ARENA_BYTES
    assert report["planned"] == report["executed"] and report["planned"]["page_outs"] >= 1
    assert report["planned"]["page_ins"] == report["planned"]["page_outs"]
    assert report["timing_source"] == "emulated:qemu-mps2-an386"
    assert {"frames_sent", "frames_retransmitted", "crc_errors"} <= set(report)
    assert (tmp_path / "flash" / "poet_flash.bin").stat().st_size > 160 * 128 * 4  # a page really went to flash
    assert "step 2/2" in done.stderr  # progress on stderr, the JSON alone on stdout


@pytest.mark.slow  # ~5 s: a QEMU boot
@needs_toolchain
def test_keep_all_training_of_a_small_model_reports_its_figures(tmp_path):
    done = poet("mcu", "run", "--qemu", "--model", TINY, "--ram-budget", "100%", "--steps", "3", "--json")
    assert done.returncode == 0, done.stderr
    report = one_json_object(done.stdout)
    assert report["ok"] and report["max_rel_param_diff"] <= 1e-5 and len(report["losses"]) == 3
    assert report["planned"] == report["executed"] == {"computes": 9, "page_ins": 0, "page_outs": 0}
    assert report["arena_high_water_bytes"] == report["ram_budget_bytes"]
    assert report["frames_retransmitted"] == report["crc_errors"] == 0  # a clean link


@needs_toolchain
@pytest.mark.parametrize(("argv", "message"), [
    (("--ram-budget", "300000", "--batch-size", "160"),
     "exceeds the board's activation arena (262144 bytes); give --ram-budget of at most 262144"),
    (("--model", "host.graph.examples:small_cnn_images", "--ram-budget", "100%"),
     "the firmware takes a float32 batch of [batch, features]"),
])
@pytest.mark.slow  # ~5 s each: a solve and a QEMU boot
def test_what_the_board_cannot_do_is_refused_with_the_fix(argv, message):
    done = poet("mcu", "run", "--qemu", *argv, "--steps", "1")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (("--ram-budget", "100%"), "--qemu"),
    (("--qemu", "--ram-budget", "100%", "--link-corrupt", "0.7"), "not a share of the bytes in [0, 0.5)"),
    (("--qemu", "--ram-budget", "100%", "--momentum", "1.5"), "momentum 1.5 is not in [0, 1)"),
])
def test_bad_flags_exit_2_naming_them(argv, message):
    done = poet("mcu", "run", *argv)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.slow  # ~10 s: two QEMU boots, every frame of the lossy one resent ~2.8 times
@needs_toolchain
def test_through_a_link_that_corrupts_one_byte_in_a_hundred_training_ends_with_the_same_parameters():
    """--link-corrupt 1%: a proxy corrupts 1% of the bytes each way and drops 0.1%; the link cuts messages into
    small frames and resends what fails its CRC: the board trains exactly as on a clean line."""
    clean = one_json_object(poet("mcu", "run", "--qemu", "--model", TINY, "--ram-budget", "100%", "--steps", "3",
                                 "--json").stdout)
    done = poet("mcu", "run", "--qemu", "--model", TINY, "--ram-budget", "100%", "--steps", "3",
                "--link-corrupt", "1%", "--json")
    assert done.returncode == 0, done.stderr
    lossy = one_json_object(done.stdout)
    assert lossy["ok"] and lossy["link_corrupt"] == 0.01
    assert lossy["losses"] == clean["losses"]  # bit for bit: the same firmware on the same bytes
    assert lossy["max_rel_param_diff"] == clean["max_rel_param_diff"] <= 1e-5
    assert lossy["frames_retransmitted"] > 0 and lossy["crc_errors"] > 0
    assert lossy["link"]["board"]["crc_errors"] > 0  # the board saw damaged frames too, and asked again
    # a clean link damages nothing; it may still resend a frame whose acknowledgement came late on a busy machine
    assert clean["crc_errors"] == 0 and clean["link"]["board"]["crc_errors"] == 0


@pytest.mark.slow  # ~5 s: a QEMU boot
@needs_toolchain
def test_a_board_that_dies_mid_run_is_reported_with_the_end_of_its_log():
    """The emulated board is stopped once the host has its hello: the link error names the line and carries the
    end of QEMU's log (the firmware's console), so a stalled or faulted board can be told from a slow one."""
    process = subprocess.Popen([str(POET), "mcu", "run", "--qemu", "--model", TINY, "--ram-budget", "100%",
                                "--steps", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=test_env())
    stderr_lines = []
    for line in process.stderr:
        stderr_lines.append(line)
        if "solving for" in line:  # the board answered the hello; kill it before the model goes over
            for child in psutil.Process(process.pid).children(recursive=True):
                if child.name().startswith("qemu-system"):
                    child.terminate()
            break
    stderr_lines.extend(process.stderr)
    assert process.wait(timeout=120) == 2
    stderr = "".join(stderr_lines)
    assert "socket://127.0.0.1:" in stderr and "the emulated board's log" in stderr, stderr
    assert "terminating on signal 15" in stderr, stderr  # QEMU's own last words, from the log
    assert "Traceback" not in stderr
