"""`poet train` and `poet verify`: run a model's real training steps under a POET schedule on this machine.

``train`` solves (or loads) a schedule, trains with real paging to ``--flash-dir`` and reports predicted
against measured peak RAM, step time and energy (modelled here: CPU time x assumed power).
``verify`` trains the same model twice from the same seed and data, under the schedule and plainly,
and checks that the parameters agree, the counters equal the schedule and the budget holds.
:func:`run_demo` is the demo's end-to-end path on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import platform as platform_module
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from host.cli import EXIT_INFEASIBLE, EXIT_OK, EXIT_TIMEOUT, CliError, _add_model_args, _add_solver_args, solve_options

EXIT_VERIFY_FAILED = 5  # parameters differ, counters differ from the schedule, or the budget was exceeded

# verify's tolerance on max |a - b| / max |b| per parameter tensor (ops that are not deterministic)
VERIFY_RELATIVE_TOLERANCE = 1e-6


# ---------------------------------------------------------------------------------------- preparation
@dataclass
class Prepared:
    """Everything a training run needs: the traced model, its priced graph, the schedule and the partition."""

    model: str
    resolved: Any  # host.graph.resolve.ResolvedModel
    profile: Any  # PlatformProfile
    priced: Any  # PricedGraph
    no_remat_peak_bytes: int
    ram_budget_bytes: float
    schedule: Any  # device_agent.schedule.Schedule | None (None for --plain)
    partition: Any  # device_agent.executor.Partition
    solve_status: str
    solve_message: str = ""


class SolveFailedError(Exception):
    """The solver returned no schedule (infeasible budget or time limit)."""

    def __init__(self, status: str, message: str):
        super().__init__(f"no schedule ({status}): {message}")
        self.exit_code = EXIT_INFEASIBLE if status == "infeasible" else EXIT_TIMEOUT


def _cli_error(message: str) -> CliError:
    return CliError(message)


def _input_shape(args) -> tuple[int, ...] | None:
    if not getattr(args, "input_shape", None):
        return None
    from host.graph.model_source import parse_input_shape

    return parse_input_shape(args.input_shape)


def _load_profile(args, log) -> Any:
    from host.costs import load_profile

    name = args.platform or "local"
    if name != "local":
        return load_profile(name)
    from host.costs.local_bench import profile_local_machine

    log("profiling this machine (quick; pass --platform NAME to skip)")
    return profile_local_machine(args.flash_dir or ".", name="local", quick=True, progress=lambda m: log(f"  {m}"))


def prepare(args, log=lambda message: None, *, need_schedule: bool = True) -> Prepared:
    """Trace the model, price it, and solve or load its schedule; every check happens before training."""
    from device_agent.serde import read_schedule_file
    from host.cli import parse_ram_budget
    from host.costs import price_graph
    from host.graph.partition import partition_from_traced
    from host.graph.resolve import resolve_model
    from host.solver.solve import no_remat_peak_bytes, solve_schedule
    from host.solver.validator import ScheduleValidationError, validate_schedule

    if args.steps < 1:
        raise _cli_error(f"--steps must be at least 1, got {args.steps}")
    if getattr(args, "threads", None):
        import torch

        if args.threads < 1:
            raise _cli_error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if getattr(args, "flash_dir", None):
        from device_agent.executor import FlashDirError, check_flash_dir

        try:
            check_flash_dir(args.flash_dir)
        except FlashDirError as error:
            raise _cli_error(str(error)) from None
    if _allocator_mode(args) == "keep":
        from device_agent.executor.allocator import keep_freed_memory

        keep_freed_memory()
    profile = _load_profile(args, log)
    resolved = resolve_model(
        args.model, input_shape=_input_shape(args), batch_size=args.batch_size, granularity=args.granularity,
        seed=args.seed,
    )
    if resolved.traced is None:
        raise _cli_error(
            f"{args.model!r} is a reference graph without weights; train and verify need a real PyTorch model "
            "(a zoo name or module:callable)"
        )
    priced = price_graph(resolved.graph, profile)
    peak = no_remat_peak_bytes(priced)
    budget = parse_ram_budget(args.ram_budget, peak)
    schedule, status, message = None, "", ""
    if need_schedule:
        if getattr(args, "schedule", None):
            schedule = read_schedule_file(args.schedule)
            try:
                validate_schedule(schedule, priced, ram_budget_bytes=budget)
            except ScheduleValidationError as error:
                raise _cli_error(f"schedule {args.schedule} cannot run on {args.model!r}: {error}") from None
            status = schedule.solve.status or "loaded"
        else:
            log(f"solving the schedule for {budget:,.0f} bytes ({100 * budget / peak:.0f}% of the no-remat peak)")
            result = solve_schedule(
                priced,
                solve_options(args, budget),
            )
            if result.schedule is None:
                raise SolveFailedError(result.status, result.message)
            schedule, status, message = result.schedule, result.status, result.message
    return Prepared(
        model=args.model,
        resolved=resolved,
        profile=profile,
        priced=priced,
        no_remat_peak_bytes=peak,
        ram_budget_bytes=budget,
        schedule=schedule,
        partition=partition_from_traced(resolved.traced),
        solve_status=status,
        solve_message=message,
    )


def _allocator_mode(args) -> str:
    mode = getattr(args, "allocator", None)
    if mode is None:  # a training loop reallocates the same sizes every step: keep them, as torch's GPU caches do
        return "return" if getattr(args, "cgroup", None) else "keep"
    return mode


def make_optimizer(name: str, parameters, lr: float | None = None):
    """SGD (momentum 0.9, lr 0.01) or AdamW (lr 1e-3) over ``parameters``."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(parameters, lr=0.01 if lr is None else lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-3 if lr is None else lr)
    raise _cli_error(f"unknown optimizer {name!r}; use sgd or adamw")


