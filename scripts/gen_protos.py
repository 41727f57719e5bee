#!/usr/bin/env python3
"""Generate the Python code of proto/swarmloco/v1/*.proto into src/swarmloco/proto/v1/.

The generated files are checked in, so that `pip install .` works without grpcio-tools.
protoc writes absolute imports for the proto package (`from swarmloco.v1 import x_pb2`);
this script rewrites them to `swarmloco.proto.v1` so that they resolve inside our package.
The descriptors keep their proto file names (swarmloco/v1/x.proto), which is what gRPC
server reflection shows.

    python scripts/gen_protos.py           # regenerate
    python scripts/gen_protos.py --check   # exit 1 if the checked-in files are stale

Regeneration is byte-for-byte reproducible with the grpcio-tools version pinned in the
dev extra of pyproject.toml.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO_PACKAGE = "swarmloco/v1"
OUT_DIR = REPO / "src" / "swarmloco" / "proto" / "v1"
PYTHON_PACKAGE = "swarmloco.proto.v1"

_INIT_TEXT = '"""Generated protobuf and gRPC code of the swarmloco.v1 wire contract."""\n'

# `from swarmloco.v1 import x_pb2 as ...` (grpc code, stubs) and `import swarmloco.v1.x_pb2`.
_IMPORT_FROM = re.compile(r"^from swarmloco\.v1 import ", re.MULTILINE)
_IMPORT_MODULE = re.compile(r"^import swarmloco\.v1\.", re.MULTILINE)


def _fix_imports(text: str) -> str:
    text = _IMPORT_FROM.sub(f"from {PYTHON_PACKAGE} import ", text)
    return _IMPORT_MODULE.sub(f"import {PYTHON_PACKAGE}.", text)


def generate() -> dict[str, bytes]:
    """Run protoc on every .proto of the package; return {file name: contents}."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(
        p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto")
    )
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE}")
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see above)")
        files = {"__init__.py": _INIT_TEXT.encode()}
        for path in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            files[path.name] = _fix_imports(path.read_text(encoding="utf-8")).encode()
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    files = generate()
    if args.check:
        present = {p.name for p in OUT_DIR.glob("*") if p.is_file()}
        stale = sorted(
            name
            for name in set(files) | present
            if name not in files
            or not (OUT_DIR / name).is_file()
            or (OUT_DIR / name).read_bytes() != files[name]
        )
        if stale:
            print(
                f"stale generated files in {OUT_DIR}: {', '.join(stale)}; "
                "run scripts/gen_protos.py",
                file=sys.stderr,
            )
            return 1
        print(f"{len(files)} generated files are up to date")
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for stale_file in OUT_DIR.glob("*"):
        if stale_file.is_file() and stale_file.name not in files:
            stale_file.unlink()
    for name, data in files.items():
        (OUT_DIR / name).write_bytes(data)
    (OUT_DIR.parent / "__init__.py").write_bytes(
        b'"""Generated wire-contract code (see scripts/gen_protos.py); do not edit."""\n'
    )
    print(f"wrote {len(files)} files to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
