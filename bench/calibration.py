"""Calibration bench: how well a board's profile predicts its training steps, before and after fitting.

On this machine: measure it as a board's PROFILE job does (micro-benchmarks, the "before" profile), run
real training steps of each model under three schedules (keep-all, remat-heavy, paging-heavy) with the
executor and its telemetry, fit the profile (``host.calibrate.fit.fit_profile``) to the first half of
the calibration models' steps, and compare predicted with measured median step time on the second
half, and on a model the fit never saw. Energy is compared only where a meter measured it.

    python bench/calibration.py [--steps 12] [--json]

Prints a table: model, schedule, measured step s, predicted before / after, error before / after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CALIBRATION_MODELS = (("mlp", 64), ("resnet18_cifar", 8), ("hf_bert", 2))
UNSEEN_MODEL = ("host.graph.examples:small_cnn", 8, "8,3,32,32")
SCHEDULES = {  # name -> (share of the no-remat peak, paging allowed, recomputation allowed)
    "keep-all": (1.0, True, True),
    "remat-heavy": (0.5, False, True),
    "paging-heavy": (0.5, True, False),
}


@dataclass
class Case:
    model: str
    schedule_name: str
    seen: bool
    run: object  # CalibrationRun over all steps
    fit_half: object
    held_out: object


def _split(run, steps: int):
    from host.calibrate.fit import CalibrationRun

    def part(lo: int, hi: int):
        return CalibrationRun(run.graph, run.schedule, [e for e in run.instructions if lo <= e["step"] < hi],
                              [s for s in run.steps if lo <= s["step"] < hi])

    middle = steps // 2 + 1
    return part(0, middle), part(middle, steps + 1)


def _run_case(model: str, batch_size: int, input_shape: str | None, schedule_name: str, profile, steps: int,
              flash_dir: str, log) -> object | None:
    import torch

    from device_agent.executor import EventStream, ScheduleExecutor
    from device_agent.profiling import default_energy_meter
    from host.calibrate.fit import CalibrationRun
    from host.costs import price_graph
    from host.graph.partition import partition_from_traced
    from host.run.solve import SolveSettings
    from host.run.sources import ModelSource
    from host.solver.solve import no_remat_peak_bytes, solve_schedule

    source = ModelSource(model, batch_size=batch_size, input_shape=input_shape)
    resolved = source.resolve()
    graph, traced, bundle = resolved.graph, resolved.traced, resolved.bundle
    priced = price_graph(graph, profile)
    share, paging, remat = SCHEDULES[schedule_name]
    peak = no_remat_peak_bytes(priced)
    result = None
    for attempt in (share, share + 0.15, share + 0.3):  # the floor may be above half the peak
        settings = SolveSettings(runtime_budget=3.0, paging=paging, remat=remat, time_limit_s=30)
        result = solve_schedule(priced, settings.options(min(attempt, 1.0) * peak))
        if result.schedule is not None:
            break
    if result is None or result.schedule is None:
        log(f"  {model} {schedule_name}: no schedule ({result.status if result else '?'}); skipped")
        return None
    schedule = result.schedule
    events = EventStream(capacity=None)
    optimizer = torch.optim.SGD([p for p in bundle.module.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(0)
    with ScheduleExecutor(partition_from_traced(traced), schedule, flash_dir=flash_dir, events=events,
                          energy_meter=default_energy_meter()) as executor:
        for _ in range(steps):
            executor.train_step(tuple(bundle.inputs), bundle.labels, optimizer)
    instructions, summaries = [], []
    for event in events.events:
        record = event.to_dict()
        record["step"] = int(record["step"]) + 1  # jobs number steps from 1
        (instructions if record["type"] == "instruction" else summaries).append(record)
    counts = schedule.counts()
    log(f"  {model} {schedule_name}: {counts['recomputes']} recomputes, {counts['page_outs']} page-outs, "
        f"median step {statistics.median(s['duration_s'] for s in summaries[1:]):.4f} s")
    return CalibrationRun(graph, schedule, instructions, summaries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per model and schedule (default 12)")
    parser.add_argument("--flash-dir", default=None, help="where pages go (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: the CPUs this process may run on)")
    parser.add_argument("--plot", metavar="DIR", help="write predicted-vs-measured plots into DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)

    import torch

    from device_agent.profiling import profile_local_machine
    from host.calibrate.fit import energy_mape, fit_profile, predict_step, step_time_mape
    from host.costs import PlatformProfile

    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0))))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(dir=args.flash_dir) as flash_dir:
        log("measuring this machine as a board's PROFILE job does (the profile before calibration)")
        before = PlatformProfile.from_dict(profile_local_machine(flash_dir, name="this-board", quick=False))
        cases: list[Case] = []
        plans = [(m, b, None, True) for m, b in CALIBRATION_MODELS] + [(UNSEEN_MODEL[0], UNSEEN_MODEL[1],
                                                                        UNSEEN_MODEL[2], False)]
        for model, batch, shape, seen in plans:
            for schedule_name in SCHEDULES:
                run = _run_case(model, batch, shape, schedule_name, before, args.steps, flash_dir, log)
                if run is not None:
                    fit_half, held_out = _split(run, args.steps)
                    cases.append(Case(model, schedule_name, seen, run, fit_half, held_out))
        after = fit_profile(before, [c.fit_half for c in cases if c.seen], note="bench/calibration.py")

    rows = []
    for case in cases:
        measured = statistics.median(s["duration_s"] for s in case.held_out.steps)
        predicted_before, _ = predict_step(before, case.run.graph, case.run.schedule)
        predicted_after, _ = predict_step(after, case.run.graph, case.run.schedule)
        rows.append({
            "model": case.model, "schedule": case.schedule_name, "seen_by_fit": case.seen,
            "measured_step_s": measured, "predicted_before_s": predicted_before, "predicted_after_s": predicted_after,
            "error_before_pct": 100 * abs(predicted_before - measured) / measured,
            "error_after_pct": 100 * abs(predicted_after - measured) / measured,
        })
    summary = {}
    for label, chosen in (("seen", [c for c in cases if c.seen]), ("unseen", [c for c in cases if not c.seen])):
        held = [c.held_out for c in chosen]
        if held:
            summary[label] = {"step_mape_before": step_time_mape(before, held),
                              "step_mape_after": step_time_mape(after, held),
                              "energy_mape_before": energy_mape(before, held),
                              "energy_mape_after": energy_mape(after, held)}
    energy_source = cases[0].run.steps[0].get("energy_source") if cases else None
    if args.plot:
        _plots(Path(args.plot), cases, before, after, log)
    report = {"cases": rows, "summary": summary, "energy_source": energy_source,
              "torch_threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{'model':<34} {'schedule':<13} {'measured s':>10} {'pred before':>11} {'pred after':>10} "
          f"{'err before':>10} {'err after':>9}")
    for r in rows:
        print(f"{r['model'] + ('' if r['seen_by_fit'] else ' (unseen)'):<34} {r['schedule']:<13} "
              f"{r['measured_step_s']:>10.5f} {r['predicted_before_s']:>11.5f} {r['predicted_after_s']:>10.5f} "
              f"{r['error_before_pct']:>9.1f}% {r['error_after_pct']:>8.1f}%")
    for label, figures in summary.items():
        energy = ("energy: no meter here (" + str(energy_source) + "), time only"
                  if figures["energy_mape_after"] is None else
                  f"energy MAPE {figures['energy_mape_before']:.1f}% -> {figures['energy_mape_after']:.1f}%")
        print(f"{label}: step-time MAPE {figures['step_mape_before']:.1f}% -> {figures['step_mape_after']:.1f}%; "
              f"{energy}")
    return 0


def _plots(directory: Path, cases: list[Case], before, after, log) -> None:
    from host.calibrate.fit import predict_step
    from host.costs import price_graph
    from host.plots import plot_node_predictions, plot_step_errors

    directory.mkdir(parents=True, exist_ok=True)
    points, series = [], {}
    for case in cases:
        priced_before, priced_after = price_graph(case.run.graph, before), price_graph(case.run.graph, after)
        seconds: dict[int, list[float]] = {}
        for event in case.held_out.instructions:
            if event["kind"] == "compute":
                seconds.setdefault(event["node"], []).append(event["duration_s"])
        points += [(statistics.median(v), float(priced_before.compute_s[n]), float(priced_after.compute_s[n]))
                   for n, v in seconds.items() if statistics.median(v) > 0]
        predicted_before, _ = predict_step(before, case.run.graph, case.run.schedule)
        predicted_after, _ = predict_step(after, case.run.graph, case.run.schedule)
        series[f"{case.model.rsplit(':', 1)[-1]} {case.schedule_name}"] = [
            (s["step"], 100 * (predicted_before / s["duration_s"] - 1), 100 * (predicted_after / s["duration_s"] - 1))
            for s in case.run.steps]
    log(f"plot {plot_node_predictions(points, directory / 'calibration_nodes.png', 'node computes on this machine')}")
    log(f"plot {plot_step_errors(series, directory / 'calibration_steps.png', 'step time over each run')}")


if __name__ == "__main__":
    sys.exit(main())
