"""poet-edge's public Python API: energy-optimal training schedules (POET, ICML 2022) and training under them.

Solve the paper's ResNet-18 (CIFAR) graph for a Cortex-M4 at 737,719 bytes of RAM::

    from poet_edge import solve

    result = solve(model="poet2022:resnet18_cifar", platform="m4", ram_budget=737719, runtime_budget=1.5,
                   time_limit_s=400, solve_threads=16)
    print(result.status, result.objective_j, result.peak_ram_bytes, result.gap)
    result.save("r18.schedule.json")  # for `poet train --schedule` or train(schedule=...)

Train your own ``nn.Module`` under its schedule, or check that doing so changes nothing::

    from poet_edge import train, verify

    report = train(net, "a72", "50%", inputs=x, labels=y, loss_fn=loss, steps=10, flash_dir="/mnt/sd")
    assert verify(net, "a72", "50%", inputs=x, labels=y, loss_fn=loss).ok

Every figure carries its unit in its name: joules (``_j``), seconds (``_s``), bytes (``_bytes``).
The `poet` command is a thin layer over these same functions.
"""

from host.run.errors import InputError, SolveFailedError
from host.run.loops import StepProgress
from host.run.solve import ParetoReport, SolveReport, pareto, solve
from host.run.train import TrainReport, VerifyReport, demo, train, verify
from host.run.values import RamBudget
from host.solver.deadline import DEFAULT_TIME_LIMIT_S
from host.solver.milp import SolverProgress

__all__ = [
    "DEFAULT_TIME_LIMIT_S",
    "InputError",
    "ParetoReport",
    "RamBudget",
    "SolveFailedError",
    "SolveReport",
    "SolverProgress",
    "StepProgress",
    "TrainReport",
    "VerifyReport",
    "demo",
    "pareto",
    "solve",
    "train",
    "verify",
]
