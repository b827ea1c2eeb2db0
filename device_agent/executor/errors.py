"""What can go wrong running a schedule: one family of errors for the lowering and the runtime."""

from __future__ import annotations

from device_agent.errors import UserError

__all__ = ["BudgetExceededError", "ExecutorError", "InvalidScheduleError", "MissingTensorError"]


class ExecutorError(UserError, RuntimeError):
    """The executor cannot run this schedule on this partition."""


class InvalidScheduleError(ExecutorError):
    """A schedule that breaks a rule of the instruction set (checked before any training)."""


class MissingTensorError(ExecutorError):
    """A backward needed a saved tensor that the schedule does not hold in RAM."""


class BudgetExceededError(ExecutorError):
    """Tracked RAM went above the schedule's budget."""
