"""Hugging Face: two processes of examples/hf_causal_lm.py (transformers' own Trainer with
the SwarmCallback) train one swarm, and `swarmloco export` hands back a directory that
`from_pretrained` loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from swarmutil import COMMAND, PeerProcess

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"


def test_two_trainer_processes_agree_and_the_export_loads_with_from_pretrained(tmp_path):
    rounds = 6
    common = ("--max-rounds", str(rounds), "--min-peers", "2")
    with PeerProcess.script(
        EXAMPLE, tmp_path / "a", "create", "--identity-work", "0", *common
    ) as a:
        ready = a.wait_for("ready", timeout=180)
        join = ("join", ready["swarm_id"], "--peer", ready["endpoint"], *common)
        with PeerProcess.script(EXAMPLE, tmp_path / "b", *join) as b:
            for p in (a, b):
                assert p.wait(240) == 0, p.log_tail()
    finals = {p.of("round")[-1]["digest"] for p in (a, b)}
    assert len(finals) == 1 and a.of("round")[-1]["round"] == rounds, finals
    assert max(e["group"] for e in b.of("round")) == 2
    # The creator waited for its partner (wait_for_peers): its first round is round 1, and
    # after train() the callback still names the swarm it trained with.
    assert a.of("round")[0]["round"] == 1 and a.of("round")[0]["group"] == 2
    assert any(f"left swarm {ready['swarm_id'][:12]} at round {rounds}" in line for line in a.log)
    # Both at the swarm's global step (rounds x H = 10), whatever steps each took.
    assert {p.of("round")[-1]["global_step"] for p in (a, b)} == {rounds * 10}

    out = tmp_path / "model"
    done = subprocess.run(
        [
            *COMMAND,
            "export",
            ready["swarm_id"],
            "--data-dir",
            str(tmp_path / "a"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"exported round {rounds}" in done.stdout
    assert finals.pop()[:16] in done.stdout  # the digest the swarm agreed on
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task"] == "custom" and manifest["model"]["config"]["n_layer"] == 2
    probe = (
        "import json, sys, torch; from transformers import GPT2LMHeadModel; "
        f"m, info = GPT2LMHeadModel.from_pretrained({str(out)!r}, output_loading_info=True); "
        "logits = m(torch.tensor([[1, 2, 3]])).logits; "
        "print(json.dumps({k: list(v) for k, v in info.items() if k != 'error_msgs'} | "
        "{'finite': bool(torch.isfinite(logits).all())}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr
    info = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert info["finite"] and not info["missing_keys"] and not info["unexpected_keys"], info
