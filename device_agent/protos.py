"""Access to the generated protobuf/gRPC modules for protos/poet/v1/*.proto.

Stubs are generated at build time (`make setup` runs `python -m device_agent.protos`) into
device_agent/_generated/. When they are missing and grpcio-tools is installed, they are
generated on first import, so a fresh editable checkout works either way.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

_PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED_DIR = _PACKAGE_DIR / "_generated"
PROTO_ROOT = _PACKAGE_DIR.parent / "protos"
PROTO_FILES = ("poet/v1/schedule.proto",)


class ProtoStubsMissingError(ImportError):
    """The generated stubs are absent and cannot be generated here."""


def generate_stubs() -> None:
    """Run protoc (from grpcio-tools) over every .proto into the generated directory."""
    try:
        from grpc_tools import protoc  # build-time dependency only
    except ImportError as missing:
        raise ProtoStubsMissingError(
            "protobuf stubs are not generated and grpcio-tools is not installed; "
            "run `make setup` (or `pip install grpcio-tools && python -m device_agent.protos`)"
        ) from missing
    import grpc_tools

    GENERATED_DIR.mkdir(exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={GENERATED_DIR}",
        f"--grpc_python_out={GENERATED_DIR}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise ProtoStubsMissingError(f"protoc failed on {protos}")
    for package_dir in {GENERATED_DIR / Path(p).parent for p in protos} | {GENERATED_DIR / "poet"}:
        (package_dir / "__init__.py").touch()


def load(module: str) -> ModuleType:
    """Import a generated module such as ``poet.v1.schedule_pb2``, generating stubs if needed."""
    if str(GENERATED_DIR) not in sys.path:
        sys.path.insert(0, str(GENERATED_DIR))
    target = GENERATED_DIR / (module.replace(".", "/") + ".py")
    if not target.exists():
        generate_stubs()
    importlib.invalidate_caches()
    return importlib.import_module(module)


if __name__ == "__main__":
    generate_stubs()
    print(f"generated stubs for {len(list(PROTO_ROOT.rglob('*.proto')))} proto file(s)")
