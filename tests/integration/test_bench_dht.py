"""scripts/bench_dht.py keeps working: a tiny run prints one JSON object with every field."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_dht.py"


def test_a_tiny_benchmark_run_prints_one_json_object():
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--sim-nodes",
            "30",
            "--sim-records",
            "5",
            "--nodes",
            "3",
            "--operations",
            "3",
            "--skip-hivemind",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    for field in (
        "lookup_success_rate",
        "median_hops",
        "swarmloco_get_ms_median",
        "swarmloco_node_start_s",
        "swarmloco_node_rss_mb",
        "hivemind_available",
        "machine",
        "settings",
    ):
        assert field in figures, field
    assert figures["lookup_success_rate"] == 1.0
    assert figures["swarmloco_bootstrap_imports_torch"] is False
    assert figures["hivemind_available"] is False and figures["hivemind_error"]
