"""Executor benchmark: prints tables, never passes or fails.

1. Overhead without memory pressure: step time of the keep-all schedule against plain PyTorch, measured
   in one process with the two interleaved (target ratio <= 1.05).
2. At 50% of the no-remat peak: energy, time and measured peak of POET's schedule against
   torch.utils.checkpoint (checkpoint_sequential with k segments, and per-block checkpointing).
   Time and energy: all methods in one process, their steps interleaved (so drift on a shared machine
   hits them alike), with freed memory kept for reuse as ``poet train`` does. Peak: each method alone
   in its own process, with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave RSS at once and the
   RSS high-water mark is the live-memory peak for every method alike. POET's schedule is solved on the
   quick local profile fitted to the executor's telemetry of this model first (``host.calibrate``: a
   keep-all run and a paging run, 4 steps each); ``--no-calibrate`` solves on the quick profile as is.

    python bench/executor.py [--model resnet18_cifar] [--batch-size 64] [--threads 1] [--flash-dir DIR]

Part 1 runs at three granularities (layer, block:2, block:1) under two allocator settings: glibc's
default, and glibc keeping freed memory for reuse (``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``, what ``poet train`` sets by default), which separates the executor's own
cost from page faults caused by memory going back to the OS and returning.

Energy is modelled (process CPU time x assumed power, ``modelled:cpu-time×power``), not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ----------------------------------------------------------------------------- part 1: overhead
def _per_node_autograd_step(partition, inputs, labels, optimizer) -> None:
    """The floor of running a model node by node: the partition's programs, each output detached into a new
    leaf and each node differentiated by its own ``torch.autograd.grad`` call, as the executor does, but
    with no RAM store, saved-tensor hooks, telemetry or checks. Autograd keeps what it saves itself."""
    env = dict(zip(partition.batch_values, inputs, strict=True))
    env[partition.label_value] = labels
    programs = [p for i, p in sorted(partition.programs.items()) if p.run is not None]
    last_read = {v: i for i, program in enumerate(programs) for v in program.input_values}
    optimizer.zero_grad(set_to_none=True)
    graphs = []
    for i, program in enumerate(programs):
        leaves = {}
        fed = []
        for value in program.input_values:
            tensor = env[value]
            if program.bwd_index is not None and value in program.grad_input_values:
                tensor = leaves[value] = tensor.detach().requires_grad_(True)
            fed.append(tensor)
        with torch.enable_grad():
            outputs = dict(zip(program.output_values, program.run(*fed), strict=True))
        for value in program.input_values:
            if last_read.get(value) == i:
                env.pop(value, None)
        env.update((name, output.detach()) for name, output in outputs.items())
        if program.bwd_index is not None:
            graphs.append((program, leaves, outputs))
    grads = {partition.loss_value: torch.ones(())}
    while graphs:
        program, leaves, outputs = graphs.pop()
        roots = [(outputs[name], grads.pop(name)) for name in outputs if name in grads and outputs[name].requires_grad]
        if not roots:
            continue
        results = torch.autograd.grad([r for r, _ in roots], [*leaves.values(), *program.params],
                                      grad_outputs=[g for _, g in roots], allow_unused=True)
        for name, grad in zip(leaves, results, strict=False):
            if grad is not None:
                grads[name] = grads[name] + grad if name in grads else grad
        for param, grad in zip(program.params, results[len(leaves):], strict=True):
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
    optimizer.step()


def overhead_rows(model: str, batch_size: int, steps: int, threads: int) -> list[dict]:
    """Keep-all schedule against plain PyTorch (and the per-node floor), interleaved in one process, per granularity."""
    torch.set_num_threads(threads)
    return [_overhead_row(model, granularity, depth, batch_size, steps)
            for granularity, depth in (("layer", 1), ("block", 2), ("block", 1))]


def _overhead_row(model: str, granularity: str, depth: int, batch_size: int, steps: int) -> dict:
    from device_agent.executor import ScheduleExecutor, plain_train_step
    from host.costs import load_profile, price_graph
    from host.graph.partition import partition_from_traced
    from host.graph.trace import trace_model
    from host.graph.zoo import get_model_spec
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    spec = get_model_spec(model)
    scheduled, plain, floor = (spec.bundle(batch_size, seed=0) for _ in range(3))
    traced = trace_model(scheduled, granularity=granularity, block_depth=depth)
    priced = price_graph(traced.graph, load_profile("a72"))
    schedule = solve_schedule(priced, SolveOptions(ram_budget_bytes=no_remat_peak_bytes(priced))).schedule
    sgd_a, sgd_b, sgd_c = (torch.optim.SGD(b.module.parameters(), lr=0.01, momentum=0.9)
                           for b in (scheduled, plain, floor))
    floor_partition = partition_from_traced(trace_model(floor, granularity=granularity, block_depth=depth))
    times_s: dict[str, list[float]] = {"schedule": [], "plain": [], "floor": []}
    with ScheduleExecutor(partition_from_traced(traced), schedule) as executor:
        runs = {
            "schedule": lambda: executor.train_step(scheduled.inputs, scheduled.labels, sgd_a),
            "plain": lambda: plain_train_step(plain.module, plain.loss_fn, plain.inputs, plain.labels, sgd_b),
            "floor": lambda: _per_node_autograd_step(floor_partition, floor.inputs, floor.labels, sgd_c),
        }
        for step in range(steps + 2):  # interleaved; the first two of each are warm-up
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                if step >= 2:
                    times_s[name].append(time.perf_counter() - started)
    paired = sorted(a / b for a, b in zip(times_s["schedule"], times_s["plain"], strict=True))
    floor_paired = sorted(a / b for a, b in zip(times_s["floor"], times_s["plain"], strict=True))
    return {
        "granularity": granularity if granularity == "layer" else f"block:{depth}",
        "nodes": traced.graph.size,
        "instructions": len(schedule.instructions),
        "plain_s": statistics.median(times_s["plain"]),
        "schedule_s": statistics.median(times_s["schedule"]),
        "ratio": statistics.median(paired),  # median over steps of schedule/plain, each pair back to back
        "ratio_q1": paired[len(paired) // 4],
        "ratio_q3": paired[(3 * len(paired)) // 4],
        "floor_ratio": statistics.median(floor_paired),
    }


# ----------------------------------------------------------------------------- part 2: one run per process
def _sequential(module):
    """The zoo ResNet as a flat nn.Sequential: stem, each block, pool, flatten, fc."""
    return torch.nn.Sequential(module.stem, *module.blocks, module.pool, module.flatten, module.fc)


class _Checkpointed(torch.nn.Module):
    """Runs ``inner`` under torch.utils.checkpoint: per-block checkpointing."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