def local_energy_meter(profile=None):
    """The modelled meter for this machine: the local profile's powers, or local_bench's assumptions."""
    import torch

    from device_agent.meters.modelled import ModelledEnergyMeter
    from host.costs import local_bench

    threads = torch.get_num_threads()
    if profile is not None and profile.energy_source == local_bench.ENERGY_SOURCE:
        return ModelledEnergyMeter(profile.compute_power_w, profile.memory_power_w, threads)
    machine = platform_module.machine().lower()
    key = machine if machine in local_bench._CPU_POWER_PER_THREAD_W else local_bench._FALLBACK_MACHINE
    return ModelledEnergyMeter(
        local_bench._CPU_POWER_PER_THREAD_W[key] * threads, local_bench._STORAGE_POWER_W[key], threads
    )


class _Progress:
    """A progress bar over steps on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.tty = sys.stderr.isatty()

    def update(self, done: int, loss: float, step_s: float) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / self.total)
        line = f"  {self.label} {'#' * filled}{'.' * (width - filled)} {done}/{self.total}  loss {loss:.4f}  {step_s:.3f} s/step"
        if self.tty:
            sys.stderr.write("\r" + line)
            if done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------- training runs
@dataclass
class RunResult:
    losses: list[float]
    step_s: list[float]
    energy_j: list[float]
    energy_source: str
    peak_tracked_bytes: int = 0
    executed: list[dict] | None = None  # per-step counts (scheduled runs)
    rss_peak_bytes: int = 0
    program_runs: int = 0
    backward_runs: int = 0

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)


def train_scheduled(
    prepared: Prepared,
    bundle,
    *,
    steps: int,
    optimizer_name: str,
    lr: float | None,
    seed: int,
    flash_dir: str,
    events=None,
    progress: _Progress | None = None,
    return_freed_memory: bool = False,
) -> RunResult:
    """``steps`` steps of ``bundle``'s model under the prepared schedule (bundle.module must be the traced one)."""
    import torch

    from device_agent.executor import ExecutorError, PageStoreError, ScheduleExecutor

    optimizer = make_optimizer(optimizer_name, bundle.module.parameters(), lr)
    meter = local_energy_meter(prepared.profile)
    torch.manual_seed(seed)
    result = RunResult([], [], [], meter.source, executed=[])
    try:
        with ScheduleExecutor(prepared.partition, prepared.schedule, flash_dir=flash_dir, events=events,
                              energy_meter=meter, return_freed_memory=return_freed_memory) as executor:
            for step in range(steps):
                outcome = executor.train_step(bundle.inputs, bundle.labels, optimizer)
                summary = outcome.summary
                result.losses.append(outcome.loss)
                result.step_s.append(outcome.duration_s)
                result.energy_j.append(summary.energy_j)
                result.peak_tracked_bytes = max(result.peak_tracked_bytes, outcome.peak_tracked_bytes)
                result.executed.append(outcome.counters.plan_counts())
                result.rss_peak_bytes = max(result.rss_peak_bytes, summary.rss_peak_bytes)
                result.program_runs += summary.program_runs
                result.backward_runs += summary.backward_runs
                if progress is not None:
                    progress.update(step + 1, outcome.loss, outcome.duration_s)
    except (ExecutorError, PageStoreError) as error:
        raise _cli_error(str(error)) from error
    return result


