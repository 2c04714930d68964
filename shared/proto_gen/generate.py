"""Regenerates the stubs in this package from every ``proto/*.proto``.

protoc writes ``import x_pb2 as x__pb2``, which only works with this folder on sys.path;
the imports are rewritten to ``from shared.proto_gen import x_pb2 as x__pb2`` so the stubs
import as a normal package.

    python -m shared.proto_gen.generate            # into shared/proto_gen
    python -m shared.proto_gen.generate OUT_DIR    # elsewhere (the freshness test does this)
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

PACKAGE = "shared.proto_gen"
HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_BARE_IMPORT = re.compile(r"^import (\w+_pb2(?:_grpc)?) as (\w+)$", re.MULTILINE)


def generated_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def generate(out_dir: Path = HERE, proto_dir: Path = PROTO_DIR) -> list[Path]:
    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {proto_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    # protoc runs in its own process: its extension bundles a libprotobuf that crashes
    # processes which also load NIXL's bundled one (it is a build tool, never a library).
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}",
            *(str(p) for p in protos),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}:\n{result.stderr}")
    files = generated_files(out_dir)
    for path in files:
        text = path.read_text()
        path.write_text(_BARE_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text))
    return files


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for written in generate(target):
        print(written)
