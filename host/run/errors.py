"""Errors of the public API whose message is a complete, user-facing explanation."""

from __future__ import annotations

from device_agent.errors import UserError  # the one base of every user-facing error, host and board

__all__ = ["InputError", "SolveFailedError", "UserError"]


class InputError(UserError, ValueError):
    """A bad argument: the message names it, says what was wrong and what is accepted."""


class SolveFailedError(UserError, RuntimeError):
    """Training needed a schedule and the solver returned none (``status`` is infeasible, timeout or error)."""

    def __init__(self, status: str, message: str):
        super().__init__(f"no schedule ({status}): {message}")
        self.status = status
