"""The `poet-agent` command (device side). Serving jobs over gRPC arrives with the agent issue."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="poet-agent", description="poet-edge device agent")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the agent version")
    sub.add_parser("serve", help="serve training jobs over gRPC (not available yet)")
    args = parser.parse_args(argv)
    if args.command == "version":
        from importlib.metadata import version

        print(f"poet-agent {version('poet-edge')}")
        return 0
    print("poet-agent serve: the gRPC agent is not part of this release yet; "
          "run schedules locally with `poet train` on the host", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
