"""POET inside Flower, on loopback: ``python -m poet_edge.flower.demo --rounds R --nodes N --dir DIR [--json]``.

1. N nodes, each with its own class-skewed shard of scikit-learn's digits (``poet-agent datasets make-demo``) and
   its own RAM budget in bytes, between the model's floor and its no-remat peak, so every node needs a schedule;
2. a SuperLink and N SuperNodes as processes (TLS as Flower configures it), the nodes running poet-edge's
   ClientApp (device_agent.flower.client, with secaggplus_mod);
3. ``flwr run`` of poet-edge's ServerApp (host.flower.app: FedAvg in PoetStrategy, SecAgg+ on) for R rounds,
   then the same app trained plainly (``poet-plain=true``) on the same deployment;
4. per round and node: the schedule's counts, the tracked peak, energy and loss, POET beside plain, and the
   largest relative difference between the two runs' final global parameters (per tensor: max |a-b| / max |b|).

Local training is bitwise plain PyTorch; SecAgg+ quantizes the weights before masking (at the ServerApp's range,
steps of 2.4e-7 or finer), the same way in both runs, so the final parameters agree to far better than 1e-5.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "node_budgets", "run_demo"]

MODEL = "mlp"
BATCH_SIZE = 32
PLATFORM = "a72"  # the nodes' cost profile (shipped): a Raspberry Pi 4's Cortex-A72
STEPS = 10
LR = 0.05
TARGET_REL_DIFF = 1e-5


def node_budgets(nodes: int, floor_bytes: int, peak_bytes: int) -> list[int]:
    """One budget per node, all different, strictly between the floor and the no-remat peak (a real schedule)."""
    shares = [0.25 + 0.5 * i / max(nodes - 1, 1) for i in range(nodes)]
    return [int(floor_bytes + share * (peak_bytes - floor_bytes)) for share in shares]


def _model_figures(work_dir: Path) -> tuple[int, int]:
    """(floor, no-remat peak) in bytes of the demo model on the nodes' platform, as the server prices it."""
    from host.costs import load_profile, price_graph
    from host.fleet.model_package import package_model
    from host.solver.solve import minimum_ram_bytes, no_remat_peak_bytes

    package = package_model(MODEL, work_dir / "models", batch_size=BATCH_SIZE, seed=0)
    priced = price_graph(package.graph.with_optimizer("sgd"), load_profile(PLATFORM))
    return int(minimum_ram_bytes(priced)), int(no_remat_peak_bytes(priced))


def _final(report_path: Path) -> dict[str, np.ndarray]:
    with np.load(report_path.with_suffix(".npz")) as data:
        return {name: data[name] for name in data.files}


