"""Generate the Python gRPC stubs for ``protos/`` into ``arona_grpc/_gen``.

Runs grpc_tools' protoc with the mypy-protobuf plugins, then rewrites the
imports so that the generated code lives under the ``arona_grpc._gen``
package (``from arona.memory.v1 import`` becomes
``from arona_grpc._gen.arona.memory.v1 import``).

Usage: ``python scripts/gen_protos.py [OUT_DIR]`` (default ``arona_grpc/_gen``).
A test regenerates into a temporary folder and compares, so the checked-in
code can never go stale.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
DEFAULT_OUT = ROOT / "arona_grpc" / "_gen"
PACKAGE = "arona_grpc._gen"

_IMPORT = re.compile(r"^(from|import) arona\.", re.MULTILINE)


def _rewrite(text: str) -> str:
    return _IMPORT.sub(lambda m: f"{m.group(1)} {PACKAGE}.arona.", text)


def _plugin(name: str) -> str:
    # The plugins are installed beside the interpreter (the venv's bin/), which
    # need not be on PATH when the script is run as .venv/bin/python.
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: install mypy-protobuf")
    return found


def generate(out: Path) -> None:
    """Write the generated package (with ``__init__.py`` files) to ``out``."""
    protos = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={PROTOS}",
            f"--proto_path={Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={raw}",
            f"--mypy_grpc_out={raw}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / "__init__.py").write_text('"""Generated gRPC code; do not edit."""\n')
        for src in sorted(Path(raw).rglob("*")):
            if src.is_dir():
                continue
            dest = out / src.relative_to(raw)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(_rewrite(src.read_text()))
        for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
            init = folder / "__init__.py"
            if not init.exists():
                init.write_text("")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    generate(out)


if __name__ == "__main__":
    main()
