"""Models users bring, verified as users run them: prints a table, never passes or fails.

For each model of ``tests/models`` (Hugging Face models from configs, LoRA, frozen layers, forwards that
reshape their input, recurrent layers), ``poet_edge.verify`` trains it under its schedule and plainly from
the same weights and data, and the table gives the parameters' difference, the tracked peak against the
budget, the fixed bytes with each optimizer and the FLOPs per step.

    python bench/user_models.py [--budget 70%] [--steps 2] [--platform a72] [--models NAME,NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODELS = (
    "tests.models.huggingface:gpt2_logits",
    "tests.models.huggingface:gpt2_as_is",
    "tests.models.huggingface:gpt2_lora",
    "tests.models.huggingface:distilbert",
    "tests.models.huggingface:vit",
    "tests.models.huggingface:mobilenet_v2",
    "tests.models.frozen:eval_mode_bn_factory",
    "tests.models.frozen:frozen_backbone_factory",
    "tests.models.reshaped:view",
    "tests.models.reshaped:transpose",
    "tests.models.reshaped:dtype_cast",
    "tests.models.reshaped:gru_transposed",
)


def measure(model: str, *, budget: str, steps: int, platform: str, flash_dir: str) -> dict:
    """One model: verify under ``budget`` (falling back to 100% when it is below the model's floor)."""
    from poet_edge import SolveFailedError, solve, verify

    started = time.perf_counter()
    used = budget
    try:
        report = verify(model, platform, budget, steps=steps, flash_dir=flash_dir, time_limit_s=30)
    except SolveFailedError:
        used = "100%"
        report = verify(model, platform, used, steps=steps, flash_dir=flash_dir, time_limit_s=30)
    fixed = {name: solve(model, platform, "100%", optimizer=name, time_limit_s=10).fixed_bytes
             for name in ("sgd", "adamw")}
    graph_flops = solve(model, platform, "100%", time_limit_s=10).to_dict().get("flops_per_step")
    return {
        "model": model, "budget": used, "ok": report.ok, "bitwise_equal": report.bitwise_equal,
        "max_rel_param_diff": report.max_rel_param_diff, "peak_tracked_bytes": report.peak_tracked_bytes,
        "ram_budget_bytes": report.ram_budget_bytes, "no_remat_peak_bytes": report.no_remat_peak_bytes,
        "fixed_bytes_sgd": fixed["sgd"], "fixed_bytes_adamw": fixed["adamw"], "flops_per_step": graph_flops,
        "recomputes": report.planned["recomputes"], "page_outs": report.planned["page_outs"],
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help="RAM budget per model (default 70%% of its no-remat peak)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    parser.add_argument("--platform", default="a72", help="platform to solve for (default a72)")
    parser.add_argument("--models", help="comma-separated module:factory names (default: all of tests/models)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the rows instead")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else MODELS
    rows = []
    with tempfile.TemporaryDirectory(prefix="poet-bench-") as flash_dir:
        for model in models:
            rows.append(measure(model, budget=args.budget, steps=args.steps, platform=args.platform,
                                flash_dir=flash_dir))
            if not args.json:
                row = rows[-1]
                print(f"{row['model']:<45} {row['budget']:>5} {'ok' if row['ok'] else 'FAILED':<6} "
                      f"rel diff {row['max_rel_param_diff']:.1e}{' (bitwise)' if row['bitwise_equal'] else ''}  "
                      f"peak {row['peak_tracked_bytes']:,}/{row['ram_budget_bytes']:,.0f} B  "
                      f"fixed sgd {row['fixed_bytes_sgd']:,} adamw {row['fixed_bytes_adamw']:,} B  "
                      f"{(row['flops_per_step'] or 0) / 1e9:.3f} GFLOP  remat {row['recomputes']} "
                      f"pages {row['page_outs']}  {row['seconds']:.0f} s", flush=True)
    if args.json:
        print(json.dumps({"platform": args.platform, "steps": args.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
