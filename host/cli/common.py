"""What every `poet` command shares: exit codes, errors, argument types and groups, the output channels."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from host.graph.granularity import GRANULARITY_HELP, granularity_text, parse_granularity
from host.run import values
from host.solver.deadline import DEFAULT_TIME_LIMIT_S

EXIT_OK = 0
EXIT_INTERNAL = 1  # a solver answer that failed validation (a bug: please report it)
EXIT_USAGE = 2  # bad input: unknown names, malformed values, impossible budgets
EXIT_INFEASIBLE = 3
EXIT_TIMEOUT = 4  # the time limit passed with no schedule
EXIT_VERIFY_FAILED = 5  # parameters differ, counters differ from the schedule, or the budget was exceeded
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM): systemd, docker stop, timeout

SOLVE_EXIT_CODES = {"optimal": EXIT_OK, "feasible": EXIT_OK, "infeasible": EXIT_INFEASIBLE,
                    "timeout": EXIT_TIMEOUT, "error": EXIT_INTERNAL}


class CliError(Exception):
    """A user-facing error: printed as one line naming the problem and the fix (exit 2)."""


# ---------------------------------------------------------------------------------------- output
@dataclass
class Console:
    """Results go to ``out`` (the real stdout); progress and logs go to stderr through ``status``."""

    out: TextIO
    status: Any  # host.cli.display.LiveStatus
    _printed_json: bool = field(default=False, repr=False)

    def print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def print_json(self, payload: dict) -> None:
        """The one JSON object of a --json run (a second one would be a bug)."""
        assert not self._printed_json, "a --json command prints exactly one object"
        self._printed_json = True
        self.out.write(json.dumps(payload) + "\n")
        self.out.flush()

    def log(self, message: str) -> None:
        self.status.log(message)


# ---------------------------------------------------------------------------------------- argument types
def _arg_type(check: Callable[[str], Any], metavar: str) -> Callable[[str], Any]:
    """An argparse ``type=``: a ValueError from ``check`` becomes argparse's error, which names the flag."""

    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = metavar  # argparse shows it in "invalid <name> value" messages
    return convert


def int_at_least(minimum: int) -> Callable[[str], int]:
    return _arg_type(lambda text: values.int_at_least(text, minimum), f"integer >= {minimum}")


positive_int = int_at_least(1)
seed_int = int_at_least(0)
runtime_factor = _arg_type(values.runtime_factor, "runtime factor")
seconds = _arg_type(values.time_limit_s, "seconds")
mip_gap = _arg_type(values.mip_gap, "gap")
learning_rate = _arg_type(values.learning_rate, "learning rate")
ram_budget = _arg_type(values.RamBudget.parse, "RAM budget")


def _input_shape(text: str) -> tuple[int, ...]:
    from host.graph.model_source import ModelSourceError, parse_input_shape

    try:
        return parse_input_shape(text)
    except ModelSourceError as error:
        raise ValueError(str(error).removeprefix(f"--input-shape {text!r}: ")) from None


input_shape = _arg_type(_input_shape, "shape")
# layer, block, block:N or op, as its canonical text
granularity = _arg_type(lambda text: granularity_text(*parse_granularity(text)), "granularity")


def _not_an_existing(kind: str, check: Callable[[str], bool]) -> Callable[[str], str]:
    def validate(text: str) -> str:
        if not text:
            raise ValueError("an empty path")
        if os.path.exists(text) and not check(text):
            raise ValueError(f"{text!r} exists and is not a {kind}")
        return text

    return _arg_type(validate, "path")


directory_path = _not_an_existing("directory", os.path.isdir)  # missing is fine: it is created
file_path = _not_an_existing("file", os.path.isfile)


# ---------------------------------------------------------------------------------------- argument groups
RAM_BUDGET_HELP = ("bytes (3000000), a size with a unit (3MB, 2.5MiB), or a percentage of the no-remat peak, the "
                   "controlled RAM plain training needs (50%% = half of it)")


MODEL_HELP = ("zoo name (see `poet models`), poet2022:<name> (the paper's reference graph), or package.module:factory "
              "(importable from the current directory)")


def add_model_args(parser: argparse.ArgumentParser, *, platform_help: str | None = None,
                   model_help: str = MODEL_HELP) -> None:
    """--model, --platform, --input-shape, --batch-size, --granularity."""
    parser.add_argument("--model", required=True, help=model_help)
    if platform_help is None:
        parser.add_argument("--platform", required=True,
                            help="shipped platform name (see `poet platforms`), a profile .json file, or local "
                                 "(measure this machine)")
    else:
        parser.add_argument("--platform", default=None, help=platform_help)
    parser.add_argument("--input-shape", type=input_shape, metavar="SHAPE",
                        help="for a module:factory returning a bare nn.Module: the input's shape, batch first, "
                             "e.g. 32,64 (default: none)")
    parser.add_argument("--batch-size", type=positive_int, metavar="N",
                        help="batch size of a zoo or poet2022 model, >= 1 (default: the model's)")
    parser.add_argument("--granularity", default="layer", type=granularity, metavar="{layer,block,block:N,op}",
                        help=GRANULARITY_HELP)


def add_solver_args(parser: argparse.ArgumentParser, *, runtime_default: float = 1.2,
                    time_limit_default: float = DEFAULT_TIME_LIMIT_S, threads: bool = True) -> None:
    """--runtime-budget, --solver, --formulation, --time-limit, --solve-threads."""
    parser.add_argument("--runtime-budget", type=runtime_factor, default=runtime_default, metavar="FACTOR",
                        help="allowed runtime as a factor of the plain forward+backward runtime, >= 1.0 "
                             f"(default {runtime_default:g}: {100 * (runtime_default - 1):.0f}%% extra)")
    parser.add_argument("--solver", default="highs", choices=["highs", "cbc", "gurobi"],
                        help="MILP backend (default: highs)")
    parser.add_argument("--formulation", default="poet-edge", choices=["poet-edge", "poet2022"],
                        help="poet-edge (the fast formulation) or poet2022 (the paper's MILP, slow; for "
                             "comparison) (default: poet-edge)")
    parser.add_argument("--time-limit", type=seconds, default=time_limit_default, metavar="SECONDS",
                        help="solver time limit in seconds; when it passes, the best schedule so far is used with "
                             f"its gap (default {time_limit_default:g} s)")
    if threads:
        parser.add_argument("--solve-threads", type=positive_int, metavar="N",
                            help="solver threads, >= 1 (default: the solver's choice)")


def add_ablation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-paging", action="store_true",
                        help="ablation: recomputation only, never page to flash (default: both allowed)")
    parser.add_argument("--no-remat", action="store_true",
                        help="ablation: paging only, never recompute (default: both allowed)")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print exactly one JSON object on stdout (progress and logs stay on stderr)")


def solve_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The solve keywords of the API, from the shared flags."""
    return dict(
        runtime_budget=args.runtime_budget,
        time_limit_s=args.time_limit,
        solve_threads=getattr(args, "solve_threads", None),
        solver=args.solver,
        formulation=args.formulation,
        mip_gap=getattr(args, "mip_gap", 1e-3),
        paging=not getattr(args, "no_paging", False),
        remat=not getattr(args, "no_remat", False),
        paging_in_runtime=getattr(args, "paging_in_runtime", False),
    )


def model_keywords(args: argparse.Namespace) -> dict[str, Any]:
    return dict(input_shape=args.input_shape, batch_size=args.batch_size, granularity=args.granularity,
                seed=getattr(args, "seed", 0))