class _Method:
    """One training method on its own copy of the model: ``step()`` trains one step, returns paging seconds."""

    def __init__(self, config: dict, method: dict, meter) -> None:
        from device_agent.executor import ScheduleExecutor, plain_train_step
        from device_agent.serde import read_schedule_file
        from host.graph.partition import partition_from_traced
        from host.graph.trace import trace_model
        from host.graph.zoo import get_model_spec

        self.bundle = bundle = get_model_spec(config["model"]).bundle(config["batch_size"], seed=0)
        self.optimizer = torch.optim.SGD(bundle.module.parameters(), lr=0.01, momentum=0.9)
        self.kind = method["method"]
        self.segments = method.get("segments")
        self.executor = None
        self.sequential = _sequential(bundle.module)
        self.per_block = torch.nn.Sequential(*[_Checkpointed(m) for m in self.sequential])
        self._plain_step = plain_train_step
        if self.kind == "poet":
            traced = trace_model(bundle, granularity="layer")
            self.executor = ScheduleExecutor(partition_from_traced(traced), read_schedule_file(config["schedule"]),
                                             flash_dir=config["flash_dir"], energy_meter=meter)

    def step(self) -> float:
        bundle, optimizer = self.bundle, self.optimizer
        if self.executor is not None:
            return self.executor.train_step(bundle.inputs, bundle.labels, optimizer).summary.paging_s
        if self.kind == "plain":  # the reference: the zoo module itself, eagerly
            self._plain_step(bundle.module, bundle.loss_fn, bundle.inputs, bundle.labels, optimizer)
            return 0.0
        optimizer.zero_grad(set_to_none=True)
        x = bundle.inputs[0]
        if self.kind == "per_block":
            output = self.per_block(x)
        else:
            output = checkpoint_sequential(self.sequential, self.segments, x, use_reentrant=False)
        bundle.loss_fn(output, bundle.labels).backward()
        optimizer.step()
        return 0.0

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