def train_plain(bundle, *, steps: int, optimizer_name: str, lr: float | None, seed: int, profile=None,
                progress: _Progress | None = None) -> RunResult:
    """Ordinary eager PyTorch training of ``bundle`` (the comparison and the reference)."""
    import torch

    from device_agent.executor import plain_train_step
    from device_agent.meters.memory import RssSampler

    optimizer = make_optimizer(optimizer_name, bundle.module.parameters(), lr)
    meter = local_energy_meter(profile)
    bundle.module.train()
    torch.manual_seed(seed)
    result = RunResult([], [], [], meter.source)
    rss = RssSampler()
    for step in range(steps):
        start = meter.read()
        loss = plain_train_step(bundle.module, bundle.loss_fn, bundle.inputs, bundle.labels, optimizer)
        end = meter.read()
        energy_j, _ = meter.energy_j(start, end)
        result.losses.append(loss)
        result.step_s.append(end.wall_s - start.wall_s)
        result.energy_j.append(energy_j)
        result.rss_peak_bytes = max(result.rss_peak_bytes, rss.rss_bytes())
        if progress is not None:
            progress.update(step + 1, loss, end.wall_s - start.wall_s)
    return result


def parameter_differences(module_a, module_b) -> dict[str, Any]:
    """Max absolute and relative (per tensor: max |a-b| / max |b|) differences of parameters and buffers."""
    import torch

    max_abs = max_rel = 0.0
    bitwise = True
    worst = ""
    pairs = list(zip(module_a.named_parameters(), module_b.named_parameters(), strict=True))
    pairs += list(zip(module_a.named_buffers(), module_b.named_buffers(), strict=True))
    for (name, a), (_, b) in pairs:
        if torch.equal(a, b):
            continue
        bitwise = False
        if not a.is_floating_point():
            diff = float((a.double() - b.double()).abs().max())
        else:
            diff = float((a.detach().double() - b.detach().double()).abs().max())
        scale = float(b.detach().double().abs().max())
        rel = diff / scale if scale > 0 else math.inf
        max_abs = max(max_abs, diff)
        if rel > max_rel:
            max_rel, worst = rel, name
    return {"max_abs_param_diff": max_abs, "max_rel_param_diff": max_rel, "bitwise_equal": bitwise, "worst": worst}


# ---------------------------------------------------------------------------------------- commands
def _log_to_stderr(enabled: bool):
    def log(message: str) -> None:
        if enabled:
            print(message, file=sys.stderr, flush=True)

    return log


def _executor_errors() -> tuple[type[BaseException], ...]:
    from device_agent.executor import ExecutorError, PageStoreError
    from device_agent.serde import ScheduleFormatError
    from host.solver.validator import ScheduleValidationError

    return ExecutorError, PageStoreError, ScheduleValidationError, ScheduleFormatError


def _fmt_bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:,.0f} B"


def _run_command(args, body) -> int:
    """Domain errors become CliError (host.cli prints them); a failed solve prints and returns its exit code."""
    try:
        return body(args)
    except SolveFailedError as error:
        print(f"poet {args.command}: {error}", file=sys.stderr)
        return error.exit_code
    except _executor_errors() as error:
        raise _cli_error(str(error)) from error


def cmd_train(args) -> int:
    return _run_command(args, _train)


