"""scripts/bench_bandwidth.py keeps working: one peer behind a tc-shaped veth link in its own
network namespace, rounds with equal and with declared bandwidths (root only)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_bandwidth.py"

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="needs root, ip and tc (a network namespace)",
    ),
]


def test_a_slow_peer_that_declares_its_link_reduces_a_smaller_part():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--params", "300000", "--rounds", "1", "--mbit", "40"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["settings"]["slow_link_mbit"] == 40
    equal, declared, fast = out["equal"], out["declared"], out["declared_fast"]
    # Parts follow the declared bandwidths: 1/4 each; then 40 of 100+100+100+40 Mbit/s;
    # then 40 of 1000+1000+1000+40 (up to the codec's block rounding).
    assert equal["slow_peer_part"] == pytest.approx(0.25, abs=0.01)
    assert declared["slow_peer_part"] == pytest.approx(40 / 340, abs=0.01)
    assert fast["slow_peer_part"] == pytest.approx(40 / 3040, abs=0.01)
    # A smaller part is fewer bytes for the slow link to carry.
    assert equal["slow_peer_bytes_sent"] > declared["slow_peer_bytes_sent"]
    assert declared["slow_peer_bytes_sent"] > fast["slow_peer_bytes_sent"]
    for mode in ("declared", "declared_fast"):
        assert out[mode]["round_time_ratio_to_equal"] > 0
    # The namespace is gone.
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "swl-bw-" not in netns
