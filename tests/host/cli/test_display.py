"""The one live progress display: a clock that keeps moving on a terminal, sparse plain lines elsewhere."""

import io
import time

from host.cli.display import LiveStatus, format_bytes
from host.run.loops import StepProgress
from host.solver.milp import SolverProgress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _elapsed_values(text: str) -> list[float]:
    values = []
    for frame in text.split("\r"):
        parts = frame.split()
        if "s" in parts and parts[0] in ("building", "solving"):
            values.append(float(parts[parts.index("s") - 1]))
    return values


def test_on_a_terminal_the_clock_keeps_moving_without_new_reports():
    stream = FakeTerminal()
    with LiveStatus(stream, interval_s=0.05) as status:
        status(SolverProgress(elapsed_s=10.0, incumbent_j=None, bound_j=None, gap=None, phase="building model"))
        time.sleep(0.4)  # the solver says nothing: a long phase
    elapsed = _elapsed_values(stream.getvalue())
    assert len(elapsed) >= 4, stream.getvalue()
    assert elapsed[0] >= 10.0 and elapsed[-1] >= elapsed[0] + 0.2
    assert stream.getvalue().endswith("\r")  # the line is cleared when done


def test_logs_print_above_the_live_line():
    stream = FakeTerminal()
    with LiveStatus(stream, interval_s=10) as status:
        status(SolverProgress(elapsed_s=0.0, incumbent_j=1.5, bound_j=1.2, gap=0.2, phase="solving"))
        status.log("a message")
    text = stream.getvalue()
    assert "a message\n" in text and "incumbent 1.5 J" in text and "gap 20.00%" in text


def test_elsewhere_lines_are_plain_and_sparse():
    stream = io.StringIO()
    with LiveStatus(stream, tty=False, plain_every_s=60) as status:
        for second in range(10):
            status(SolverProgress(elapsed_s=float(second), incumbent_j=2.0, bound_j=1.0, gap=0.5, phase="solving"))
        status(SolverProgress(elapsed_s=11.0, incumbent_j=None, bound_j=None, gap=None, phase="polishing"))
        for step in range(1, 6):
            status(StepProgress("train", step, 5, loss=0.5, step_s=0.01))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 4, lines  # the first report, the phase change, the first and the last step
    assert "polishing" in lines[1] and "1/5" in lines[2] and "5/5" in lines[3]


def test_format_bytes():
    assert format_bytes(4_571_136) == "4.57 MB (4,571,136 bytes)"
    assert format_bytes(4_571_136, exact=False) == "4.57 MB"
    assert format_bytes(512) == "512 bytes"
