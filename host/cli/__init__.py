"""The `poet` command, one module per command group (catalog, solve, train); shared pieces in common."""

from host.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