def _train(args) -> int:
    log = _log_to_stderr(not args.json)
    prepared = prepare(args, log, need_schedule=not args.plain)
    bundle = prepared.resolved.bundle
    progress = _Progress(args.steps, "plain" if args.plain else "train", enabled=not args.json)
    if args.cgroup:
        from device_agent.executor.allocator import release_free_memory
        from device_agent.meters.memory import join_cgroup

        release_free_memory()  # tracing's freed pages must not be reused outside the cgroup
        try:
            join_cgroup(args.cgroup)
        except OSError as error:
            raise _cli_error(f"cannot join cgroup {args.cgroup!r}: {error}") from None
        log(f"joined cgroup {args.cgroup}: its memory limit applies to training from here on")
    writer = None
    events = None
    if args.events and not args.plain:
        from device_agent.executor import EventStream, JsonLinesWriter

        writer = JsonLinesWriter(args.events)
        events = EventStream(keep=False)
        events.subscribe(writer)
    try:
        if args.plain:
            run = train_plain(bundle, steps=args.steps, optimizer_name=args.optimizer, lr=args.lr, seed=args.seed,
                              profile=prepared.profile, progress=progress)
        else:
            run = train_scheduled(prepared, bundle, steps=args.steps, optimizer_name=args.optimizer, lr=args.lr,
                                  seed=args.seed, flash_dir=args.flash_dir or ".", events=events, progress=progress,
                                  return_freed_memory=_allocator_mode(args) == "return")
    finally:
        if writer is not None:
            writer.close()
    summary = _train_summary(args, prepared, run)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_train(summary)
    return EXIT_OK


def _train_summary(args, prepared: Prepared, run: RunResult) -> dict[str, Any]:
    schedule = prepared.schedule
    prediction = schedule.prediction if schedule is not None else None
    # the first step pays one-off costs (allocator warm-up): measured figures are medians over steps
    summary: dict[str, Any] = {
        "model": args.model,
        "mode": "plain" if args.plain else "schedule",
        "platform": prepared.profile.name,
        "predicted_energy_source": prepared.profile.energy_source,
        "measured_energy_source": run.energy_source,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "losses": run.losses,
        "ram_budget_bytes": prepared.ram_budget_bytes,
        "no_remat_peak_bytes": prepared.no_remat_peak_bytes,
        "fixed_bytes": prepared.resolved.graph.fixed_bytes,
        "measured": {
            "peak_tracked_bytes": run.peak_tracked_bytes if not args.plain else None,
            "step_s": run.median_step_s,
            "energy_j": statistics.median(run.energy_j),
            "rss_peak_bytes": run.rss_peak_bytes,
        },
        "events_file": args.events if not args.plain else None,
    }
    if prediction is not None:
        summary["solve_status"] = prepared.solve_status
        summary["predicted"] = {
            "peak_ram_bytes": prediction.peak_ram_bytes,
            "step_s": prediction.runtime_s + (0.0 if schedule.paging_in_runtime else prediction.paging_s),
            "energy_j": prediction.energy_j,
        }
        summary["planned"] = schedule.counts()
        summary["executed"] = run.executed[-1] if run.executed else None
    return summary


def _print_train(summary: dict[str, Any]) -> None:
    measured = summary["measured"]
    print(f"model     {summary['model']}  ({summary['mode']}, {summary['steps']} steps, {summary['optimizer']})")
    print(f"loss      {summary['losses'][0]:.6g} -> {summary['losses'][-1]:.6g}")
    if summary["mode"] == "plain":
        print(f"time      {measured['step_s']:.4f} s/step (median)")
        print(f"energy    {measured['energy_j']:.4g} J/step ({summary['measured_energy_source']} on this machine)")
        print(f"RSS       peak {_fmt_bytes(measured['rss_peak_bytes'])}; no-remat peak of controlled tensors "
              f"{_fmt_bytes(summary['no_remat_peak_bytes'])}")
        return
    predicted = summary["predicted"]
    local = summary["platform"] == "local"
    where = "this machine" if local else f"platform {summary['platform']} (the measurement is on this machine)"
    print(f"predicted for {where}; measured here, medians over steps")
    print(f"{'':<16}{'predicted':>16}{'measured':>16}")
    print(f"{'peak RAM':<16}{_fmt_bytes(predicted['peak_ram_bytes']):>16}{_fmt_bytes(measured['peak_tracked_bytes']):>16}"
          f"   budget {_fmt_bytes(summary['ram_budget_bytes'])}, fixed {_fmt_bytes(summary['fixed_bytes'])}")
    print(f"{'step time':<16}{predicted['step_s']:>14.4g} s{measured['step_s']:>14.4g} s")
    print(f"{'energy':<16}{predicted['energy_j']:>14.4g} J{measured['energy_j']:>14.4g} J"
          f"   predicted: {summary['predicted_energy_source']}; measured: {summary['measured_energy_source']}")
    planned, executed = summary["planned"], summary["executed"]
    print(f"{'instructions':<16}{'planned':>16}{'executed':>16}")
    for key in ("computes", "recomputes", "page_outs", "page_ins"):
        print(f"  {key:<14}{planned[key]:>16}{executed[key]:>16}")
    print(f"RSS       peak {_fmt_bytes(measured['rss_peak_bytes'])}")
    if summary["events_file"]:
        print(f"events    {summary['events_file']}")


