"""The one base of every user-facing error, host and board.

A :class:`UserError`'s message is a complete explanation: what was wrong and what to do about it. The CLIs print it
as one line (exit 2, no traceback) and the coordinator answers INVALID_ARGUMENT with it. A new such error derives
from it (with ValueError, KeyError, RuntimeError, ... as fits) and is caught as one without being listed anywhere.
It lives here, in the board's package, because the board's errors derive from it too and device_agent never imports
host; host/run/errors.py re-exports it.
"""

from __future__ import annotations


class UserError(Exception):
    """An error whose message is a complete, user-facing explanation: what was wrong and what to do about it."""
