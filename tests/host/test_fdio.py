"""stdout_to_stderr: what C code writes to fd 1 goes to stderr; results reach the real stdout."""

import subprocess
import sys

SCRIPT = """
import os, sys
from host.fdio import stdout_to_stderr
with stdout_to_stderr() as out:
    os.write(1, b"C-level chatter\\n")
    print("a stray print")
    out.write("the result\\n")
os.write(1, b"after\\n")
"""


def test_fd_1_goes_to_stderr_and_results_to_stdout():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the result\nafter\n"
    assert "C-level chatter" in result.stderr and "a stray print" in result.stderr

