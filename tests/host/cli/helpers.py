"""Run the `poet` command as users do: the installed console script in a subprocess, or main() under capfd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from host.cli import main

POET = Path(sys.executable).parent / "poet"
REPO = Path(__file__).resolve().parents[3]


def poet(*argv: str, cwd: str | os.PathLike | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real `poet` console script; stdout and stderr captured apart."""
    return subprocess.run([str(POET), *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=test_env())


def test_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


test_env.__test__ = False  # not a test: a helper named like one


def one_json_object(stdout: str) -> dict:
    """stdout must be exactly one JSON object (and nothing else)."""
    decoder = json.JSONDecoder()
    text = stdout.strip()
    payload, end = decoder.raw_decode(text)
    assert text[end:].strip() == "", f"more than one JSON value on stdout: {text[end:][:200]!r}"
    assert isinstance(payload, dict), f"stdout is a JSON {type(payload).__name__}, not an object"
    return payload


def run_main(capfd, *argv: str) -> tuple[int, str, str]:
    """main() in this process; capfd sees what reaches file descriptors 1 and 2."""
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err