def max_rel_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest per-tensor max |a-b| / max |b| (as device_agent.executor.parameter_differences)."""
    if a.keys() != b.keys():
        raise SystemExit(f"the two runs' parameters differ in names: {sorted(a)} vs {sorted(b)}")
    worst = 0.0
    for name in a:
        diff = float(np.abs(a[name].astype(np.float64) - b[name].astype(np.float64)).max(initial=0.0))
        scale = float(np.abs(b[name].astype(np.float64)).max(initial=0.0))
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def run_demo(rounds: int, nodes: int, directory: str | Path, *, steps: int = STEPS, echo: bool = True) -> dict[str, Any]:
    from device_agent.agent.demo_data import make_demo
    from poet_edge.flower.deployment import Deployment, write_app

    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    floor, peak = _model_figures(root / "server")
    budgets = node_budgets(nodes, floor, peak)
    node_configs = []
    for index in range(nodes):
        node_dir = root / f"node-{index + 1}"
        if not (node_dir / "data" / "digits").is_dir():
            make_demo(node_dir / "data", "digits", shard=(index + 1, nodes))
        node_configs.append({"poet-data-dir": str(node_dir / "data"), "poet-dataset": "digits",
                             "poet-work-dir": str(node_dir / "work"), "poet-platform": PLATFORM,
                             "poet-ram-budget": str(budgets[index])})
    app_dir = write_app(root / "app", {"num-rounds": rounds, "poet-model": MODEL, "poet-batch-size": BATCH_SIZE,
                                       "poet-steps": steps, "poet-lr": LR, "poet-min-nodes": nodes,
                                       "poet-work-dir": str(root / "server")})
    reports = {}
    with Deployment(root, node_configs, echo=echo) as deployment:
        for mode in ("poet", "plain"):
            path = root / f"report-{mode}.json"
            path.unlink(missing_ok=True)
            deployment.run(app_dir, {"poet-plain": mode == "plain", "poet-report": str(path)})
            if not path.is_file():
                raise SystemExit(f"the {mode} run wrote no report at {path}: see the ServerApp's output above")
            reports[mode] = json.loads(path.read_text())
    poet, plain = reports["poet"], reports["plain"]
    plain_rows = {(r["round"], n["node"]): n for r in plain["rounds"] for n in r["nodes"]}
    keys = ("node", "ram_budget_bytes", "min_ram_budget_bytes", "recomputes", "page_ins", "page_outs",
            "peak_ram_bytes", "rss_peak_bytes", "energy_j", "energy_source", "loss", "steps")
    rounds_out = []
    for entry in poet["rounds"]:
        rows = []
        for node in entry["nodes"]:
            row = {key: node.get(key) for key in keys}
            row["predicted"] = node.get("predicted")
            twin = plain_rows.get((entry["round"], node["node"]), {})
            row["plain"] = {key: twin.get(key) for key in ("energy_j", "energy_source", "rss_peak_bytes", "loss")}
            row["plain"]["no_remat_peak_bytes"] = peak  # what plain training keeps (the executor tracks nothing)
            rows.append(row)
        rounds_out.append({"round": entry["round"], "nodes": rows})
    diff = max_rel_diff(_final(root / "report-poet.json"), _final(root / "report-plain.json"))
    under_schedule = all(n["recomputes"] or n["page_outs"] for r in rounds_out for n in r["nodes"])
    return {
        "model": MODEL, "batch_size": BATCH_SIZE, "platform": PLATFORM, "steps_per_round": steps,
        "floor_bytes": floor, "no_remat_peak_bytes": peak,
        "rounds": rounds_out, "refused": poet["refused"],
        "secure_aggregation": bool(poet.get("secure_aggregation")) and bool(plain.get("secure_aggregation")),
        "max_rel_param_diff_vs_plain": diff,
        "every_node_under_a_schedule": under_schedule,
        "ok": diff <= TARGET_REL_DIFF and under_schedule and len(rounds_out) == rounds
        and all(len(r["nodes"]) == nodes for r in rounds_out),
    }


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'round':>5} {'node':>20} {'budget B':>9} {'recomp':>6} {'pg-out':>6} {'peak B':>8} "
             f"{'E poet J':>9} {'E plain J':>9} {'loss':>8}"]
    for entry in result["rounds"]:
        for n in entry["nodes"]:
            lines.append(f"{entry['round']:>5} {n['node']:>20} {n['ram_budget_bytes']:>9} {n['recomputes']:>6} "
                         f"{n['page_outs']:>6} {n['peak_ram_bytes']:>8} {n['energy_j'] or 0:>9.3f} "
                         f"{n['plain']['energy_j'] or 0:>9.3f} {n['loss']:>8.4f}")
    lines.append(f"no-remat peak {result['no_remat_peak_bytes']} B, floor {result['floor_bytes']} B; "
                 f"SecAgg+ {'on' if result['secure_aggregation'] else 'off'}; max relative parameter difference "
                 f"vs plain {result['max_rel_param_diff_vs_plain']:.3g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poet_edge.flower.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--dir", required=True, help="working directory (certificates, data, logs, reports)")
    parser.add_argument("--steps", type=int, default=STEPS, help="local training steps per round")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.nodes < 2:
        parser.error("--rounds must be >= 1 and --nodes >= 2 (SecAgg+ needs two nodes)")
    result = run_demo(args.rounds, args.nodes, args.dir, steps=args.steps)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
