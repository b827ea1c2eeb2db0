"""`poet calibrate`: the stored telemetry as the fit reads it, and the whole loop end to end with a real
coordinator (`poet serve`) and a real board (`poet-agent run`) on loopback."""

from __future__ import annotations

import pytest

from device_agent import protos
from host.fleet import serde
from host.fleet.calibration import Calibration, fit_and_heldout_steps, pool_runs, split_run, telemetry_steps
from host.fleet.limits import CALIBRATION_REPEATS
from tests.e2e.conftest import cert_dir, dump, fleet, shards, wait_until  # noqa: F401 (fixtures)

fleet_pb2 = protos.load("poet.v1.fleet_pb2")
schedule_pb2 = protos.load("poet.v1.schedule_pb2")


def _instruction(seq, executor_step, kind, node, **extra):
    return serde.event_payload(fleet_pb2.TelemetryEvent(seq=seq, job_id="j", instruction=fleet_pb2.InstructionTelemetry(
        step=executor_step, kind=kind, node=node, node_name=f"n{node}", **extra)))


def _step(seq, step, **extra):
    return serde.event_payload(fleet_pb2.TelemetryEvent(seq=seq, job_id="j", step=fleet_pb2.StepTelemetry(
        step=step, **extra)))


def test_stored_payloads_become_the_fits_dicts_numbered_by_the_jobs_steps():
    compute, page_out = schedule_pb2.INSTRUCTION_KIND_COMPUTE, schedule_pb2.INSTRUCTION_KIND_PAGE_OUT
    payloads = [
        _instruction(1, 0, compute, 0, duration_s=0.5, cpu_s=0.4),
        _instruction(2, 0, page_out, 1, duration_s=0.25, bytes_moved=1 << 40),
        _step(3, 1, duration_s=1.0, optimizer_s=0.1, energy_j=2.0, energy_source="measured:rapl"),
        {"seq": "4", "job_id": "j", "rss": {"rss_bytes": "123"}},
        # a resume: the executor counts from 0 again, step 2's events come twice; the later copy wins
        _instruction(5, 1, compute, 0, duration_s=9.0),
        _step(6, 2, duration_s=9.0, energy_source="modelled:cpu-time×power"),
        _instruction(7, 0, compute, 0, duration_s=0.75),
        _step(8, 2, duration_s=0.8, energy_source="modelled:cpu-time×power", timing_source="emulated:qemu"),
    ]
    assert payloads[1]["instruction"]["bytes_moved"] == str(1 << 40)  # as stored: 64-bit ints are strings
    instructions, steps = telemetry_steps(payloads)
    assert [(i["step"], i["kind"], i["node"], i["duration_s"]) for i in instructions] == [
        (1, "compute", 0, 0.5), (1, "page_out", 1, 0.25), (2, "compute", 0, 0.75)]
    assert instructions[1]["bytes_moved"] == 1 << 40 and instructions[0]["cpu_s"] == 0.4
    assert instructions[0]["node_name"] == "n0"
    free = schedule_pb2.INSTRUCTION_KIND_FREE
    frees, _ = telemetry_steps([_instruction(1, 0, free, 1, location=schedule_pb2.LOCATION_FLASH, duration_s=0.001),
                                _instruction(2, 0, free, 2, duration_s=1e-6), _step(3, 1, duration_s=1.0)])
    assert [(i["kind"], i["location"]) for i in frees] == [("free", "flash"), ("free", "ram")]  # deletes priced apart
    assert steps[0] == {"step": 1, "duration_s": 1.0, "optimizer_s": 0.1, "compute_s": 0.0, "paging_s": 0.0,
                        "cpu_s": 0.0, "energy_source": "measured:rapl", "timing_source": "", "energy_j": 2.0}
    assert steps[1]["step"] == 2 and steps[1]["duration_s"] == 0.8 and "energy_j" not in steps[1]
    assert steps[1]["timing_source"] == "emulated:qemu"  # the refinement skips runs timed by an emulator