def cmd_verify(args) -> int:
    return _run_command(args, _verify)


def verify_run(args, log=lambda message: None) -> dict[str, Any]:
    """Train under the schedule and plainly from the same seed and data; compare parameters and counters."""
    from host.graph.resolve import load_bundle

    prepared = prepare(args, log)
    scheduled_bundle = prepared.resolved.bundle
    plain_bundle = load_bundle(args.model, input_shape=_input_shape(args), batch_size=args.batch_size, seed=args.seed)
    scheduled = train_scheduled(prepared, scheduled_bundle, steps=args.steps, optimizer_name=args.optimizer,
                                lr=args.lr, seed=args.seed, flash_dir=args.flash_dir or ".")
    plain = train_plain(plain_bundle, steps=args.steps, optimizer_name=args.optimizer, lr=args.lr, seed=args.seed,
                        profile=prepared.profile)
    diffs = parameter_differences(scheduled_bundle.module, plain_bundle.module)
    planned = prepared.schedule.counts()
    planned_counts = {k: planned[k] for k in ("computes", "recomputes", "page_ins", "page_outs")}
    counters_match = all(step == planned_counts for step in scheduled.executed)
    within_budget = scheduled.peak_tracked_bytes <= prepared.ram_budget_bytes * (1 + 1e-9)
    ok = diffs["max_rel_param_diff"] <= VERIFY_RELATIVE_TOLERANCE and counters_match and within_budget
    return {
        "model": args.model,
        "platform": prepared.profile.name,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "max_abs_param_diff": diffs["max_abs_param_diff"],
        "max_rel_param_diff": diffs["max_rel_param_diff"],
        "bitwise_equal": diffs["bitwise_equal"],
        "worst_tensor": diffs["worst"] or None,
        "tolerance_rel": VERIFY_RELATIVE_TOLERANCE,
        "peak_tracked_bytes": scheduled.peak_tracked_bytes,
        "predicted_peak_bytes": prepared.schedule.prediction.peak_ram_bytes,
        "ram_budget_bytes": prepared.ram_budget_bytes,
        "no_remat_peak_bytes": prepared.no_remat_peak_bytes,
        "planned": planned_counts,
        "executed": scheduled.executed[-1],
        "counters_match": counters_match,
        "within_budget": within_budget,
        "step_time_s": scheduled.median_step_s,
        "plain_step_time_s": plain.median_step_s,
        "step_time_ratio": scheduled.median_step_s / plain.median_step_s if plain.median_step_s > 0 else None,
        "losses": scheduled.losses,
        "plain_losses": plain.losses,
        "solve_status": prepared.solve_status,
        "ok": ok,
    }


def _verify(args) -> int:
    log = _log_to_stderr(not args.json)
    report = verify_run(args, log)
    if args.json:
        print(json.dumps(report))
    else:
        verdict = "OK" if report["ok"] else "FAILED"
        print(f"verify    {verdict}: {report['model']}, {report['steps']} steps of {report['optimizer']}")
        exact = " (bitwise equal)" if report["bitwise_equal"] else ""
        print(f"params    max abs diff {report['max_abs_param_diff']:.3g}, max rel diff "
              f"{report['max_rel_param_diff']:.3g} (tolerance {report['tolerance_rel']:g}){exact}")
        print(f"RAM       tracked peak {report['peak_tracked_bytes']:,} of {report['ram_budget_bytes']:,.0f} bytes "
              f"(predicted {report['predicted_peak_bytes']:,.0f})")
        print(f"counters  planned {report['planned']}\n          executed {report['executed']}")
        print(f"time      {report['step_time_ratio']:.3f}x plain PyTorch per step")
    return EXIT_OK if report["ok"] else EXIT_VERIFY_FAILED


