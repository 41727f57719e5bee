"""scripts/bench_dht_read.py keeps working: a tiny run prints one JSON object with every
field, and each read finds every record the holding node was given."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_dht_read.py"


def test_a_tiny_benchmark_run_prints_one_json_object():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", "300", "--trials", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["settings"] == {"records": 300, "trials": 2, "probe_s": 0.005}
    assert [t["found"] for t in figures["trials"]] == [300, 300]
    assert figures["read_s"] > 0 and figures["loop_lag_max_s"] >= 0
    assert figures["machine"]["cpu_count"] >= 1
