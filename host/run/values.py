"""Checks and parsers for the values people pass: one definition for the Python API and the CLI.

Each check raises :class:`ValueError` with a message that does not name the argument; the API
prefixes the keyword (:func:`checked`), the CLI's argparse types prefix the flag, so both say
which value was wrong the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from host.run.errors import InputError

T = TypeVar("T")


def finite_float(value: Any, *, at_least: float | None = None, above: float | None = None,
                 at_most: float | None = None, hint: str = "") -> float:
    """``value`` as a float that is finite and within the bounds given; ``hint`` explains the range."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number{hint}") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number{hint}")
    if at_least is not None and number < at_least:
        raise ValueError(f"{value} is below {at_least}{hint}")
    if above is not None and number <= above:
        raise ValueError(f"{value} must be greater than {above}{hint}")
    if at_most is not None and number > at_most:
        raise ValueError(f"{value} is above {at_most}{hint}")
    return number


def int_at_least(value: Any, minimum: int, *, hint: str = "") -> int:
    """``value`` as an int >= ``minimum`` (a bool or a float with a fraction is refused)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{value!r} is not a whole number{hint}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a whole number{hint}") from None
    if number < minimum:
        raise ValueError(f"{value} is below {minimum}{hint}")
    return number


def checked(name: str, check: Callable[..., T], value: Any, **bounds: Any) -> T:
    """Run ``check(value, **bounds)`` for the API keyword ``name``; a failure is an InputError naming it."""
    try:
        return check(value, **bounds)
    except ValueError as error:
        raise InputError(f"{name}: {error}") from None


# ----------------------------------------------------------------------------------- the checks per value
RUNTIME_BUDGET_HINT = (" (a factor of the plain forward+backward runtime: 1.0 allows no extra compute, "
                       "1.2 allows 20% more)")


def runtime_factor(value: Any) -> float:
    return finite_float(value, at_least=1.0, hint=RUNTIME_BUDGET_HINT)


def time_limit_s(value: Any) -> float:
    return finite_float(value, above=0.0, hint=" (seconds)")


def mip_gap(value: Any) -> float:
    return finite_float(value, at_least=0.0, at_most=1.0, hint=" (a relative gap: 0.001 is 0.1%)")


def learning_rate(value: Any) -> float:
    return finite_float(value, above=0.0, hint=" (a learning rate, e.g. 0.01)")


def count(value: Any, minimum: int = 1) -> int:
    return int_at_least(value, minimum)


def seed(value: Any) -> int:
    return int_at_least(value, 0)


# ----------------------------------------------------------------------------------- RAM budget
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1000**3, "gib": 1024**3}
_SIZE_HELP = "give bytes (3000000), a unit (3MB, 2.5MiB) or a share of the no-remat peak (50%)"


@dataclass(frozen=True)
class RamBudget:
    """A RAM budget as given: an absolute number of bytes, or a share of the model's no-remat peak.

    The no-remat peak is the controlled RAM of plain training (every activation computed once and
    kept until its last use); a share is resolved against it once the model is traced.
    """

    budget_bytes: float | None = None
    share: float | None = None  # 0.5 for "50%"
    text: str = ""

    @classmethod
    def parse(cls, value: Any) -> RamBudget:
        """Bytes (an int or float, or "3000000"), a unit ("3MB", "2.5MiB"), or a share ("50%")."""
        if isinstance(value, RamBudget):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(budget_bytes=finite_float(value, above=0.0, hint=" (bytes)"), text=f"{value:g}")
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a size: {_SIZE_HELP}")
        text = value.strip().lower().replace("_", "").replace(",", "")
        if text.endswith("%"):
            try:
                percent = finite_float(text[:-1], above=0.0)
            except ValueError:
                raise ValueError(f"{value!r} is not a finite, positive share of the no-remat peak (e.g. 50%)") from None
            return cls(share=percent / 100.0, text=value.strip())
        match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)", text)
        if not match or match.group(2) not in _SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size: {_SIZE_HELP}")
        number = finite_float(match.group(1), hint=" (bytes)") * _SIZE_UNITS[match.group(2)]
        number = finite_float(number, above=0.0, hint=" (bytes)")
        return cls(budget_bytes=number, text=value.strip())

    def resolve(self, no_remat_peak_bytes: float | None) -> float:
        """The budget in bytes; a share needs the model's no-remat peak."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        if no_remat_peak_bytes is None:
            raise InputError(f"a RAM budget of {self.text} needs the model's no-remat peak")
        return self.share * no_remat_peak_bytes

    def __str__(self) -> str:
        return self.text or (f"{100 * self.share:g}%" if self.share is not None else f"{self.budget_bytes:.0f}")


def parse_ram_budget(text: Any, no_remat_peak_bytes: float | None = None) -> float:
    """Bytes, with an optional unit (KiB, MB, …), or a percentage of the no-remat peak ("50%")."""
    return checked("ram_budget", RamBudget.parse, text).resolve(no_remat_peak_bytes)
