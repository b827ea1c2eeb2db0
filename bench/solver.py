"""Solver benchmark: poet-edge's formulation against the paper's, side by side, in one run.

Both formulations are solved by the same backend (HiGHS by default) to the same relative gap
(0.1%), on the paper code's own graphs and platform constants. The paper formulation gets a time
limit; when it hits it, the speed-up shown is a lower bound (marked ">=").

    python bench/solver.py                      # the three binding cases + the README example
    python bench/solver.py --paper-time-limit 1200 --cases resnet18_cifar:a72
    python bench/solver.py --traced             # traced models users bring, poet-edge alone, timed end to end
    python bench/solver.py --hard               # issue 18's table: hard budgets, the best baseline beside POET
    python bench/solver.py --hard resnet18_cifar@40%:jetsontx2 --time-limit 60 --json
    python bench/solver.py --hard --local-profile local.json   # keep this run's local profile to re-run on it

Traced cases time the whole path a user waits for (trace, pricing, model build, warm start and
solve) against the issue's targets: 60 s and a 1% gap for resnet50 and bert, 120 s and 2% for a
graph of about 1,000 nodes (a 30-layer BERT). The paper's formulation is not run on them: its
dense T x T blocks do not fit these sizes in the time.

Hard cases (``--hard``) are traced models at budgets where paging or recomputation is a real share of
the energy. Each row gives the solve's status, its proven gap and its wall-clock time (the limit covers
the whole solve, tracing excluded), the best baseline's predicted energy (the baselines a user would pick
instead, priced on the same profile: checkpoint_sequential(k), per-block checkpointing, paging, the
greedy) and POET's. ``local`` is a profile measured on this machine (quick).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from host.costs import load_profile, price_graph
from host.graph.poet2022 import build_poet2022_graph
from host.graph.trace import trace_model
from host.graph.zoo import BertMaskedLM, ModelBundle, get_model_spec
from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

# The hard cases' MobileNetV2 comes from the test models (tests.models.huggingface): importable from any directory.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# (model, platform, RAM budget: bytes if > 1 else a share of the no-remat peak, runtime factor)
CASES = {
    "readme": ("resnet18_cifar", "a72", 3_000_000, 7.6),
    "resnet18_cifar:a72": ("resnet18_cifar", "a72", 0.5, 1.2),
    "resnet18:m4": ("resnet18", "m4", 0.5, 1.2),
    "bert:a72": ("bert", "a72", 0.5, 1.2),
}


# name -> (layers of a BERT-base encoder, or None for the zoo model; time target s; gap target)
TRACED_CASES = {
    "resnet50": (None, 60.0, 0.01),
    "bert": (None, 60.0, 0.01),
    "bert30": (30, 120.0, 0.02),
}


def _traced_bundle(name: str) -> ModelBundle:
    layers = TRACED_CASES[name][0]
    if layers is None:
        return get_model_spec(name).bundle()
    zoo_bert = get_model_spec("bert").bundle()
    return ModelBundle(name=name, module=BertMaskedLM(num_layers=layers), inputs=zoo_bert.inputs,
                       labels=zoo_bert.labels, loss_fn=zoo_bert.loss_fn)


# issue 18's hard cases: (model, budget as a share of the no-remat peak, platform, time limit s)
HARD_MODELS = {"resnet50": "resnet50", "hf_bert": "hf_bert", "mobilenet_v2": "tests.models.huggingface:mobilenet_v2"}
HARD_CASES = [("resnet18_cifar", 0.4, "jetsontx2", 60.0), ("resnet18_cifar", 0.5, "local", 60.0)] + [
    (model, share, platform, 120.0) for model in HARD_MODELS for share in (0.3, 0.5) for platform in ("m4", "jetsontx2", "a72")
]


def hard_case_name(model: str, share: float, platform: str) -> str:
    return f"{model}@{share:.0%}:{platform}"


def hard_case_profile(platform: str, local_profile_path: str | None):
    """The profile a hard case is priced on: a shipped one by name; ``local`` measured on this machine, or, given
    ``local_profile_path``, read from that file if it exists, else measured and saved there (so that a table can be
    re-run on the same measurement: each quick measurement differs)."""
    from host.costs.profile import ProfileError, save_profile
    from host.run.sources import LOCAL_PLATFORM, load_platform

    if platform != LOCAL_PLATFORM or local_profile_path is None:
        return load_platform(platform)
    if os.path.exists(local_profile_path):
        print(f"  reading the local profile from {local_profile_path}", file=sys.stderr, flush=True)
        try:
            return load_platform(local_profile_path)
        except ProfileError as error:
            raise SystemExit(f"--local-profile: {error}; fix the file, or remove it to measure the profile again") from None
    profile = load_platform(LOCAL_PLATFORM)
    try:
        save_profile(profile, local_profile_path)
    except (ProfileError, OSError) as error:
        raise SystemExit(f"--local-profile: {error}") from None
    print(f"  measured the local profile; saved it to {local_profile_path}", file=sys.stderr, flush=True)
    return profile


def run_hard_cases(names: list[str], solver: str, time_limit_s: float | None,
                   local_profile_path: str | None = None) -> list[dict]:
    """Trace each model once, price it per platform, solve each case with its limit (or ``time_limit_s``)."""
    from host.run.sources import ModelSource

    chosen = [case for case in HARD_CASES if not names or hard_case_name(*case[:3]) in names]
    unknown = set(names) - {hard_case_name(*case[:3]) for case in HARD_CASES}
    if unknown:
        raise SystemExit(f"unknown hard case(s) {', '.join(sorted(unknown))}; choose from: "
                         + ", ".join(hard_case_name(*case[:3]) for case in HARD_CASES))
    graphs, profiles, rows = {}, {}, []
    for model, share, platform, limit_s in chosen:
        if model not in graphs:
            graphs[model] = ModelSource(HARD_MODELS.get(model, model)).resolve().graph
        if platform not in profiles:
            profiles[platform] = hard_case_profile(platform, local_profile_path)
        priced = price_graph(graphs[model], profiles[platform])
        peak = no_remat_peak_bytes(priced)
        limit_s = time_limit_s or limit_s
        options = SolveOptions(ram_budget_bytes=share * peak, runtime_factor=1.2, solver=solver, time_limit_s=limit_s,
                               mip_gap=1e-3)
        started = time.perf_counter()
        result = solve_schedule(priced, options)
        wall_s = time.perf_counter() - started
        fitting = sorted((b for b in result.baselines if b.feasible), key=lambda b: b.energy_j)
        best = fitting[0] if fitting else None
        row = {"case": hard_case_name(model, share, platform), "model": model, "platform": platform,
               "nodes": graphs[model].size, "share_of_peak": share, "ram_budget_bytes": share * peak,
               # Every node computed once on this profile: a function of the profile alone, unlike the baselines,
               # whose search stops at deadlines.
               "compute_once_energy_j": float(priced.compute_j.sum()),
               "time_limit_s": limit_s, "status": result.status, "gap": result.gap, "solve_s": wall_s,
               "within_limit": wall_s <= limit_s * 1.1,
               "best_baseline": best.name if best else None,
               "best_baseline_energy_j": best.energy_j if best else None,
               "poet_energy_j": result.objective_j, "answer": result.schedule.solve.formulation if result.schedule else None,
               "baselines_priced": len(result.baselines), "columns": result.model_columns, "rows": result.model_rows,
               "message": result.message}
        print(f"  {row['case']:<34} {result.status:<9} {wall_s:7.1f} s", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def print_hard_table(rows: list[dict]) -> None:
    print(f"{'case':<34} {'nodes':>5} {'budget':>6} {'status':<9} {'gap':>7} {'solve s':>7} {'limit':>5} "
          f"{'best baseline J':>15} {'POET J':>11} {'best baseline':<26} {'answer':<26}")
    for row in rows:
        print(f"{row['case']:<34} {row['nodes']:>5} {row['share_of_peak']:>6.0%} {row['status']:<9} "
              f"{_fmt(row['gap'], '.2%'):>7} {row['solve_s']:>7.1f} {row['time_limit_s']:>5.0f} "
              f"{_fmt(row['best_baseline_energy_j'], '.6g'):>15} {_fmt(row['poet_energy_j'], '.6g'):>11} "
              f"{row['best_baseline'] or '-':<26} {row['answer'] or '-':<26}")


def run_traced_case(name: str, platform: str, share: float, solver: str) -> dict:
    """Trace, price and solve one traced model at ``share`` of its no-remat peak, timed end to end."""
    _layers, target_s, target_gap = TRACED_CASES[name]
    started = time.perf_counter()
    graph = trace_model(_traced_bundle(name)).graph
    trace_s = time.perf_counter() - started
    priced = price_graph(graph, load_profile(platform))
    peak = no_remat_peak_bytes(priced)
    options = SolveOptions(ram_budget_bytes=share * peak, runtime_factor=1.2, solver=solver, mip_gap=target_gap,
                           time_limit_s=max(1.0, target_s - (time.perf_counter() - started)))
    result = solve_schedule(priced, options)
    total_s = time.perf_counter() - started
    row = {"case": f"{name}:{platform}", "nodes": graph.size, "share_of_peak": share, "status": result.status,
           "trace_s": trace_s, "total_s": total_s, "target_s": target_s, "gap": result.gap, "target_gap": target_gap,
           "objective_j": result.objective_j, "columns": result.model_columns, "rows": result.model_rows}
    print(f"  {row['case']:<20} {result.status:<10} {total_s:8.1f} s", file=sys.stderr, flush=True)
    return row


def print_traced_table(rows: list[dict]) -> None:
    print(f"{'case':<16} {'nodes':>5} {'budget':>6} {'status':<9} {'trace s':>7} {'total s':>7} {'target':>6} "
          f"{'gap':>7} {'target':>6} {'objective J':>13} {'columns':>8} {'rows':>8} {'met':>4}")
    for row in rows:
        met = (row["total_s"] <= row["target_s"] * 1.02 and row["gap"] is not None and row["gap"] <= row["target_gap"])
        print(f"{row['case']:<16} {row['nodes']:>5} {row['share_of_peak']:>6.0%} {row['status']:<9} "
              f"{row['trace_s']:>7.1f} {row['total_s']:>7.1f} {row['target_s']:>6.0f} {_fmt(row['gap'], '.2%'):>7} "
              f"{row['target_gap']:>6.0%} {_fmt(row['objective_j'], '.4f'):>13} {row['columns']:>8} {row['rows']:>8} "
              f"{'yes' if met else 'no':>4}")


def run_case(key: str, solver: str, paper_time_limit_s: float, ours_time_limit_s: float, mip_gap: float) -> list[dict]:
    model, platform, budget, factor = CASES[key]
    priced = price_graph(build_poet2022_graph(model), load_profile(platform))
    peak = no_remat_peak_bytes(priced)
    ram_budget_bytes = budget if budget > 1 else budget * peak
    rows = []
    for formulation, limit in (("poet2022", paper_time_limit_s), ("poet-edge", ours_time_limit_s)):
        options = SolveOptions(
            ram_budget_bytes=ram_budget_bytes,
            runtime_factor=factor,
            solver=solver,
            time_limit_s=limit,
            mip_gap=mip_gap,
            formulation=formulation,
            # the paper code has neither a warm start nor the non-binding shortcut
            warm_start=formulation != "poet2022",
            shortcut_non_binding=formulation != "poet2022",
        )
        started = time.perf_counter()
        result = solve_schedule(priced, options)
        wall_s = time.perf_counter() - started
        rows.append(
            {
                "case": key,
                "model": f"poet2022:{model}",
                "platform": platform,
                "ram_budget_bytes": ram_budget_bytes,
                "share_of_peak": ram_budget_bytes / peak,
                "formulation": formulation,
                "status": result.status,
                "wall_s": wall_s,
                "objective_j": result.objective_j,
                "gap": result.gap,
                "columns": result.model_columns,
                "rows": result.model_rows,
                "time_limit_s": limit,
            }
        )
        print(f"  {key:<20} {formulation:<10} {result.status:<10} {wall_s:8.1f} s", file=sys.stderr, flush=True)
    return rows


def _fmt(value, spec: str, empty: str = "-") -> str:
    return format(value, spec) if value is not None else empty


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<20} {'budget':>10} {'formulation':<10} {'status':<10} {'solve s':>8} {'objective J':>14} "
          f"{'gap':>7} {'columns':>8} {'rows':>8}")
    for row in rows:
        print(
            f"{row['case']:<20} {row['share_of_peak']:>9.0%} {row['formulation']:<10} {row['status']:<10} "
            f"{row['wall_s']:>8.1f} {_fmt(row['objective_j'], '.6f'):>14} {_fmt(row['gap'], '.3%'):>7} "
            f"{row['columns']:>8} {row['rows']:>8}"
        )
    print()
    print(f"{'case':<20} {'speed-up':>10} {'objective: ours vs paper':>26}")
    for key in dict.fromkeys(row["case"] for row in rows):
        paper, ours = (next(r for r in rows if r["case"] == key and r["formulation"] == f) for f in ("poet2022", "poet-edge"))
        proven = paper["status"] == "optimal"
        speedup = paper["wall_s"] / max(ours["wall_s"], 1e-3)
        speed_text = f"{'' if proven else '>='}{speedup:.0f}x"
        if ours["objective_j"] is None:
            objective_text = "ours: no solution"
        elif paper["objective_j"] is None:
            objective_text = f"paper: none ({paper['status']})"
        else:
            delta = (ours["objective_j"] - paper["objective_j"]) / paper["objective_j"]
            objective_text = f"{delta:+.4%} ({'no worse' if delta <= 1e-9 else 'worse'})"
        print(f"{key:<20} {speed_text:>10} {objective_text:>26}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--solver", default="highs")
    parser.add_argument("--paper-time-limit", type=float, default=900.0, help="seconds (default 900)")
    parser.add_argument("--ours-time-limit", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--mip-gap", type=float, default=1e-3, help="relative gap counted as optimal (default 0.1%%)")
    parser.add_argument("--traced", nargs="*", choices=list(TRACED_CASES), default=None,
                        help="run the traced cases (all when given without names) instead of the paper's graphs")
    parser.add_argument("--platform", default="a72", help="platform for the traced cases (default a72)")
    parser.add_argument("--hard", nargs="*", metavar="CASE", default=None,
                        help="run issue 18's hard cases (all when given without names), e.g. "
                             "resnet18_cifar@40%%:jetsontx2")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per hard case (default: each case's target, 60 or 120)")
    parser.add_argument("--json", action="store_true", help="print the hard cases' rows as one JSON object")
    parser.add_argument("--local-profile", metavar="FILE", default=None,
                        help="the hard cases' local profile: read from FILE if it exists, else measured and saved "
                             "there (default: measured, not saved)")
    args = parser.parse_args(argv)
    if args.local_profile is not None and not os.path.exists(args.local_profile):
        directory = os.path.dirname(args.local_profile) or "."
        if not os.path.isdir(directory):
            parser.error(f"--local-profile: directory {directory!r} does not exist; create it first")
    if args.hard is not None:
        hard_rows = run_hard_cases(args.hard, args.solver, args.time_limit, args.local_profile)
        if args.json:
            print(json.dumps({"rows": hard_rows}, indent=2))
        else:
            print_hard_table(hard_rows)
        return 0
    if args.traced is not None:
        traced_rows = [run_traced_case(name, args.platform, 0.5, args.solver) for name in args.traced or TRACED_CASES]
        print_traced_table(traced_rows)
        return 0
    rows = []
    for key in args.cases:
        rows += run_case(key, args.solver, args.paper_time_limit, args.ours_time_limit, args.mip_gap)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