def _meter(config: dict):
    from device_agent.meters.modelled import ModelledEnergyMeter

    return ModelledEnergyMeter(config["compute_power_w"], config["memory_power_w"], config["threads"])


def run_timed(config: dict) -> list[dict]:
    """Every method in this one process, their steps interleaved: median step time and energy per method."""
    torch.set_num_threads(config["threads"])
    meter = _meter(config)
    methods = [_Method(config, method, meter) for method in config["methods"]]
    for method in methods:
        method.step()  # warm-up
    times_s: list[list[float]] = [[] for _ in methods]
    energies_j: list[list[float]] = [[] for _ in methods]
    for _ in range(config["steps"]):
        for method, times, energies in zip(methods, times_s, energies_j, strict=True):
            start = meter.read()
            paging_s = method.step()
            end = meter.read()
            times.append(end.wall_s - start.wall_s)
            energies.append(meter.energy_j(start, end, paging_s)[0])
    results = []
    for method, times, energies in zip(methods, times_s, energies_j, strict=True):
        result = {"step_s": statistics.median(times), "energy_j": statistics.median(energies)}
        if method.executor is not None:
            result["peak_tracked_bytes"] = method.executor.ram.peak_bytes
        method.close()
        results.append(result)
    return results


def run_peak(config: dict) -> dict:
    """One method alone in this process: the RSS high-water mark of its steps above the step-start RSS."""
    from device_agent.executor.allocator import release_free_memory
    from device_agent.meters.memory import PeakRssSampler

    torch.set_num_threads(config["threads"])
    method = _Method(config, config["methods"][0], _meter(config))
    method.step()  # warm-up
    release_free_memory()
    with PeakRssSampler() as peak:
        for _ in range(config["steps"]):
            method.step()
    method.close()
    return {"peak_rss_delta_bytes": peak.peak_bytes - peak.start_bytes}


ALLOCATORS = {
    "glibc default": {},
    "glibc keeps freed memory": {"MALLOC_MMAP_THRESHOLD_": str(2 << 30), "MALLOC_TRIM_THRESHOLD_": str(2 << 30)},
    "returns freed memory at once": {"MALLOC_MMAP_THRESHOLD_": "65536"},  # every tensor mmapped
}


