"""The library behind the public API (``poet_edge``) and the `poet` command: solve, train, verify.

Both call these same functions, so the Python API and the CLI cannot drift apart.
"""

from host.run.errors import InputError, SolveFailedError
from host.run.loops import StepProgress
from host.run.solve import ParetoReport, SolveReport, pareto, solve
from host.run.train import TrainReport, VerifyReport, demo, train, verify
from host.run.values import RamBudget

__all__ = [
    "InputError",
    "ParetoReport",
    "RamBudget",
    "SolveFailedError",
    "SolveReport",
    "StepProgress",
    "TrainReport",
    "VerifyReport",
    "demo",
    "pareto",
    "solve",
    "train",
    "verify",
]
