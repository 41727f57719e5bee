"""The checked-in generated code matches the .proto files and imports inside the package."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_regenerating_the_protos_changes_nothing():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_imports_from_inside_the_package():
    from swarmloco.proto.v1 import dht_pb2, dht_pb2_grpc

    assert dht_pb2.DESCRIPTOR.name == "swarmloco/v1/dht.proto"
    assert dht_pb2_grpc.DhtStub is not None
    for path in (REPO / "src" / "swarmloco" / "proto" / "v1").glob("*.py*"):
        assert "from swarmloco.v1 " not in path.read_text(), path
