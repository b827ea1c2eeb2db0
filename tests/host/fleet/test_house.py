"""The fleet's house (issue 17, part 6): one spelling of a run's status, an operator client without argparse, one CLI
module per command group, and the coordinator split by role. Structural checks: each fails on the code before."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import host.cli
import host.fleet

FLEET = Path(host.fleet.__file__).parent
CLI = Path(host.cli.__file__).parent


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path) -> set[str]:
    tree = _tree(path)
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return names | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_a_runs_status_is_spelled_once():
    """"queued" and "does_not_fit" (statuses only a run has) appear as literals only in host/fleet/status.py."""
    from host.fleet import serde
    from host.fleet.status import RunStatus

    found = []
    for path in sorted([*FLEET.glob("*.py"), *CLI.glob("*.py")]):
        if path.name == "status.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and node.value in ("queued", "does_not_fit"):
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert found == []
    assert set(serde.RUN_STATUS_TO_PB) == set(RunStatus)  # the proto's enum mirrors it, member for member
    assert {serde.fleet_pb2.RunStatus.Name(v) for v in serde.RUN_STATUS_TO_PB.values()} == {
        f"RUN_STATUS_{s.name}" for s in RunStatus}


def test_the_operator_client_needs_no_argparse_and_the_cli_builds_no_channel():
    from host.fleet.client import FleetClientError, OperatorClient

    assert "argparse" not in _imports(FLEET / "client.py")
    for path in CLI.glob("*.py"):
        assert "grpc" not in _imports(path), f"{path.name} builds gRPC itself; use host.fleet.client"
    with pytest.raises(FleetClientError, match="POET_COORDINATOR"):
        OperatorClient.from_settings(None, "somewhere")


def test_each_fleet_command_group_lives_in_its_own_module():
    from host.cli import fleet

    parser = argparse.ArgumentParser(prog="poet")
    fleet.register(parser.add_subparsers(dest="command"))
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    modules = {}
    for name, sub in commands.items():
        func = sub.get_default("func")
        if func is None:  # a group of subcommands
            inner = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices
            func = next(iter(inner.values())).get_default("func")
        modules[name] = func.__module__
    assert modules == {"serve": "host.cli.serve", "solver-worker": "host.cli.solver_worker", "fleet": "host.cli.fleet", "run": "host.cli.run",
                       "runs": "host.cli.runs", "profiles": "host.cli.profiles", "calibrate": "host.cli.calibrate"}


def test_the_coordinator_is_thin_servicers_over_roles_over_one_state():
    """Flower's shape: the servicers hand each request to a role (auth, jobs, planning, ingestion) over the shared
    state; the roles never import the servicers, and Coordinator only composes them (one-statement methods)."""
    from host.fleet.service import Coordinator

    for role in ("state", "auth", "jobs", "planning", "ingestion", "uploads", "calibration", "validation"):
        assert "host.fleet.service" not in _imports(FLEET / f"{role}.py"), role
    tree = _tree(FLEET / "service.py")
    coordinator = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Coordinator")
    long = [n.name for n in coordinator.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"
            and len([s for s in n.body if not isinstance(s, ast.Expr)]) > 1]
    assert long == []
    assert {"auth", "jobs", "planning", "ingestion", "state"} <= set(vars(Coordinator).get("__init__").__code__.co_names)


def test_calibration_drives_the_planner_it_is_given_not_the_coordinator():
    """Calibration submits runs and reads graphs through host/fleet/planning.py's Planner (typed), not by duck typing
    the Coordinator; its registry lives in the shared state."""
    import inspect

    from host.fleet import calibration
    from host.fleet.planning import Planner

    assert "Coordinator" not in (FLEET / "calibration.py").read_text()
    for function in (calibration.start_calibration, calibration.calibration_info, calibration.calibrate,
                     calibration.refine, calibration.stored_runs, calibration.Refiner):
        assert inspect.signature(function, eval_str=True).parameters["planner"].annotation is Planner



def test_user_errors_share_one_base_class():
    """Every user-facing error derives from device_agent.errors.UserError (re-exported by host/run/errors.py): the CLI
    and the coordinator catch that one class, and no list of error types is kept by hand. A new error is caught
    without being listed anywhere."""
    import importlib

    from device_agent.errors import UserError as Base
    from host.fleet.uploads import UploadError
    from host.run.errors import InputError, SolveFailedError, UserError

    assert UserError is Base

    class NewError(UserError, ValueError):
        pass

    try:
        raise NewError("the message says the fix")
    except UserError as error:
        assert isinstance(error, NewError)
    # the errors whose messages the CLI prints as they are, wherever they are defined
    named = {
        "host.graph.training_graph": "GraphError", "host.graph.export": "TraceError", "host.graph.zoo":
        "UnknownModelError", "host.graph.poet2022": "UnknownPoet2022ModelError", "host.graph.resolve":
        "UnknownModelNameError", "host.graph.model_source": "ModelSourceError", "host.costs.profile": "ProfileError",
        "host.solver.solve": "BudgetError", "host.solver.backends": "UnknownSolverError",
        "host.solver.backends.pulp_backend": "SolverUnavailableError", "host.solver.validator":
        "ScheduleValidationError", "device_agent.replay": "ScheduleMismatchError", "device_agent.serde":
        "ScheduleFormatError", "device_agent.executor": "ExecutorError", "device_agent.executor.page_store":
        "PageStoreError", "device_agent.profiling": "LocalBenchError", "device_agent.serial_bridge.model":
        "McuModelError", "device_agent.serial_bridge.board": "McuBoardError", "device_agent.serial_bridge.link":
        "LinkError", "device_agent.serial_bridge.qemu": "QemuError",
    }
    for module, name in named.items():
        assert issubclass(getattr(importlib.import_module(module), name), UserError), f"{module}.{name}"
    assert all(issubclass(e, UserError) for e in (InputError, SolveFailedError, UploadError))
    assert "user_errors" not in (FLEET.parent / "run" / "errors.py").read_text()
