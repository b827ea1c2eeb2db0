"""Errors of the public API whose message is a complete, user-facing explanation."""

from __future__ import annotations


class UserError(Exception):
    """An error whose message is a complete, user-facing explanation: what was wrong and what to do about it.

    The CLI prints it as one line (exit 2, no traceback) and the coordinator answers INVALID_ARGUMENT with it. A new
    such error derives from this class (with ValueError, RuntimeError, ... as fits) and needs no registration.
    """


class InputError(UserError, ValueError):
    """A bad argument: the message names it, says what was wrong and what is accepted."""


class SolveFailedError(UserError, RuntimeError):
    """Training needed a schedule and the solver returned none (``status`` is infeasible, timeout or error)."""

    def __init__(self, status: str, message: str):
        super().__init__(f"no schedule ({status}): {message}")
        self.status = status


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message already explains the problem and the fix (no traceback needed): UserError, and
    the user-facing errors defined before it that do not derive from it yet. Those live in host.graph, host.costs,
    host.solver and device_agent (which cannot import host: its errors need a base of their own there); each leaves
    this list once its module derives it from UserError."""
    from device_agent.executor import ExecutorError, PageStoreError
    from device_agent.replay import ScheduleMismatchError
    from device_agent.serde import ScheduleFormatError
    from host.costs.profile import ProfileError
    from host.graph.model_source import ModelSourceError
    from host.graph.poet2022 import UnknownPoet2022ModelError
    from host.graph.resolve import UnknownModelNameError
    from host.graph.training_graph import GraphError
    from host.graph.zoo import UnknownModelError
    from host.solver.backends import UnknownSolverError
    from host.solver.solve import BudgetError
    from host.solver.validator import ScheduleValidationError

    errors: list[type[BaseException]] = [
        UserError, ProfileError, ModelSourceError, UnknownPoet2022ModelError, UnknownModelNameError, GraphError,
        UnknownModelError, UnknownSolverError, BudgetError, ScheduleFormatError, ScheduleValidationError,
        ExecutorError, PageStoreError, ScheduleMismatchError,
    ]
    optional = (
        ("host.graph.trace", "TraceError"),
        ("device_agent.profiling", "LocalBenchError"),
        ("host.solver.backends.pulp_backend", "SolverUnavailableError"),
        ("device_agent.serial_bridge.model", "McuModelError"),  # a model the firmware cannot train
        ("device_agent.serial_bridge.board", "McuBoardError"),  # the board refused a request, saying why
        ("device_agent.serial_bridge.link", "LinkError"),  # no board answers on the line
        ("device_agent.serial_bridge.qemu", "QemuError"),  # QEMU missing or not starting
    )
    for module_name, name in optional:  # modules with optional dependencies
        try:
            module = __import__(module_name, fromlist=[name])
        except ImportError:
            continue
        errors.append(getattr(module, name))
    return tuple(errors)
