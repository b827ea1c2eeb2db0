"""Keep stdout for results: route file descriptor 1 to stderr while libraries may write to it.

C libraries write to the process's file descriptor 1 directly (highspy 1.16 prints its banner when
``Highs()`` is created), which Python's ``sys.stdout`` cannot intercept. ``stdout_to_stderr`` points
fd 1 at fd 2 for the duration and hands back a private stream on the real stdout, so a program that
reads ``poet ... --json`` sees exactly the result.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


@contextmanager
def stdout_to_stderr() -> Iterator[TextIO]:
    """Within the block, anything written to fd 1 (C or Python) goes to stderr; yields the real stdout.

    Nests (an inner block keeps fd 1 on stderr) and restores fd 1 on the way out. Where fd 1 or 2 cannot
    be duplicated (closed descriptors), it yields ``sys.stdout`` and redirects nothing.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        saved = os.dup(1)
    except OSError:
        yield sys.stdout
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        yield sys.stdout
        return
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    results = os.fdopen(os.dup(saved), "w", encoding=encoding, errors="backslashreplace")
    try:
        yield results
    finally:
        try:
            results.close()  # flushes; a closed pipe (`poet ... | head`) is the reader's choice, not an error
        except BrokenPipeError:
            pass
        try:
            sys.stdout.flush()  # Python-level writes made meanwhile belong to stderr
        except (OSError, ValueError):
            pass
        _flush_c_stdio()  # C-level writes buffered meanwhile too, before fd 1 points at stdout again
        os.dup2(saved, 1)
        os.close(saved)
