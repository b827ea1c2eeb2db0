"""Process memory, sampled through psutil: resident set size now, and the high-water mark."""

from __future__ import annotations

import resource
import sys

import psutil

SOURCE = "measured:psutil-rss"


class RssSampler:
    """Reads this process's RSS (bytes); cheap enough to call after every instruction."""

    source = SOURCE

    def __init__(self) -> None:
        self._process = psutil.Process()

    def rss_bytes(self) -> int:
        return int(self._process.memory_info().rss)

    @staticmethod
    def peak_rss_bytes() -> int:
        """The process's peak RSS since it started (ru_maxrss; KiB on Linux, bytes on macOS)."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
