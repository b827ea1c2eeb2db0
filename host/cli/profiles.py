"""`poet profiles list|show|diff`: the boards' stored profile versions."""

from __future__ import annotations

import argparse
import time

from host.cli.common import (
    EXIT_OK,
    Console,
    add_json_arg,
    positive_int,
)
from host.cli.operator import (
    OPERATOR_EPILOG,
    operator_args,
    with_operator,
)
from host.fleet.client import OperatorClient


# ------------------------------------------------------------------------------------------ profiles
@with_operator
def cmd_profiles_list(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import profile_info_to_json

    reply = op.call("ListProfiles", op.pb.ListProfilesRequest(agent=args.agent or ""))
    entries = [profile_info_to_json(p, with_profile=False) for p in reply.profiles]
    if args.json:
        console.print_json({"profiles": entries})
        return EXIT_OK
    if not entries:
        console.print("no stored profiles (boards are priced on their shipped platform; `poet calibrate --agent NAME` "
                      "or `poet run --kind profile` stores one)")
        return EXIT_OK
    console.print(f"{'board':<14} {'version':>7} {'name':<16} {'created (UTC)':<20} {'source':<12} "
                  f"{'step MAPE before->after':>24}")
    for e in entries:
        prov = e["provenance"]
        mape = ""
        if prov.get("step_mape_before") is not None:
            mape = f"{prov['step_mape_before']:.1f}% -> {prov['step_mape_after']:.1f}%"
        console.print(f"{e['agent']:<14} {e['version']:>7} {e['name']:<16} {_utc(e['created_unix_s']):<20} "
                      f"{prov.get('source', '-'):<12} {mape:>24}")
    return EXIT_OK


@with_operator
def cmd_profiles_show(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import profile_info_to_json

    entry = profile_info_to_json(op.call("GetProfile", op.pb.GetProfileRequest(agent=args.agent,
                                                                               version=args.version or 0)))
    if args.json:
        console.print_json(entry)
        return EXIT_OK
    console.print(f"{entry['agent']} profile v{entry['version']} ({entry['name']}), stored "
                  f"{_utc(entry['created_unix_s'])} UTC")
    for key, value in entry["provenance"].items():
        console.print(f"  provenance.{key:<22} {value}")
    for key, value in _flatten(entry["profile"]).items():
        if not key.startswith("sources."):
            console.print(f"  {key:<40} {value}")
    return EXIT_OK


@with_operator
def cmd_profiles_diff(args, console: Console, op: OperatorClient) -> int:
    from host.fleet.serde import profile_info_to_json

    a, b = (profile_info_to_json(op.call("GetProfile", op.pb.GetProfileRequest(agent=args.agent, version=v)))
            for v in (args.a, args.b))
    changes = profile_diff(a["profile"], b["profile"])
    if args.json:
        console.print_json({"agent": args.agent, "a": args.a, "b": args.b, "changes": changes})
        return EXIT_OK
    if not changes:
        console.print(f"{args.agent}: versions {args.a} and {args.b} are the same")
        return EXIT_OK
    console.print(f"{'field':<44} {'v' + str(args.a):>14} {'v' + str(args.b):>14} {'change':>9}")
    for c in changes:
        rel = "-" if c["rel_change"] is None else f"{c['rel_change'] * 100:+.1f}%"
        console.print(f"{c['field']:<44} {_cell(c['a']):>14} {_cell(c['b']):>14} {rel:>9}")
    return EXIT_OK


def profile_diff(a: dict, b: dict) -> list[dict]:
    """Field by field (dotted paths, `sources.*` left out): {field, a, b, rel_change} for each field that differs;
    rel_change = (b - a) / |a| for numbers (null when a is 0 or a side is not a number or is missing)."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    out = []
    for key in sorted(set(flat_a) | set(flat_b)):
        if key.startswith("sources."):
            continue
        va, vb = flat_a.get(key), flat_b.get(key)
        if va == vb:
            continue
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        rel = (vb - va) / abs(va) if numbers and va else None
        out.append({"field": key, "a": va, "b": vb, "rel_change": rel})
    return out


def _flatten(value: dict, prefix: str = "") -> dict:
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update(_flatten(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat


def _cell(value) -> str:
    if isinstance(value, float):
        return format(value, ".4g")
    return "-" if value is None else str(value)[:14]


def _utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_s))


def register(sub: argparse._SubParsersAction) -> None:

    profiles = sub.add_parser("profiles", help="the boards' stored profile versions",
                              description="Each board's stored profile versions: measured by a PROFILE job or "
                                          "fitted by `poet calibrate`, with where each came from. The coordinator "
                                          "solves a board's runs on its latest version unless `poet run "
                                          "--profile-version N` pins one.", epilog=OPERATOR_EPILOG)
    profiles_sub = profiles.add_subparsers(dest="profiles_command", required=True, metavar="SUBCOMMAND")
    plist = profiles_sub.add_parser("list", help="stored versions, by board then version", epilog=OPERATOR_EPILOG)
    plist.add_argument("--agent", metavar="NAME", help="only this board's versions (default: every board)")
    operator_args(plist)
    add_json_arg(plist)
    plist.set_defaults(func=cmd_profiles_list)
    pshow = profiles_sub.add_parser("show", help="one version: the profile JSON and its provenance",
                                    epilog=OPERATOR_EPILOG)
    pshow.add_argument("agent", metavar="AGENT")
    pshow.add_argument("--version", type=positive_int, metavar="N", help="(default: the latest)")
    operator_args(pshow)
    add_json_arg(pshow)
    pshow.set_defaults(func=cmd_profiles_show)
    pdiff = profiles_sub.add_parser("diff", help="two versions of a board's profile, field by field",
                                    description="Fields that differ between versions A and B, with the relative "
                                                "change (B - A) / |A| for numbers.", epilog=OPERATOR_EPILOG)
    pdiff.add_argument("agent", metavar="AGENT")
    pdiff.add_argument("a", type=positive_int, metavar="A")
    pdiff.add_argument("b", type=positive_int, metavar="B")
    operator_args(pdiff)
    add_json_arg(pdiff)
    pdiff.set_defaults(func=cmd_profiles_diff)
