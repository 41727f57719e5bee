"""scripts/bench_gpu.py, the command a lent GPU machine runs (scripts/gpu_check), runs on the
CPU at the tiny preset and says what it measured, so that it is ready the day a GPU is at
hand (its figures are the benchmark's: no speed is asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"


def test_the_gpu_bench_measures_the_inner_loop_and_two_peers_rounds_on_the_cpu(tmp_path):
    kept = tmp_path / "swarm"
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--rounds", "2", "--swarm-timeout", "240"),
            *("--swarm-dir", str(kept), "--out", str(tmp_path / "gpu.json")),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report == json.loads((tmp_path / "gpu.json").read_text())
    assert report["bench"] == "gpu" and report["machine"]["cuda"] is None
    # Without CUDA, what ran (not the GPU's defaults) is what the settings say.
    settings = report["settings"]
    assert (settings["presets"], settings["swarm_preset"], settings["sync_every"]) == (
        "tiny:4", "tiny", 10,
    )  # fmt: skip
    (mfu,) = report["mfu"]  # without CUDA: the tiny preset alone
    assert mfu["preset"] == "tiny" and mfu["steps"] == 3 and mfu["params"] > 0
    assert mfu["step_s_min"] <= mfu["step_s"] <= mfu["step_s_max"]
    assert mfu["tokens_per_s"] > 0 and mfu["flops_per_token"] > 0
    swarm = report["swarm"]
    assert swarm["exit_code"] == 0 and swarm["same_final_state"] is True, swarm
    assert [p["peer"] for p in swarm["per_peer"]] == ["peer0", "peer1"]
    for peer in swarm["per_peer"]:
        assert peer["rounds_applied"] == 2 and peer["measured_rounds"] >= 1, peer
        assert 0 < peer["train_share"] <= 1 and peer["stall_per_round_s"] >= 0, peer
        assert peer["gpu_busy"] is None  # (nvidia-smi's samples: on a GPU only)
    assert len({p["final_digest"] for p in swarm["per_peer"]}) == 1
    # The figures come again from the peers' kept events (--from-events, for a run whose
    # report was lost): the same ones.
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-events", str(kept)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    derived = json.loads(again.stdout)["per_peer"]
    for peer, from_events in zip(swarm["per_peer"], derived, strict=True):
        assert {k: from_events[k] for k in ("peer", "rounds_applied", "train_share")} == {
            k: peer[k] for k in ("peer", "rounds_applied", "train_share")
        }
    nothing = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-events", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert nothing.returncode == 2 and "no peer*.events in" in nothing.stderr, nothing.stderr
