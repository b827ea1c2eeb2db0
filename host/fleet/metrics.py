"""What a run records besides its status, budget and figures, as typed fields.

The store keeps them as the run's ``metrics`` JSON object (a new field needs no migration); this module is the one
place their names and types are spelled. Read with ``record.run_metrics`` (a :class:`RunMetrics`), write with
``store.update_run(run_id, metrics=RunMetrics.changes(steps_done=3, ...))``, which refuses a name that is not a field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunMetrics:
    schedule_key: str | None = None  # its schedule's key in the store's solves (None: PROFILE, below the floor)
    min_ram_budget_bytes: int | None = None  # the schedule's hard floor on this board
    recomputes: int = 0  # the schedule's, per step
    page_ins: int = 0
    page_outs: int = 0
    profile_name: str | None = None  # the profile the schedule was solved on (PROFILE: the one it stored)
    profile_version: int | str | None = None  # a stored version N, "shipped:NAME" or "local"
    steps_done: int = 0  # from the result, or live from step telemetry
    last_loss: float | None = None  # of the latest step whose telemetry was stored (None: not finite)
    loss_per_step: list[float | None] = field(default_factory=list)  # from the result (None where not finite)
    final_loss: float | None = None
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    param_digest: str | None = None
    max_rel_param_diff: float | None = None  # VERIFY (None when infinite: the detail says it)
    events_emitted: int = 0  # telemetry events the board sequenced for the run
    weights_path: str | None = None  # collected weights, relative to the state dir
    refinement: dict[str, Any] | None = None  # what the run's telemetry did to its board's calibrated profile

    @classmethod
    def of(cls, bag: Mapping[str, Any] | None) -> RunMetrics:
        """The fields of a stored metrics object (missing ones at their defaults, nulls of counts as 0)."""
        bag = bag or {}
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in bag and bag[f.name] is not None:
                values[f.name] = bag[f.name]
        return cls(**values)

    @classmethod
    def changes(cls, **values: Any) -> dict[str, Any]:
        """The JSON changes of these fields, for RunStore.update_run's ``metrics`` (TypeError naming a non-field)."""
        unknown = sorted(set(values) - NAMES)
        if unknown:
            raise TypeError(f"{', '.join(unknown)}: not a field of RunMetrics ({', '.join(sorted(NAMES))})")
        return dict(values)


NAMES = frozenset(f.name for f in dataclasses.fields(RunMetrics))
