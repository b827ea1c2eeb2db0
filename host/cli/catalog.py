"""`poet models`, `poet platforms`, `poet profile`: what there is to solve for, and measuring this machine."""

from __future__ import annotations

import argparse
from pathlib import Path

from host.cli.common import EXIT_OK, CliError, Console, add_json_arg, directory_path, file_path


def cmd_models(args, console: Console) -> int:
    from host.graph.poet2022 import POET2022_MODELS
    from host.graph.resolve import POET2022_PREFIX
    from host.graph.zoo import list_models

    console.print("Real PyTorch models (traced with torch.export):")
    for spec in list_models():
        shape = "x".join(str(d) for d in spec.input_shape)
        console.print(f"  {spec.name:<16} input {shape:<10} batch {spec.default_batch_size:<3} {spec.description}")
    console.print("\nReference graphs of the POET paper code (for number-for-number comparison):")
    console.print("  " + "  ".join(POET2022_PREFIX + name for name in POET2022_MODELS))
    console.print("\nYour own model: --model package.module:factory [--input-shape 32,64]")
    return EXIT_OK


def cmd_platforms(args, console: Console) -> int:
    from host.costs import list_platforms, load_profile

    console.print(f"{'platform':<12} {'compute':>13} {'J/GFLOP':>9} {'page-in':>11} {'page-out':>11} {'mem W':>6}  "
                  "description")
    for name in list_platforms():
        p = load_profile(name)
        j_per_gflop = ((p.energy_per_flop_j * 1e9) if p.energy_per_flop_j
                       else p.compute_power_w / p.flops_per_s["default"] * 1e9)
        console.print(
            f"{name:<12} {p.flops_per_s['default'] / 1e6:>8.2f} MF/s {j_per_gflop:>9.3f} "
            f"{p.page_in_throughput_bytes_per_s / 1e6:>7.1f} MB/s {p.page_out_throughput_bytes_per_s / 1e6:>7.1f} MB/s "
            f"{p.memory_power_w:>6.3f}  {p.description}"
        )
    console.print("\nA profile file of your own works too: --platform path/to/profile.json (see `poet profile --local`).")
    return EXIT_OK


def cmd_profile(args, console: Console) -> int:
    from host.costs import save_profile
    from host.costs.local_bench import profile_local_machine
    from host.run.sources import ensure_flash_dir

    if not args.local:
        raise CliError("only `poet profile --local` is supported: it measures this machine")
    flash_dir = ensure_flash_dir(args.flash_dir, console.log)
    profile = profile_local_machine(flash_dir, name=args.name, quick=args.quick,
                                    progress=lambda message: console.log(f"  {message}"))
    out = Path(args.out or f"{args.name}.profile.json")
    save_profile(profile, out)
    if args.json:
        console.print_json({
            "profile_file": str(out),
            "name": profile.name,
            "flops_per_s": profile.flops_per_s,
            "page_out_latency_s": profile.page_out_latency_s,
            "page_out_throughput_bytes_per_s": profile.page_out_throughput_bytes_per_s,
            "page_in_latency_s": profile.page_in_latency_s,
            "page_in_throughput_bytes_per_s": profile.page_in_throughput_bytes_per_s,
            "compute_power_w": profile.compute_power_w,
            "memory_power_w": profile.memory_power_w,
            "energy_source": profile.energy_source,
        })
        return EXIT_OK
    console.print(f"wrote {out}")
    console.print(f"  compute  {profile.flops_per_s['default'] / 1e9:.2f} GFLOP/s (default), " + ", ".join(
        f"{k} {v / 1e9:.2f}" for k, v in profile.flops_per_s.items() if k != "default"))
    console.print(f"  page-out {profile.page_out_latency_s * 1e3:.3f} ms + "
                  f"{profile.page_out_throughput_bytes_per_s / 1e6:.1f} MB/s")
    console.print(f"  page-in  {profile.page_in_latency_s * 1e3:.3f} ms + "
                  f"{profile.page_in_throughput_bytes_per_s / 1e6:.1f} MB/s")
    console.print(f"  energy   {profile.energy_source}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("models", help="list the model zoo and the poet2022 reference graphs",
                   description="List the model zoo and the poet2022 reference graphs.").set_defaults(func=cmd_models)
    sub.add_parser("platforms", help="list the shipped platform profiles",
                   description="List the shipped platform profiles.").set_defaults(func=cmd_platforms)

    profile = sub.add_parser("profile", help="measure this machine and write a platform profile",
                             description="Measure this machine's compute and paging speeds and write a platform "
                                         "profile for --platform.")
    profile.add_argument("--local", action="store_true", required=True, help="measure this machine (required)")
    profile.add_argument("--flash-dir", type=directory_path, default=".", metavar="DIR",
                         help="directory on the storage to page to; created if missing (default: current directory)")
    profile.add_argument("--name", default="local", help="the profile's name (default: local)")
    profile.add_argument("--out", type=file_path, metavar="FILE", help="profile file to write (default: <name>.profile.json)")
    profile.add_argument("--quick", action="store_true", help="a short run of a few seconds (default: a full run)")
    add_json_arg(profile)
    profile.set_defaults(func=cmd_profile)
