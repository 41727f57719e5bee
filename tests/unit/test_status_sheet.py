"""The status sheet alone: the value it builds passes the status record's schema."""

from __future__ import annotations

import math

from swarmloco.net.records import encode_value, status_key
from swarmloco.runtime.status import TIMELINE_ROUNDS, Counters, StatusSheet

SWARM = "ef" * 20


def counters(**change) -> Counters:
    fields = {
        "round": 12,
        "step": 340,
        "tokens": 340 * 512,
        "tokens_per_s": 2048.0,
        "rounds_applied": 11,
        "rounds_aborted": 1,
        "downloads": 0,
        "loss": 2.5,
        "eval_loss": 2.75,
        "at": 1_700_000_000.0,
    }
    return Counters(**(fields | change))


def test_the_value_carries_the_last_rounds_and_passes_the_schema():
    sheet = StatusSheet(name="host/abcdef" * 10, device="cpu", started_at=1_699_999_000.0)
    for r in range(1, 12):
        sheet.remember(round=r, group=3, seconds=1.5, payload_bytes=4096, bytes_sent=1100,
                       bytes_received=1200, ok=True, matchmaking_s=0.25)  # fmt: skip
    sheet.remember(round=12, group=0, seconds=30.0, payload_bytes=4096, ok=False)
    sheet.state, sheet.last_error = "training", "round 12 aborted: " + "x" * 500
    value = sheet.value(counters())
    assert value["state"] == "training"
    encode_value(status_key(SWARM), value)  # raises if any field is out of bounds
    rounds = value["rounds"]
    assert len(rounds) == TIMELINE_ROUNDS and [r["round"] for r in rounds] == list(range(5, 13))
    assert rounds[-1]["ok"] is False and rounds[-1]["bytes_sent"] == 0
    assert "matchmaking_s" not in rounds[-1] and rounds[0]["matchmaking_s"] == 0.25
    assert len(value["name"]) == 64 and len(value["last_error"]) == 240
    assert "fit" not in value and "mfu" not in value


def test_compute_gives_the_mfu_and_unknown_losses_are_left_out():
    sheet = StatusSheet(name="gpu-box", device="cuda:0 (NVIDIA H200)", started_at=0.0)
    sheet.describe_compute(fit="micro-batch 8 x 2", flops_per_token=6e9, peak_flops=1e15)
    value = sheet.value(counters(tokens_per_s=50_000.0, loss=math.nan, eval_loss=None))
    encode_value(status_key(SWARM), value)
    assert value["fit"] == "micro-batch 8 x 2" and math.isclose(value["mfu"], 0.3)
    assert "loss" not in value and "eval_loss" not in value
    # A rate the device cannot reach is shown as at most 1 (the schema's bound).
    assert sheet.value(counters(tokens_per_s=1e9))["mfu"] == 1.0
    assert "mfu" not in sheet.value(counters(tokens_per_s=0.0))