def test_a_transfers_time_on_the_compute_thread_reaches_the_fit_and_is_absent_where_not_timed():
    from device_agent.executor.telemetry import InstructionEvent
    from device_agent.serde import telemetry_event_to_proto

    timed = InstructionEvent(0, 7, "page_out", 1, "n1", "fwd", "flash", 2e-3, 4096, 0, 0, compute_thread_s=3e-4)
    untimed = InstructionEvent(0, 8, "compute", 2, "n2", "fwd", "ram", 1e-3, 0, 0, 0)
    payloads = [serde.event_payload(telemetry_event_to_proto(event, job_id="j", unix_time_s=0.0))
                for event in (timed, untimed)]
    payloads = [dict(payload, seq=str(seq)) for seq, payload in enumerate(payloads, 1)]
    instructions, _ = telemetry_steps([*payloads, _step(3, 1, duration_s=0.01)])
    assert instructions[0]["compute_thread_s"] == 3e-4 and instructions[0]["duration_s"] == 2e-3
    assert "compute_thread_s" not in instructions[1]


def test_a_calibration_remembers_every_stage_it_entered_so_a_slow_poller_misses_none():
    calibration = Calibration("cal-1", "b1", "op", ["mlp"], 20, 8)
    calibration.set_stage("PROFILE job: the board measures its compute and flash")
    calibration.set_stage("solving mlp (keep-all) on profile v1")
    calibration.set_stage("calibration runs: run-1 running step 3")
    calibration.set_stage("calibration runs: run-1 running step 4")  # progress within a stage: not a new one
    info = calibration.info()
    assert list(info.stages) == ["starting", "PROFILE job", "solving mlp (keep-all) on profile v1", "calibration runs"]
    assert info.stage == "calibration runs: run-1 running step 4"


def test_fit_and_heldout_halves_interleave_after_the_warmup_step():
    assert fit_and_heldout_steps(12) == ([2, 4, 6, 8, 10, 12], [3, 5, 7, 9, 11])
    assert fit_and_heldout_steps(4) == ([2, 4], [3])


