import json
import subprocess
import sys

import pytest


def _simulate(*extra: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmloco",
            "simulate",
            "--preset",
            "tiny",
            "--workers",
            "2",
            "--batch-size",
            "4",
            "--eval-every",
            "10",
            "--no-progress",
            "--lr",
            "3e-3",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_short_simulation_lowers_eval_loss():
    summary = _simulate("--steps", "40", "--sync-every", "10")
    for name, arm in summary["arms"].items():
        curve = [loss for _, loss in arm["eval_curve"]]
        assert curve[0] > 5.0, name  # ln(256) = 5.55 at initialisation
        assert curve[-1] < curve[0] - 1.0, (name, curve)
    assert summary["arms"]["diloco-int8"]["outer_rounds"] == 4
    assert summary["tokens"] == 2 * 40 * 4 * 128
    assert summary["arms"]["sync"]["tokens"] == summary["tokens"]


def test_streaming_simulation_lowers_eval_loss():
    summary = _simulate(
        "--steps",
        "40",
        "--sync-every",
        "10",
        "--fragments",
        "3",
        "--delay",
        "2",
        "--alpha",
        "0.5",
        "--exchange",
        "fp32",
        "--no-baseline",
    )
    arm = summary["arms"]["diloco-fp32-F3"]
    curve = [loss for _, loss in arm["eval_curve"]]
    assert curve[-1] < curve[0] - 1.0
    # Offsets 3, 6 and 0 (mod 10): 4 syncs each in 40 steps, plus a final sync of the two
    # fragments that trained after their last one (steps 34-40 and 37-40).
    assert arm["outer_rounds"] == 14


def test_bf16_simulation_lowers_eval_loss():
    summary = _simulate(
        "--steps", "20", "--sync-every", "10", "--precision", "bf16", "--no-baseline"
    )
    assert summary["precision"] == "bf16"
    curve = [loss for _, loss in summary["arms"]["diloco-int8"]["eval_curve"]]
    assert curve[-1] < curve[0] - 1.0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--delay", "10", "--sync-every", "10"], "delay (10) must be shorter"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--data", "/no/such/dir"], "does not exist"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
    ],
)
def test_bad_options_exit_with_a_clear_message(args, message):
    out = subprocess.run(
        [sys.executable, "-m", "swarmloco", "simulate", "--steps", "2", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_a_sweep_from_a_warm_start_ranks_every_h_and_outer_lr():
    summary = _simulate(
        "--steps",
        "16",
        "--warm-start",
        "8",
        "--sweep",
        "--sweep-sync-every",
        "4,8",
        "--sweep-outer-lr",
        "0.5,1.0",
        "--sweep-outer-momentum",
        "0.5,0.9",
        "--exchange",
        "fp32",
    )
    assert summary["warm_start_steps"] == 8
    rows = summary["sweep"]
    assert {(r["sync_every"], r["outer_lr"], r["outer_momentum"]) for r in rows} == {
        (h, lr, mu) for h in (4, 8) for lr in (0.5, 1.0) for mu in (0.5, 0.9)
    }
    losses = [r["final_eval_loss"] for r in rows]
    assert losses == sorted(losses) and summary["best"] == rows[0]
    assert len(set(losses)) == 8  # the grid's settings really differ
    for r in rows:
        assert r["over_sync"] == r["final_eval_loss"] / summary["arms"]["sync"]["final_eval_loss"]
    # Every arm trained the schedule's last 8 steps from the warm start's model: the
    # curves start at the same loss, below the initial model's (ln 256 = 5.55).
    starts = {arm["eval_curve"][0][1] for arm in summary["arms"].values()}
    assert len(starts) == 1 and starts.pop() < 5.5
    for name, arm in summary["arms"].items():
        assert arm["eval_curve"][-1][0] == 8, name
    assert summary["arms"]["diloco-fp32-H4-lr0.5-m0.9"]["outer_rounds"] == 2
