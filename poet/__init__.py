"""The POET paper's Python API (ICML 2022), answered by poet-edge: ``from poet import solve``.

The paper code's README call works as written::

    from poet import solve

    result = solve(model="resnet18_cifar", platform="m4", ram_budget=737719, runtime_budget=1.5,
                   time_limit_s=400, solve_threads=16)
    print(result.status, result.objective_j, result.peak_ram_bytes)

Through this face the paper's model names mean the paper's own graphs (``poet2022:resnet18_cifar`` in
``poet_edge``, where ``resnet18_cifar`` is the real PyTorch model, traced). Use ``poet_edge`` for your
own models and for training. Solving needs the host extra: ``pip install poet-edge[host]``.
"""

import importlib.util

# The solver backends of the host extra: a board's install (the wheel without extras) has neither.
_HOST_MODULES = ("highspy", "pulp")
_missing = [name for name in _HOST_MODULES if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"`poet` (the POET paper's solve API) solves schedules and needs poet-edge's host extra, but "
        f"{', '.join(_missing)} is not installed: pip install poet-edge[host]  (a board running only the "
        "agent does not need `poet`)",
        name=_missing[0],
    )

from poet._paper import PAPER_MODELS, InfeasibleBudgetError, solve  # noqa: E402  (after the check above)

__all__ = ["PAPER_MODELS", "InfeasibleBudgetError", "solve"]