def test_repeats_pool_into_one_run_whose_halves_are_each_runs_halves():
    """Three runs of one schedule pooled: every step and instruction kept, renumbered apart, each run's even
    (fitted) steps still even and its odd (held-out) steps odd, so the halves split as each run's did."""
    from host.calibrate.fit import CalibrationRun

    def run(seconds):
        return CalibrationRun(graph="g", schedule="s",
                              instructions=[{"step": n, "kind": "compute", "duration_s": t} for n, t in seconds],
                              steps=[{"step": n, "duration_s": t} for n, t in seconds])

    runs = [run([(1, 9.0), (2, 1.0), (3, 2.0), (4, 1.0), (5, 2.0)]), run([(1, 9.0), (2, 3.0), (3, 4.0)]),
            run([(1, 9.0), (2, 5.0), (3, 6.0), (4, 5.0), (5, 6.0), (6, 5.0), (7, 6.0)])]
    pooled = pool_runs(runs)
    assert pooled.graph == "g" and pooled.schedule == "s"
    numbers = [s["step"] for s in pooled.steps]
    assert len(numbers) == len(set(numbers)) == 15 and [i["step"] for i in pooled.instructions] == numbers
    _, held = fit_and_heldout_steps(7)
    fitted = [s["duration_s"] for s in split_run(pooled, range(0, 100, 2)).steps]
    held_out = [s["duration_s"] for s in pooled.steps if s["step"] % 2 and s["duration_s"] != 9.0]
    assert sorted(fitted) == [1.0, 1.0, 3.0, 5.0, 5.0, 5.0] and sorted(held_out) == [2.0, 2.0, 4.0, 6.0, 6.0, 6.0]
    # held-out halves pooled after the split keep only held-out steps, none of them a run's warm-up step 1
    pooled_held = pool_runs([split_run(r, held) for r in runs])
    assert sorted(s["duration_s"] for s in pooled_held.steps) == [2.0, 2.0, 4.0, 6.0, 6.0, 6.0]
    assert min(s["step"] for s in pooled_held.steps) > 1
    with pytest.raises(ValueError, match="no runs"):
        pool_runs([])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_poet_calibrate_end_to_end_stores_a_fitted_version_the_next_run_is_solved_on(fleet):  # noqa: F811
    fleet.serve()
    fleet.agent("b1", extra=("--platform", "a72"))
    done = fleet.poet("calibrate", "--agent", "b1", "--models", "mlp", "--wait", "--json", timeout_s=540)
    assert done.returncode == 0, done.stderr
    from tests.host.cli.helpers import one_json_object

    report = one_json_object(done.stdout)
    assert {"agent", "profile_version", "step_mape_before", "step_mape_after", "energy_mape_before",
            "energy_mape_after", "energy_source"} <= set(report), dump(report)
    assert report["agent"] == "b1" and report["base_profile_version"] == 1 and report["profile_version"] == 2
    assert report["step_mape_before"] >= 0 and report["step_mape_after"] >= 0
    assert report["step_mape_after"] < report["step_mape_before"], dump(report)
    # no meter on this machine: energy is modelled from CPU time, so there is no energy error to report
    assert report["energy_source"].startswith("modelled:"), dump(report)
    assert report["energy_mape_before"] is None and report["energy_mape_after"] is None
    runs = report["runs"]
    assert [(r["model"], r["schedule"], r["status"]) for r in runs] == [
        ("mlp", "keep-all", "done"), ("mlp", "remat-heavy", "done"), ("mlp", "paging-heavy", "done")], dump(report)
    assert all(len(r["run_ids"]) == CALIBRATION_REPEATS and r["run_ids"][0] == r["run_id"] for r in runs)
    assert runs[0]["page_outs"] == runs[0]["recomputes"] == 0
    assert runs[1]["recomputes"] > 0 and runs[1]["page_outs"] == 0, dump(report)
    assert runs[2]["page_outs"] > 0 and runs[2]["recomputes"] == 0, dump(report)
    assert "b1: PROFILE job" in done.stderr and "b1: calibration runs" in done.stderr  # --wait: progress on stderr
    # every schedule is solved before the first run is queued (the board never trains beside a solve), so each
    # kind of schedule is submitted once, at the share it fits: mlp fits no paging-only schedule at 50% or 65%
    listed = [(r["kind"], r["status"]) for r in fleet.poet_json("runs", "list")["runs"]]
    assert listed == [("profile", "done")] + [("train", "done")] * 3 * CALIBRATION_REPEATS, listed
    assert runs[2]["budget"] == "80% of the no-remat peak", dump(report)
    print(dump(report))

    versions = fleet.poet_json("profiles", "list", "--agent", "b1")["profiles"]
    assert [(v["version"], v["provenance"]["source"]) for v in versions] == [(1, "profile-job"),
                                                                            (2, "calibration")]
    provenance = versions[1]["provenance"]
    assert provenance["agent"] == "b1" and provenance["base_version"] == 1
    # in rounds: every schedule once, then again
    assert provenance["run_ids"] == [r["run_ids"][k] for k in range(CALIBRATION_REPEATS) for r in runs]
    assert provenance["repeats"] == CALIBRATION_REPEATS
    assert provenance["step_mape_after"] == report["step_mape_after"]
    assert provenance["energy_mape_after"] is None and provenance["created_unix_s"] > 0
    diff = fleet.poet_json("profiles", "diff", "b1", "1", "2")
    assert diff["changes"], dump(diff)
    for run_id in provenance["run_ids"]:  # the calibration runs were solved on version 1, the PROFILE job's
        assert fleet.show(run_id)["profile"]["version"] == 1
    after = fleet.submit("b1", steps=2)[0]
    assert after["profile"]["version"] == 2, dump(after)

    # an ordinary run's telemetry refines the calibrated fit: refit on the calibration runs plus this run, stored
    # as version 3 only when it predicts their held-out steps at least as well as version 2
    short = fleet.wait_settled(after["run_id"])
    trained = fleet.submit("b1", steps=8, wait=True, timeout_s=180)[0]
    assert trained["status"] == "done", dump(trained)

    def refined():
        shown = fleet.show(trained["run_id"])
        return shown["refinement"] is not None and shown

    shown = wait_until(refined, 120, "the run's profile refinement", interval_s=0.5)
    refinement = shown["refinement"]
    assert refinement["status"] in ("stored", "kept"), dump(shown)
    assert refinement["refined_version"] == 2 and refinement["step_mape_before"] >= 0, dump(shown)
    versions = fleet.poet_json("profiles", "list", "--agent", "b1")["profiles"]
    if refinement["status"] == "stored":
        assert refinement["step_mape_after"] <= refinement["step_mape_before"], dump(shown)
        assert refinement["profile_version"] == 3 and versions[-1]["version"] == 3, dump(versions)
        assert versions[-1]["provenance"]["source"] == "refinement"
        assert versions[-1]["provenance"]["train_run_ids"] == [trained["run_id"]], dump(versions)
        assert versions[-1]["provenance"]["run_ids"] == provenance["run_ids"]
    else:  # the refit predicted worse: version 2 stays the latest
        assert refinement["step_mape_after"] > refinement["step_mape_before"], dump(shown)
        assert [v["version"] for v in versions] == [1, 2], dump(versions)
    # a two-step run has nothing to hold out: it is skipped, and says why
    assert fleet.show(short["run_id"])["refinement"]["status"] == "skipped"


