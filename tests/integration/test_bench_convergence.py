"""scripts/bench_convergence.py keeps working: tiny runs of its protocols print one JSON
object whose figures follow from one another."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_convergence.py"


def _run(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_scaling_protocol_tunes_data_parallel_and_keeps_each_worker_counts_best_cell(
    tmp_path,
):
    log = tmp_path / "runs.jsonl"
    out = _run(
        "--protocol", "scaling", "--model", "n_layer=1,n_head=2,n_embd=32,seq_len=32",
        "--tokens-per-param", "0.1", "--dp-batches", "4,8",
        "--sync-every", "4", "--eval-windows", "8", "--seeds", "0",
        "--worker-counts", "1,2", "--batch-multiples", "0.5,1", "--outer-lrs", "0.7",
        "--outer-momenta", "0.5", "--dp-lrs", "3e-3,6e-3", "--parallel", "2",
        "--runs-log", str(log),
    )  # fmt: skip
    assert out["protocol"] == "scaling" and out["seeds"] == [0] and out["sync_every"] == 4
    assert out["settings"]["model"]["n_embd"] == 32 and out["settings"]["model"]["n_layer"] == 1
    assert out["tokens"] == round(0.1 * out["settings"]["model_params"])
    dp = out["data_parallel"]
    assert [(c["batch"], c["lr"]) for c in dp["grid"]] == [
        (4, 3e-3), (4, 6e-3), (8, 3e-3), (8, 6e-3)
    ]  # fmt: skip
    assert dp["final_eval_loss"] == min(c["final_eval_loss"] for c in dp["grid"])
    b = dp["best_batch"]  # DiLoCo's batches in all are multiples of the winner's
    winner = min(dp["grid"], key=lambda c: c["final_eval_loss"])
    assert (b, dp["best_lr"]) == (winner["batch"], winner["lr"])
    for m in ("1", "2"):
        cell = out["by_workers"][m]
        assert len(cell["grid"]) == 2  # batch multiples 0.5 and 1, one outer lr
        assert cell["final_eval_loss"] == min(c["final_eval_loss"] for c in cell["grid"])
        assert cell["over_data_parallel"] == pytest.approx(
            cell["final_eval_loss"] / dp["final_eval_loss"]
        )
    # Every run, data-parallel (workers 0) and each cell, was logged as it finished.
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((r["workers"], r["batch_per_worker"]) for r in runs) == [
        (0, 4), (0, 4), (0, 8), (0, 8), (1, b // 2), (1, b), (2, b // 4), (2, b // 2)
    ]  # fmt: skip
    assert {(r["outer_momentum"], r["sync_every"]) for r in runs if r["workers"]} == {(0.5, 4)}
    assert not any("outer_lr" in r or "outer_momentum" in r for r in runs if not r["workers"])
    assert out["by_workers"]["1"]["best"]["outer_momentum"] == 0.5
    by_cell = {(r["workers"], r["batch_per_worker"]): r["final_eval_loss"] for r in runs}
    assert out["by_workers"]["2"]["final_eval_loss"] == min(by_cell[2, b // 4], by_cell[2, b // 2])
    assert isinstance(out["target_1_workers_at_most_1.0x_data_parallel"], bool)
    assert isinstance(out["target_2_workers_at_most_1.015x_data_parallel"], bool)


def test_a_grid_cut_short_resumes_from_its_runs_log(tmp_path):
    log = tmp_path / "runs.jsonl"
    grid = (
        "--protocol", "scaling", "--model", "n_layer=1,n_head=2,n_embd=32,seq_len=32",
        "--tokens-per-param", "0.1", "--dp-batches", "4", "--dp-lrs", "3e-3",
        "--sync-every", "4", "--eval-windows", "8", "--seeds", "0", "--worker-counts", "1",
        "--batch-multiples", "1", "--outer-momenta", "0.5", "--parallel", "1",
        "--runs-log", str(log),
    )  # fmt: skip
    first = _run(*grid, "--outer-lrs", "0.7")
    lines = log.read_text().splitlines()
    assert [json.loads(line)["workers"] for line in lines] == [0, 1]
    log.write_text(lines[0] + "\n")  # cut short after data-parallel
    again = _run(*grid, "--outer-lrs", "0.7,1.0", "--resume")
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    # Data-parallel came from the log; the lost cell ran again, the new one ran.
    assert [(r["workers"], r.get("outer_lr")) for r in runs] in (
        [(0, None), (1, 0.7), (1, 1.0)], [(0, None), (1, 1.0), (1, 0.7)]
    )  # fmt: skip
    assert again["data_parallel"]["final_eval_loss"] == first["data_parallel"]["final_eval_loss"]
    cell = next(c for c in again["by_workers"]["1"]["grid"] if c["outer_lr"] == 0.7)
    assert cell["final_eval_loss"] == first["by_workers"]["1"]["final_eval_loss"]
    assert runs[0]["model"]["n_embd"] == 32 and runs[0]["eval_windows"] == 8


def test_the_scaling_protocol_refuses_a_batch_the_workers_cannot_share():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--protocol", "scaling", "--dp-batches", "4,6",
         "--worker-counts", "4", "--batch-multiples", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "a batch of 6 cannot be shared by 4 workers" in result.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--outer-momentum", "0.5"], "tries every momentum of --outer-momenta"),
        (["--model", "n_layer"], "KEY=VALUE"),
        (["--model", "n_embd=wide"], "is not a number"),
        (["--model", "n_embd=30,n_head=4"], "divisible by n_head"),
        (["--dp-batches", "16,x"], "--dp-batches takes comma-separated numbers"),
        (["--outer-lrs", "0.7,0"], "--outer-lrs takes numbers above 0"),
        (["--resume"], "--resume takes its finished runs from --runs-log"),
    ],
)
def test_the_scaling_protocol_says_what_is_wrong_with_its_flags(flags, says):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--protocol", "scaling", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and says in result.stderr, result.stderr


def test_the_warm_start_protocol_reports_every_ratio_over_its_arms():
    out = _run(
        "--steps", "16", "--warm-steps", "8", "--warmup", "2", "--sync-every", "4",
        "--batch-size", "2", "--eval-windows", "16", "--eval-every", "8", "--seeds", "0",
        "--arms", "sync,diloco_fp32,diloco_int8,single", "--parallel", "1",
    )  # fmt: skip
    assert out["protocol"] == "warm-start" and out["settings"]["warm_start_steps"] == 8
    sync, int8 = out["sync_final_eval_loss"], out["diloco_int8_final_eval_loss"]
    assert out["diloco_over_sync"] == pytest.approx(int8 / sync)
    assert out["int8_over_fp32"] == pytest.approx(int8 / out["diloco_fp32_final_eval_loss"])
    assert out["tokens"] == 8 * 4 * 2 * out["settings"]["seq_len"]


def test_the_warm_start_protocol_refuses_the_scaling_protocols_runs_log():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs-log", "runs.jsonl"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "are for --protocol scaling" in result.stderr
