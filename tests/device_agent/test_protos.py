"""The committed protobuf stubs: they match the .proto files, and the declared runtimes accept them."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from device_agent import protos

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_grpc_tools = pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools (a dev dependency) is not installed"
)


@needs_grpc_tools
def test_committed_stubs_match_the_proto_files():
    differences = protos.stub_differences(protos.render_stubs(), protos.committed_stubs())
    assert differences == [], (
        "device_agent/_generated is out of date with protos/: run `python -m device_agent.protos` "
        f"and commit the result ({differences})"
    )


@needs_grpc_tools
def test_check_mode_reports_drift_and_regeneration_repairs_it(tmp_path):
    """Any number of .proto files, one importing another; edits, additions and removals are all caught."""
    root = tmp_path / "protos"
    (root / "acme/v1").mkdir(parents=True)
    (root / "acme/v1/common.proto").write_text('syntax = "proto3";\npackage acme.v1;\nmessage Id { string value = 1; }\n')
    (root / "acme/v1/job.proto").write_text(
        'syntax = "proto3";\npackage acme.v1;\nimport "acme/v1/common.proto";\n'
        "message Job { Id id = 1; }\nservice Jobs { rpc Get(Id) returns (Job); }\n"
    )
    out = tmp_path / "generated"

    changes = protos.write_stubs(root, out, package="generated")
    assert {name for _, name in changes} == {
        "__init__.py",
        "acme/__init__.py",
        "acme/v1/__init__.py",
        "acme/v1/common_pb2.py",
        "acme/v1/common_pb2_grpc.py",
        "acme/v1/job_pb2.py",
        "acme/v1/job_pb2_grpc.py",
    }
    assert protos.write_stubs(root, out, package="generated") == []  # idempotent: nothing rewritten
    assert "class JobsStub" in (out / "acme/v1/job_pb2_grpc.py").read_text()

    # The generated modules import each other within their package, never as top-level `acme`.
    assert "from generated.acme.v1 import common_pb2" in (out / "acme/v1/job_pb2.py").read_text()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from generated.acme.v1 import job_pb2
        print(job_pb2.Job(id={{"value": "x"}}).id.value)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "x"

    (root / "acme/v1/job.proto").write_text((root / "acme/v1/job.proto").read_text().replace("Id id = 1", "Id id = 2"))
    (root / "acme/v2").mkdir()
    (root / "acme/v2/extra.proto").write_text('syntax = "proto3";\npackage acme.v2;\nmessage Extra {}\n')
    assert set(protos.stub_differences(protos.render_stubs(root, "generated"), protos.committed_stubs(out))) == {
        ("differs", "acme/v1/job_pb2.py"),
        ("missing", "acme/v2/__init__.py"),
        ("missing", "acme/v2/extra_pb2.py"),
        ("missing", "acme/v2/extra_pb2_grpc.py"),
    }

    for name in ("common.proto", "job.proto"):
        (root / "acme/v1" / name).unlink()
    (out / "acme/v1/__pycache__").mkdir()
    (out / "acme/v1/__pycache__/job_pb2.cpython-311.pyc").write_bytes(b"stale")
    changes = protos.write_stubs(root, out, package="generated")
    assert ("stale", "acme/v1/job_pb2.py") in changes
    assert not (out / "acme/v1").exists()  # a package left without stubs goes, caches included
    assert sorted(protos.committed_stubs(out)) == [
        "__init__.py",
        "acme/__init__.py",
        "acme/v2/__init__.py",
        "acme/v2/extra_pb2.py",
        "acme/v2/extra_pb2_grpc.py",
    ]


def _requirements(group: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name.lower(): r for line in group}


def test_declared_runtimes_accept_the_committed_stubs():
    """Generated code refuses an older protobuf or grpcio than its generator: the base floors must cover it."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    base = _requirements(project["dependencies"])
    dev = _requirements(project["optional-dependencies"]["dev"])
    stubs = protos.committed_stubs()
    pb2 = [content.decode() for name, content in stubs.items() if name.endswith("_pb2.py")]
    assert pb2, "no generated *_pb2.py stubs"

    gencode = {Version(v) for text in pb2 for v in re.findall(r"^# Protobuf Python Version: (\S+)$", text, re.M)}
    assert len(gencode) == 1, gencode
    grpc_generated = Version(protos.stubs_grpc_version())
    for name, made_by in (("protobuf", gencode.pop()), ("grpcio", grpc_generated)):
        floors = [Version(s.version) for s in base[name].specifier if s.operator in (">=", "==", "~=")]
        assert floors and max(floors) >= made_by, f"{name} in dependencies must require >= {made_by}"
        assert base[name].specifier.contains(made_by), f"{name} in dependencies excludes {made_by}"
    assert str(dev["grpcio-tools"].specifier) == f"=={grpc_generated}", "pin the grpcio-tools that made the stubs"


def test_the_stubs_leave_the_top_level_name_poet_free():
    """The stubs import each other under device_agent._generated: `poet` is the paper's API, not the stubs'."""
    for name, content in protos.committed_stubs().items():
        for line in content.decode().splitlines():
            assert not re.match(r"(from|import) poet\b", line), f"{name}: {line}"
    script = "import device_agent.serde, sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'poet'))"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"  # loading the stubs imports no top-level `poet`


def test_a_generated_import_the_rewrite_cannot_move_is_refused():
    stubs = {"acme/v1/a_pb2.py": b"import acme.v1.b_pb2\n", "acme/v1/b_pb2.py": b""}
    with pytest.raises(protos.ProtoStubsMissingError, match="acme.v1.b_pb2"):
        protos._import_within(stubs["acme/v1/a_pb2.py"], stubs, "generated", "acme/v1/a_pb2.py")
