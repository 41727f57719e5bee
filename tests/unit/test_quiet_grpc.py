"""gRPC's core stays quiet in a peer's log (a peer that left, "Got goaway", is not news),
unless the operator asks for its messages."""

import os
import subprocess
import sys

SCRIPT = """
import os
import swarmloco  # first, as in a peer's process
import grpc  # reads GRPC_VERBOSITY once, when imported
grpc.aio.server()  # starts gRPC's core, which logs at the level it read
print(os.environ["GRPC_VERBOSITY"], flush=True)
"""


def run(**env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"} | env_extra
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env
    )


def test_grpc_logs_errors_only_unless_the_operator_says_otherwise():
    quiet = run()
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "ERROR" and quiet.stderr == ""
    # The operator's setting wins, and gRPC takes it (it warns about INFO in production).
    loud = run(GRPC_VERBOSITY="INFO")
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout.strip() == "INFO" and "Log level INFO" in loud.stderr, loud.stderr
