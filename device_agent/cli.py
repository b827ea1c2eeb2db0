"""The `poet-agent` command (device side): one subcommand group per concern.

``datasets`` manages the board's local training data; ``run`` (the gRPC agent) and ``bridge`` (the
serial bridge) join as their own groups. Exit codes: 0 done, 1 internal error, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

DATASETS_EPILOG = """\
dataset format: DATA_DIR/NAME/ holds .npz shards, each with arrays x (samples, features...; float
or integer dtype, finite) and y (samples,; integer class labels or float targets), written with
numpy.savez(path, x=x, y=y). Shards named heldout*.npz form the optional held-out split; every
other .npz is training data. Files starting with '.' and non-.npz files are ignored. Shards are
never unpickled. NAME: letters, digits, '.', '_', '-' (at most 64).
"""


def _add_datasets(sub) -> None:
    datasets = sub.add_parser(
        "datasets", help="local training data (it never leaves the board)", epilog=DATASETS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = datasets.add_subparsers(dest="action", required=True)
    demo = actions.add_parser(
        "make-demo",
        help="write one board's class-skewed shard of scikit-learn's bundled digits set",
        description="Write DATA_DIR/NAME/ (train.npz, heldout.npz, source.json): shard I of N of scikit-learn's "
        "digits (no download), skewed toward classes c with c %% N == I-1, with a held-out fifth from the same "
        "distribution; x float32 in [0, 1] (64 features), y int64. Needs scikit-learn: "
        "pip install 'poet-edge[demo]'.",
        epilog=DATASETS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--data-dir", required=True, help="the agent's data dir (created if missing)")
    demo.add_argument("--name", default="digits", help="dataset name (default: digits)")
    demo.add_argument("--shard", default="1/1", metavar="I/N", help="this board's shard, counted from 1 (default: 1/1)")
    demo.add_argument("--seed", type=int, default=0, help="split seed; shards of one seed are disjoint (default: 0)")
    demo.add_argument("--force", action="store_true", help="replace an existing dataset of that name")
    listing = actions.add_parser(
        "list", help="print each dataset: name, shards, samples, held-out samples",
        epilog=DATASETS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listing.add_argument("--data-dir", required=True, help="the agent's data dir")
    listing.add_argument("--json", action="store_true", help="print one JSON object with a `datasets` list")


def _run_datasets(args) -> int:
    from device_agent.agent.datasets import DatasetError, DatasetSummary, list_datasets

    if args.action == "make-demo":
        from device_agent.agent.demo_data import make_demo, parse_shard

        dataset = make_demo(args.data_dir, args.name, parse_shard(args.shard), args.seed, args.force)
        print(f"wrote {dataset.path}: {len(dataset)} training samples, {dataset.heldout_samples} held out "
              f"(shard {args.shard}, seed {args.seed})")
        return EXIT_OK
    found = list_datasets(args.data_dir)
    invalid = [(name, error) for name, error in found if isinstance(error, DatasetError)]
    summaries = [s for _, s in found if isinstance(s, DatasetSummary)]
    if args.json:
        print(json.dumps({
            "datasets": [asdict(s) | {"valid": True} for s in summaries]
            + [{"name": name, "valid": False, "error": str(error)} for name, error in invalid],
        }, indent=2))
    else:
        rows = [("NAME", "SHARDS", "SAMPLES", "HELDOUT_SAMPLES")]
        rows += [(s.name, str(s.shards), str(s.samples), str(s.heldout_samples)) for s in summaries]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if not summaries and not invalid:
            print(f"(no datasets in {args.data_dir})")
    for name, error in invalid:
        print(f"poet-agent: dataset {name} is unusable: {error}", file=sys.stderr)
    return EXIT_USAGE if invalid else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poet-agent", description="poet-edge device agent",
        epilog="exit codes: 0 done, 1 internal error, 2 bad input or unusable data",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the agent version")
    _add_datasets(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        from importlib.metadata import version

        print(f"poet-agent {version('poet-edge')}")
        return EXIT_OK
    from device_agent.agent.datasets import DatasetError

    try:
        return _run_datasets(args)
    except DatasetError as exc:
        print(f"poet-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
