"""scripts/bench_handoff.py keeps working: a tiny run prints one JSON object with every
field, and the look hands the newcomer the records of some keys, not all of them."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_handoff.py"


def test_a_tiny_benchmark_run_prints_one_json_object():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--keys", "200", "--contacts", "30", "--trials", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["settings"]["keys"] == 200 and figures["settings"]["contacts"] == 30
    assert figures["handoff_look_s"] > 0 and len(figures["handoff_look_s_all"]) == 2
    # 30 contacts, k = 20: the newcomer is among the 20 closest of some keys, not of all.
    assert 0 < figures["handoff_records"] < 200
    assert figures["machine"]["cpu_count"] >= 1
