"""Bytes for people: one choice of decimal unit and one formatter, for the CLI and the plots."""

from __future__ import annotations

_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def byte_unit(largest_bytes: float) -> tuple[str, float]:
    """The unit to show bytes in, and its size: the largest decimal unit not above ``largest_bytes``."""
    for unit, scale in _UNITS:
        if abs(largest_bytes) >= scale:
            return unit, scale
    return "bytes", 1.0


def format_bytes(value: float, *, exact: bool = True) -> str:
    """``4.57 MB (4,571,136 bytes)``; ``exact=False`` drops the parenthesis (for tables and plots)."""
    unit, scale = byte_unit(value)
    if scale == 1.0:
        return f"{value:,.0f} bytes"
    short = f"{value / scale:.2f} {unit}"
    return f"{short} ({value:,.0f} bytes)" if exact else short