# ---------------------------------------------------------------------------------------- demo
def run_demo(
    model: str = "resnet18_cifar",
    *,
    flash_dir: str = ".",
    steps: int = 3,
    batch_size: int | None = None,
    budget_share: float = 0.5,
    time_limit_s: float = 60.0,
    out=print,
) -> dict[str, Any]:
    """Profile this machine, solve at ``budget_share`` of the no-remat peak, train with real paging, compare."""
    args = argparse.Namespace(
        model=model, platform="local", input_shape=None, batch_size=batch_size, granularity="layer",
        ram_budget=f"{100 * budget_share:g}%", runtime_budget=2.0, solver="highs", time_limit=time_limit_s,
        no_paging=False, no_remat=False, schedule=None, flash_dir=flash_dir, steps=steps, seed=0,
        optimizer="sgd", lr=None, plain=False, json=False, events=None, threads=None, cgroup=None, allocator=None,
    )
    prepared = prepare(args, lambda message: out(message))
    run = train_scheduled(prepared, prepared.resolved.bundle, steps=steps, optimizer_name="sgd", lr=None, seed=0,
                          flash_dir=flash_dir, progress=_Progress(steps, "train", enabled=True))
    summary = _train_summary(args, prepared, run)
    _print_train(summary)
    return summary


# ---------------------------------------------------------------------------------------- parser
def add_train_commands(subparsers) -> None:
    """Register `train`, `verify` and `demo` on the `poet` parser's subparsers."""

    def common(parser: argparse.ArgumentParser) -> None:
        _add_model_args(parser, platform_required=False)
        parser.add_argument("--ram-budget", required=True, help="bytes (3000000), with a unit (3MB), or a share (50%%)")
        _add_solver_args(parser)
        parser.add_argument("--no-paging", action="store_true", help="solve with recomputation only")
        parser.add_argument("--no-remat", action="store_true", help="solve with paging only")
        parser.add_argument("--schedule", metavar="FILE", help="run this schedule (from `poet solve --out`) instead of solving")
        parser.add_argument("--flash-dir", help="directory on the storage to page to (default: current directory)")
        parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
        parser.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.01, adamw 1e-3)")
        parser.add_argument("--seed", type=int, default=0, help="seed of weights, batch and RNG (default 0)")
        parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
        parser.add_argument("--allocator", choices=["default", "keep", "return"], default=None,
                            help="freed memory: keep it for reuse (the default: fastest, RSS stays at its high-water "
                                 "mark); glibc's default heuristics; or return it to the OS after every free so RSS "
                                 "follows the schedule (the default with --cgroup)")
        parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    train = subparsers.add_parser("train", help="train a model locally under its POET schedule, with real paging")
    common(train)
    train.add_argument("--steps", type=int, default=5)
    train.add_argument("--plain", action="store_true", help="ordinary PyTorch training of the same model, for comparison")
    train.add_argument("--events", metavar="FILE", help="write per-instruction telemetry as JSON lines")
    train.add_argument("--cgroup", metavar="DIR",
                       help="join this cgroup after tracing and solving, so its memory limit applies to training only")
    train.set_defaults(func=cmd_train, platform=None)

    verify = subparsers.add_parser("verify", help="check scheduled training against plain PyTorch (parameters, counters, budget)")
    common(verify)
    verify.add_argument("--steps", type=int, default=3)
    verify.set_defaults(func=cmd_verify, platform=None)

    demo = subparsers.add_parser("demo", help="profile this machine, solve at 50%% of the no-remat peak, train with paging")
    demo.add_argument("--model", default="resnet18_cifar")
    demo.add_argument("--flash-dir", default=".")
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--batch-size", type=int, default=None)
    demo.add_argument("--time-limit", type=float, default=60.0)
    demo.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    run_demo(args.model, flash_dir=args.flash_dir, steps=args.steps, batch_size=args.batch_size,
             time_limit_s=args.time_limit)
    return EXIT_OK
