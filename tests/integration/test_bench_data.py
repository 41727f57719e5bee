"""scripts/bench_data.py runs as documented at a toy size and says what it measured (its
figures are the benchmark's, not a test's: no speed is asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_data.py"


def test_the_data_bench_prepares_and_fetches_and_reports_both(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--megabytes", "0.5", "--vocab", "300", "--repeats", "1",
         "--shard-tokens", "50000", "--dir", str(tmp_path), "--parts", "prepare,fetch"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["bench"] == "data" and report["text_bytes"] >= 500_000
    assert report["shards"] > 1 and report["tokens"] * 2 == report["dataset_bytes"]
    for key in ("prepare_mb_per_s", "prepare_mb_per_s_per_core", "fetch_http_mb_per_s",
                "fetch_peer_mb_per_s", "fetch_local_mb_per_s"):  # fmt: skip
        assert report[key] > 0, key
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_the_data_bench_refuses_parts_it_lacks_and_a_squatter_listing_more_than_a_record_holds():
    refused = {
        ("--parts", "squat,x"): "unknown ['x']",
        ("--parts", "squat", "--squat-shards", "5"): "a leases record lists 4 at most",
        ("--parts", "churn", "--churn-box", "--churn-pipeline"): "a stage is served by one",
    }
    for args, said in refused.items():
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=110
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
