"""How freed tensor memory goes back to the C allocator (glibc), which decides what RSS does.

* ``default``: glibc's own heuristics. Large blocks freed mid-step may go back to the OS and be
  faulted in again on the next allocation, which costs time.
* ``keep`` (what ``poet train`` uses unless told otherwise): freed memory stays in the process for
  reuse (no trimming, no mmap for large blocks): the fastest, RSS stays at its high-water mark.
* ``return``: the executor calls ``malloc_trim`` after every free, so RSS follows the schedule's
  tracked RAM closely (what a hard memory limit needs); slower.

Elsewhere than glibc these are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Callable

ALLOCATOR_MODES: tuple[str, ...] = ("default", "keep", "return")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)``: hands free heap pages back to the OS; None where unavailable."""
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None


def release_free_memory() -> bool:
    """Collect garbage and give the C heap's free pages back to the OS now."""
    gc.collect()
    trim = malloc_trim()
    return bool(trim(0)) if trim is not None else False


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (process-wide); False where that is not possible."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES))
