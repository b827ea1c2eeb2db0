"""A run's metrics are typed fields (host/fleet/metrics.py), and the store takes no others (issue 17, part 6)."""

from __future__ import annotations

import pytest


def test_a_runs_metrics_are_typed_fields_and_the_store_takes_no_others(tmp_path):
    from host.fleet.metrics import RunMetrics
    from host.fleet.store import RunStore, StoreError, sqlite_url

    with RunStore(sqlite_url(tmp_path)) as store:
        store.register_agent("pi-1", "a72", {"ram_total_bytes": 1 << 30})
        store.create_job("j1", "train", {"model": "mlp", "steps": 3})
        store.create_run("r1", "j1", "pi-1", "train")
        store.update_run("r1", metrics=RunMetrics.changes(steps_done=2, last_loss=0.5, profile_version=3))
        metrics = store.get_run("r1").run_metrics
        assert (metrics.steps_done, metrics.last_loss, metrics.profile_version, metrics.events_emitted) == (2, 0.5, 3, 0)
        with pytest.raises(StoreError, match="'steps_dne'.*not fields of RunMetrics"):
            store.update_run("r1", metrics={"steps_dne": 4})  # a misspelt key had been stored silently
        with pytest.raises(StoreError, match="'stepsdone'"):
            store.create_submission("j2", "train", {}, [{"run_id": "r2", "agent": "pi-1", "metrics": {"stepsdone": 0}}])
        assert store.get_run("r1").metrics == {"steps_done": 2, "last_loss": 0.5, "profile_version": 3}
    with pytest.raises(TypeError, match="steps_dne"):
        RunMetrics.changes(steps_dne=4)
