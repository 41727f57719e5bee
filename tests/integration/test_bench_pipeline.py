"""scripts/bench_pipeline.py runs as documented at a toy size and says what it measured
(its figures are the benchmark's, not a test's: no speed is asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_pipeline.py"


def test_the_pipeline_bench_prints_each_arm_and_the_ratios():
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--micro-batches", "3", "--repeats", "1"),
            *("--layers", "2", "--width", "32", "--seq-len", "16"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["bench"] == "pipeline" and report["settings"]["drivers"] == 2
    for arm in ("fixed", "uniform", "measured"):
        (run,) = report[arm]["runs"]
        assert run["micro_batches_per_s"] > 0 and 0 <= run["fast_share"] <= 1, report
    assert report["measured_over_uniform"] > 0 and report["measured_over_fixed"] > 0
    assert report["fast_compute_s"] > 0 and report["settings"]["slow_s"] > 0  # 3x by default