def test_a_model_whose_floor_is_above_every_heavy_share_gets_a_budget_between_floor_and_peak_it_trains_in():
    """small_cnn_images at batch 8: its convolutions' own buffers put the hard floor at 94% of the no-remat
    peak, above 50/65/80%. `poet calibrate` (and the bench) then train the heavy schedules halfway from the
    floor to the peak, where a recompute-only and a paging-only schedule both exist and must do real work."""
    from host.fleet.calibration import HEAVY_FRACTIONS_OF_PEAK, heavy_budget_after_refusal, heavy_budget_bytes
    from host.run.solve import SolveSettings, prepare_solve, solve
    from host.run.sources import ModelSource
    from host.solver.solve import minimum_ram_bytes

    model = "host.graph.examples:small_cnn_images"
    problem = prepare_solve(ModelSource(model, batch_size=8), "a72", "100%", SolveSettings())
    floor, peak = minimum_ram_bytes(problem.priced), problem.no_remat_peak_bytes
    assert floor > max(HEAVY_FRACTIONS_OF_PEAK) * peak
    budget = heavy_budget_bytes(floor, peak)
    assert floor < budget < peak
    for remat, paging, moved in ((True, False, "recomputes"), (False, True, "page_outs")):
        report = solve(model, "a72", budget, batch_size=8, remat=remat, paging=paging, runtime_budget=4.0,
                       time_limit_s=60)
        assert report.ok, report.status
        assert getattr(report, moved) > 0, report.to_dict()
    with pytest.raises(ValueError, match="floor"):
        heavy_budget_bytes(peak + 1, peak)
    # from a refusal as `poet run --json` reports it (the budget and the floor): the peak is recovered
    refused = int(max(HEAVY_FRACTIONS_OF_PEAK) * peak)
    assert abs(heavy_budget_after_refusal(floor, refused, max(HEAVY_FRACTIONS_OF_PEAK)) - budget) <= 1
    assert heavy_budget_after_refusal(refused - 1, refused, max(HEAVY_FRACTIONS_OF_PEAK)) is None  # another cause
    assert heavy_budget_after_refusal(None, refused, max(HEAVY_FRACTIONS_OF_PEAK)) is None
