"""scripts/bench_pipeline.py runs as documented at a toy size and says what it measured
(its figures are the benchmark's, not a test's: no speed is asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_pipeline.py"


def test_the_pipeline_bench_prints_each_arm_and_the_ratios():
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--micro-batches", "3", "--repeats", "1"),
            *("--parts", "wiring,inflight,activations,kill,memory,scaling"),  # parity: below
            *("--in-flight-counts", "1,3", "--inflight-step-samples", "8"),
            *("--layers", "2", "--width", "32", "--seq-len", "16"),
            *("--scaling-widths", "64,128", "--scaling-layers", "1"),
            *("--loss-micro-batches", "6", "--loss-window", "2", "--kill-trials", "1"),
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
    assert report["stochastic_over_fixed"] == report["measured_over_fixed"]
    # Three micro-batches of 4 sequences at once: each replica admits a step's 8, so its
    # one step is on 8 sequences, not 12.
    for count in ("1", "3"):
        (run,) = report["inflight"][count]["runs"]
        assert run["micro_batches_per_s"] > 0 and run["steps"] == 2, report["inflight"]
    assert report["inflight_step_samples_max"] == 8 and report["inflight_speedup"] > 0
    # int8 against f32: the same micro-batches, a quarter of the bytes (a ratio of sizes:
    # exact, whatever the machine), and losses that both trained.
    assert 0.2 < report["activation_bytes_ratio"] < 0.27, report["activations"]
    for encoding in ("f32", "int8"):
        assert report["activations"][encoding]["loss_last"] > 0
    assert report["activation_loss_ratio"] > 0
    # The replica process was SIGKILLed with a forward on it; the micro-batches went on.
    (trial,) = report["kill"]["trials"]
    assert trial["killed"] and report["kill_trials"] == 1 and report["kill_hangs"] == 0, trial
    assert trial["retry_s"] is not None and trial["retry_s"] > 0, trial
    # A stage holds about half of the model's parameters, gradients and moments.
    assert 0.4 < report["stage_state_bytes_ratio"] < 0.8, report["memory"]
    # The square-cube law's two sides at one middle stage: traffic in proportion to the
    # width (int8 tensors: exact up to their headers), parameters with about its square;
    # the compute is timed (its growth is the bench's figure at real widths, not a test's).
    narrow, wide = report["scaling"]["widths"]
    assert report["scaling_width_ratio"] == 2.0
    for side in ("bytes_in", "bytes_out"):
        assert 1.98 < wide[side] / narrow[side] < 2.02, report["scaling"]
    assert 3.0 < wide["stage_params"] / narrow["stage_params"] < 4.0, report["scaling"]
    assert all(w["compute_s"] > 0 and w["compute_over_transfer"] > 0 for w in (narrow, wide))


@pytest.mark.timeout(600)
def test_two_stages_of_two_replicas_train_to_the_loss_of_data_parallel_diloco():
    # The parity: 2 stages x 2 replicas against two data-parallel DiLoCo peers on
    # the same micro-batches, spec and initial weights; the tolerance is the bench's for
    # one run of each (1.10; 1.05 for the median of three).
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--parts", "parity", "--parity-repeats", "1"),
            *("--layers", "2", "--width", "64", "--seq-len", "64"),
        ],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (run,) = report["parity"]["runs"]
    untrained = report["parity"]["untrained_loss"]
    for arm in ("pipeline", "diloco"):  # both trained (ln 256 = 5.55 untrained)
        assert run[arm]["held_out_loss"] < untrained - 1.5, run
    assert run["pipeline"]["lost_micro_batches"] == 0, run
    # Replicas that averaged together hold one digest after each such round, always.
    for swarm in (run["pipeline"]["stage0"], run["pipeline"]["stage1"], run["diloco"]["peers"]):
        assert swarm["one_digest"] or not swarm["rounds_together"], run
    # The replicas of each stage averaged together, and so did the data-parallel peers
    # (stage 1's once never did: two replicas whose attempts aborted each told the other
    # that the round formed; DESIGN section 5, "Latecomers").
    for swarm in (run["pipeline"]["stage0"], run["pipeline"]["stage1"], run["diloco"]["peers"]):
        assert swarm["rounds_together"] >= 2, run
    assert report["pipeline_over_diloco"] <= report["parity_tolerance"] == 1.10, run
