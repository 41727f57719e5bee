"""scripts/bench_dht_load.py keeps working: a tiny run prints one JSON object with every
field; each read finds every record the node was given, and the flood's records are
checked or refused, and the honest peer's stores answered."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_dht_load.py"


def test_a_tiny_benchmark_run_prints_one_json_object():
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--records", "300", "--trials", "2", "--flood-seconds", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["settings"]["records"] == 300 and figures["settings"]["trials"] == 2
    read = figures["first_read"]
    assert [t["found"] for t in read["trials"]] == [300, 300]
    assert read["read_s"] > 0 and read["loop_lag_max_s"] >= 0
    flood = figures["store_flood"]
    assert flood["flood_records_sent"] > 0 and flood["flood_bytes_sent"] > 0
    assert 0 < flood["flood_checks"] <= flood["flood_records_sent"]
    assert flood["honest_stores"] >= 1 and flood["node_cpu_s"] > 0
    assert figures["machine"]["cpu_count"] >= 1
