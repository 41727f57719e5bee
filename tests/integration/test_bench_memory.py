"""A peer's host memory stays within its budget through rounds, checkpoints and a download:
``scripts/bench_memory.py`` with two real ``swarmloco join`` processes of the llama ``20m``
preset (18.5M parameters), the second downloading the state from the first, each
resident set sampled against its events (DESIGN section 6, "Host memory").

The budget is issue 34's, 12 bytes a parameter beyond the model and its inner optimizer,
plus a fixed margin: a peer process carries the gRPC runtime, its threads, the codec's
compiled kernels and a round's messages besides, 170 to 230 MB whatever the model (9 to 12
bytes a parameter at this size; at 135M the same peers hold 12.1 in all). The state before
the memory work held 38 bytes a parameter more than the loop (the donor's two copies, fp32
round buffers, the checkpoint's copy of the whole state: 50 at this size); a regression to
those fails here. What the DiLoCo state allocates is held to 10 bytes a parameter exactly
in ``tests/unit/test_diloco_memory.py``. Nothing is timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_memory.py"
PARAMS = 18_485_504
FIXED_MB = 300
"""What a peer process holds beyond the model's state whatever its size, with room (170 to
230 MB measured at 20m and 135m, 2026-12-05)."""
BUDGET = 12 + FIXED_MB * 2**20 / PARAMS
"""Bytes a parameter beyond the plain loop (29 at this size; 22.9 measured)."""
PHASE_RISE = 80 * 2**20 / PARAMS
"""How far a round, a checkpoint or a download may take a peer above its own peak between
rounds, in bytes a parameter: 80 MB (4.5 at this size) for what is the same at any size, a
few chunks and slabs of a few MB in flight; a copy of the state is 8 bytes a parameter
(148 MB) and more. Measured: up to 2.0 (37 MB), in the checkpoint's window."""

pytestmark = pytest.mark.timeout(400)


def test_rounds_a_checkpoint_each_and_a_download_stay_within_the_memory_budget(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "20m", "--peers", "2", "--rounds", "3",
         "--sync-every", "4", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["params"] == PARAMS and report["exit_codes"] == [0, 0], report
    donor, joiner = report["peers"]
    assert donor["rounds_applied"] >= 3 and joiner["rounds_applied"] >= 3, report["peers"]
    assert joiner["peak_in_download_mb"] is not None, joiner  # it downloaded the state
    assert all(p["peak_in_checkpoint_mb"] is not None for p in report["peers"])
    assert report["host_bytes_per_param_overhead"] <= BUDGET, report
    rises = report["phase_peak_over_between_bytes_per_param"]
    assert set(rises) == {"round", "checkpoint", "download"}, rises
    assert all(rise <= PHASE_RISE for rise in rises.values()), rises