def _spawn(config: dict, mode: str, allocator: str = "glibc default"):
    env = dict(os.environ)
    env.update(ALLOCATORS[allocator])
    out = subprocess.run([sys.executable, __file__, mode, json.dumps(config)], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {config.get('methods', '')} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _calibrated(profile, resolved, args):
    """``profile`` fitted to the executor's telemetry of a keep-all run (and a paging one) of this model."""
    from device_agent.executor import EventStream, ScheduleExecutor
    from host.calibrate import calibrate_profile
    from host.costs import price_graph
    from host.graph.partition import partition_from_traced
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    priced = price_graph(resolved.graph, profile)
    peak = no_remat_peak_bytes(priced)
    events = EventStream()
    bundle = resolved.bundle
    for options in (SolveOptions(ram_budget_bytes=peak),
                    SolveOptions(ram_budget_bytes=0.6 * peak, remat=False, time_limit_s=30)):
        schedule = solve_schedule(priced, options).schedule
        with ScheduleExecutor(partition_from_traced(resolved.traced), schedule, flash_dir=args.flash_dir,
                              events=events) as executor:
            for _ in range(4):
                executor.train_step(bundle.inputs, bundle.labels)
    threads = torch.get_num_threads()  # the profile's compute_power_w is for this many busy threads
    return calibrate_profile(profile, resolved.graph, events.instructions(),
                             cpu_power_w_per_thread=profile.compute_power_w / threads)


def budget_rows(args) -> tuple[dict, list[dict]]:
    from device_agent.serde import write_schedule_file
    from host.costs import price_graph
    from host.costs.local_bench import profile_local_machine
    from host.graph.resolve import resolve_model
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    torch.set_num_threads(args.threads)
    measured_profile = profile_local_machine(args.flash_dir, quick=True)
    resolved = resolve_model(args.model, batch_size=args.batch_size)
    profile = _calibrated(measured_profile, resolved, args) if args.calibrate else measured_profile
    priced = price_graph(resolved.graph, profile)
    peak = no_remat_peak_bytes(priced)
    budget = 0.5 * peak
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=args.runtime_budget,
                                                 time_limit_s=args.time_limit, paging=args.paging))
    if result.schedule is None:
        raise SystemExit(f"no schedule at 50% of the no-remat peak: {result.message}")
    schedule_file = os.path.join(tempfile.mkdtemp(prefix="poet-bench-"), "schedule.json")
    write_schedule_file(result.schedule, schedule_file)
    common = {
        "model": args.model, "batch_size": args.batch_size, "threads": args.threads, "steps": args.steps,
        # the meter's assumptions (calibration folds paging's CPU time into the solver's memory_power_w only)
        "compute_power_w": measured_profile.compute_power_w,  # profiled with args.threads threads
        "memory_power_w": measured_profile.memory_power_w, "flash_dir": args.flash_dir, "schedule": schedule_file,
    }
    methods = [("plain (no recomputation)", {"method": "plain"}), ("POET", {"method": "poet"})]
    methods += [(f"checkpoint_sequential({k})", {"method": "sequential", "segments": k}) for k in (2, 3, 4, 6)]
    methods += [("per-block checkpoint", {"method": "per_block"})]
    timed = _spawn({**common, "methods": [extra for _, extra in methods]}, "--run-timed",
                   allocator="glibc keeps freed memory")
    rows = []
    for (label, extra), timing in zip(methods, timed, strict=True):
        peaked = _spawn({**common, "methods": [extra]}, "--run-peak", allocator="returns freed memory at once")
        rows.append({"method": label, **timing, "peak_rss_delta_bytes": peaked["peak_rss_delta_bytes"]})
    os.unlink(schedule_file)
    os.rmdir(os.path.dirname(schedule_file))
    counts = result.schedule.counts()
    info = {"no_remat_peak_bytes": peak, "budget_bytes": budget, "status": result.status, "gap": result.gap,
            "calibrated": args.calibrate,
            "predicted": result.schedule.prediction, "counts": counts, "profile": profile}
    return info, rows


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method in part 2 (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    parser.add_argument("--flash-dir", default=".")
    parser.add_argument("--overhead-batch-size", type=int, default=128, help="batch of part 1 (default 128)")
    parser.add_argument("--overhead-steps", type=int, default=20, help="timed steps of part 1 (default 20)")
    parser.add_argument("--runtime-budget", type=float, default=2.0, help="runtime factor of the solve (default 2)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="solver time limit, seconds")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="solve part 2 on the quick local profile as measured, without fitting it to the "
                             "executor's telemetry first")
    parser.add_argument("--no-paging", dest="paging", action="store_false", help="part 2: POET recomputes only")
    parser.add_argument("--part", type=int, choices=[1, 2], help="run only this part (default: both)")
    parser.add_argument("--run-timed", help=argparse.SUPPRESS)
    parser.add_argument("--run-peak", help=argparse.SUPPRESS)
    parser.add_argument("--run-overhead", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_timed:
        print(json.dumps(run_timed(json.loads(args.run_timed))))
        return
    if args.run_peak:
        print(json.dumps(run_peak(json.loads(args.run_peak))))
        return
    if args.run_overhead:
        config = json.loads(args.run_overhead)
        print(json.dumps(overhead_rows(config["model"], config["batch_size"], config["steps"], config["threads"])))
        return
    torch.set_num_threads(args.threads)
    print(f"# Executor benchmark: {args.model}, {args.threads} torch thread(s), torch {torch.__version__}")
    if args.part in (None, 1):
        print(f"\n## 1. No memory pressure: keep-all schedule against plain PyTorch, batch {args.overhead_batch_size} "
              f"(one process per allocator setting, the two interleaved; medians of {args.overhead_steps} steps; "
              "ratio: median of the per-step ratios, with its quartiles; floor: the same nodes run one by one with "
              "one autograd call each, without the executor's store, hooks and telemetry)\n")
        print(f"{'allocator':<26} {'granularity':<12} {'nodes':>5} {'instr':>6} {'plain s/step':>13} "
              f"{'POET s/step':>12} {'ratio':>6} {'quartiles':>12} {'floor ratio':>12}")
        for allocator in ("glibc default", "glibc keeps freed memory"):
            config = {"model": args.model, "batch_size": args.overhead_batch_size, "steps": args.overhead_steps,
                      "threads": args.threads}
            for row in _spawn(config, mode="--run-overhead", allocator=allocator):
                print(f"{allocator:<26} {row['granularity']:<12} {row['nodes']:>5} {row['instructions']:>6} "
                      f"{row['plain_s']:>13.4f} {row['schedule_s']:>12.4f} {row['ratio']:>6.3f} "
                      f"{row['ratio_q1']:>5.3f}-{row['ratio_q3']:.3f} {row['floor_ratio']:>12.3f}")

    if args.part == 1:
        return
    info, rows = budget_rows(args)
    predicted = info["predicted"]
    print(f"\n## 2. Batch {args.batch_size}, at 50% of the no-remat peak ({info['budget_bytes'] / 1e6:.1f} MB of "
          f"{info['no_remat_peak_bytes'] / 1e6:.1f} MB), layer granularity, profile of this machine (quick"
          f"{', calibrated on executor telemetry of this model' if info['calibrated'] else ''})\n")
    gap = f", gap {100 * info['gap']:.1f}%" if info["gap"] else ""
    print(f"POET schedule ({info['status']}{gap}, runtime factor {args.runtime_budget}): "
          f"{info['counts']['recomputes']} recomputes, "
          f"{info['counts']['page_outs']} page-outs, {info['counts']['page_ins']} page-ins; predicted "
          f"{predicted.runtime_s + predicted.paging_s:.4f} s, {predicted.energy_j:.3f} J, "
          f"peak {predicted.peak_ram_bytes / 1e6:.1f} MB")
    print("energy: modelled:cpu-time×power (not measured); peak RSS: high-water above the step-start RSS, "
          "allocator returning freed memory at once\n")
    print(f"{'method':<28} {'s/step':>8} {'J/step':>8} {'peak RSS MB':>12} {'tracked MB':>11}")
    for row in rows:
        tracked = f"{row['peak_tracked_bytes'] / 1e6:>11.1f}" if row.get("peak_tracked_bytes") else f"{'-':>11}"
        print(f"{row['method']:<28} {row['step_s']:>8.4f} {row['energy_j']:>8.3f} "
              f"{row['peak_rss_delta_bytes'] / 1e6:>12.1f} {tracked}")
    poet = next(r for r in rows if r["method"] == "POET")
    rivals = [r for r in rows if "checkpoint" in r["method"] and r["peak_rss_delta_bytes"] >= poet["peak_rss_delta_bytes"]]
    if rivals:
        best = min(rivals, key=lambda r: r["energy_j"])
        print(f"\nat equal or higher memory, the best checkpointing is {best['method']}: "
              f"{best['energy_j'] / poet['energy_j']:.2f}x POET's energy, {best['step_s'] / poet['step_s']:.2f}x its time")
    else:
        print("\nno checkpointing configuration used as much memory as POET's schedule")
    checkpoints = [r for r in rows if "checkpoint" in r["method"]]
    nearest = min(checkpoints, key=lambda r: abs(r["peak_rss_delta_bytes"] - poet["peak_rss_delta_bytes"]))
    print(f"nearest in memory: {nearest['method']} at {nearest['peak_rss_delta_bytes'] / 1e6:.1f} MB "
          f"(POET {poet['peak_rss_delta_bytes'] / 1e6:.1f} MB): {nearest['energy_j'] / poet['energy_j']:.2f}x POET's "
          f"energy, {nearest['step_s'] / poet['step_s']:.2f}x its time")
    print("note: torch.utils.checkpoint recomputes BatchNorm forwards and so moves the running statistics twice "
          "per step; POET's recomputations do not.")


if __name__ == "__main__":
    main()
