"""Every numeric flag refuses NaN, infinities and out-of-range values up front: exit 2, naming the flag."""

import pytest

from host.cli.common import EXIT_USAGE
from tests.host.cli.helpers import poet

SOLVE = ["solve", "--model", "mlp", "--platform", "a72"]
TRAIN = ["train", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%"]

CASES = [
    # (flag named in the message, argv)
    ("--ram-budget", [*SOLVE, "--ram-budget", "nan%"]),
    ("--ram-budget", [*SOLVE, "--ram-budget", "inf%"]),
    ("--ram-budget", [*SOLVE, "--ram-budget", "1e400"]),
    ("--ram-budget", [*SOLVE, "--ram-budget", "0"]),
    ("--ram-budget", [*SOLVE, "--ram-budget", "-5%"]),
    ("--ram-budget", [*SOLVE, "--ram-budget", "lots"]),
    ("--runtime-budget", [*SOLVE, "--ram-budget", "50%", "--runtime-budget", "nan"]),
    ("--runtime-budget", [*SOLVE, "--ram-budget", "50%", "--runtime-budget", "0.8"]),
    ("--mip-gap", [*SOLVE, "--ram-budget", "50%", "--mip-gap", "-1"]),
    ("--time-limit", [*SOLVE, "--ram-budget", "50%", "--time-limit", "0"]),
    ("--time-limit", [*SOLVE, "--ram-budget", "50%", "--time-limit", "inf"]),
    ("--solve-threads", [*SOLVE, "--ram-budget", "50%", "--solve-threads", "0"]),
    ("--batch-size", ["solve", "--model", "poet2022:resnet18_cifar", "--platform", "a72", "--ram-budget", "50%",
                      "--batch-size", "0"]),
    ("--input-shape", [*SOLVE, "--ram-budget", "50%", "--input-shape", "4,0"]),
    ("--lr", [*TRAIN, "--lr", "nan"]),
    ("--lr", [*TRAIN, "--lr=-1"]),
    ("--threads", [*TRAIN, "--threads", "0"]),
    ("--steps", [*TRAIN, "--steps", "0"]),
    ("--seed", [*TRAIN, "--seed", "-1"]),
    ("--ram-budget", ["train", "--model", "mlp", "--platform", "a72"]),  # required without --schedule
    ("--steps", ["verify", "--model", "mlp", "--platform", "a72", "--ram-budget", "80%", "--steps", "1.5"]),
    ("--points", ["pareto", "--model", "mlp", "--platform", "a72", "--points", "1"]),
    ("--time-limit", ["demo", "--time-limit", "nan"]),
]


@pytest.mark.parametrize("flag,argv", CASES, ids=[f"{flag} {argv[-1]}" for flag, argv in CASES])
def test_bad_values_exit_2_naming_the_flag(flag, argv):
    result = poet(*argv, timeout=120)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert flag in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_plot_naming_an_existing_file_is_refused(tmp_path):
    existing = tmp_path / "plot.png"
    existing.write_text("not a directory")
    result = poet(*SOLVE, "--ram-budget", "50%", "--plot", str(existing), timeout=120)
    assert result.returncode == EXIT_USAGE
    assert "--plot" in result.stderr and "not a directory" in result.stderr and "Traceback" not in result.stderr
    assert existing.read_text() == "not a directory"
