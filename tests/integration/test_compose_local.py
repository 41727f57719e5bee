"""docker/compose.yaml's services, run as local processes by docker/run_local.py: the
bootstrap node, the run published through it, three peers and the dashboard, until round 1
with all three online."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def test_the_compose_files_commands_run_a_swarm_of_three_with_its_dashboard(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "docker" / "run_local.py"),
            *("--dir", str(tmp_path), "--until-round", "1", "--until-peers", "3"),
            # (Round 1 may come before the third peer is up on a busy machine: both wait.)
            *("--timeout", "240"),
            # Small rounds and keys without proofs for a test (RUN_OPTIONS is empty in
            # compose.yaml).
            *("--run-options", "--batch-size 4 --sync-every 8 --identity-work 0"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    logs = "".join(
        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "logs").glob("*"))
    )
    assert result.returncode == 0, result.stderr[-3000:] + logs
    summary = json.loads(result.stdout)
    assert summary["round"] >= 1 and summary["peers_online"] == 3, summary
    assert set(summary["exit_codes"]) == {"bootstrap", "peer1", "peer2", "peer3", "dashboard"}
    assert all(code == 0 for code in summary["exit_codes"].values()), summary
    # Each peer kept its key and a checkpoint in its own data volume.
    for name in ("peer1", "peer2", "peer3"):
        assert list((tmp_path / "data" / name / "swarms").glob("*/checkpoints/ckpt-*")), name
