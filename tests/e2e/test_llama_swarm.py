"""A swarm of the built-in ``llama`` task: two `swarmloco join` processes end on one state
(one of them fitting its step to a memory budget), and `swarmloco export` hands back a
directory Hugging Face's ``LlamaForCausalLM`` loads, giving the logits of the peer's model
(docs/DESIGN.md, "Built-in tasks")."""

from __future__ import annotations

import json
import subprocess

import pytest
from swarmutil import COMMAND, Bootstrap, PeerProcess, load_export_in_transformers

pytestmark = pytest.mark.timeout(300)

# The peer's model from the exported weights beside Hugging Face's, on the same tokens.
PROBE = """
import json, sys, torch
from safetensors.torch import load_file
from swarmloco.train.tasks import get_task, run_from_manifest
from swarmloco.core.manifest import SwarmManifest
out = sys.argv[1]
manifest = SwarmManifest.from_bytes(open(out + "/manifest.json", "rb").read())
task, model_config, _, _ = run_from_manifest(manifest)
ours = task.build_model(model_config).eval()
missing, unexpected = ours.load_state_dict(load_file(out + "/model.safetensors"), strict=False)
if model_config["tie_embeddings"]:  # the head is the embedding: one tensor on file
    missing = [k for k in missing if k != "lm_head.weight"]
from transformers import LlamaForCausalLM
hf, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
g = torch.Generator().manual_seed(0)
x = torch.randint(0, model_config["vocab_size"], (2, 24), generator=g)
with torch.no_grad():
    gap = (hf.eval()(x).logits - ours(x)).abs().max().item()
print(json.dumps({"gap": gap, "missing": list(info["missing_keys"]) + list(missing),
                  "unexpected": list(info["unexpected_keys"]) + list(unexpected)}))
"""


def test_two_llama_peers_end_on_one_state_and_the_export_loads_in_transformers(tmp_path):
    rounds = 3
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--task", "llama")
        # Both stop at round 3: a round either averaged alone would leave two final states.
        common = ("--max-rounds", str(rounds), "--min-group", "2")
        with (
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "a", *common) as a,
            # b fits the step's 4 sequences to 40 MB: 2 at a time, accumulated twice.
            PeerProcess.join(
                swarm, boot.endpoint, tmp_path / "b", *common, "--memory-budget", "0.04"
            ) as b,
        ):
            for p in (a, b):
                assert p.wait(240) == 0, p.log_tail()
    finals = {p.of("round")[-1]["digest"] for p in (a, b)}
    assert len(finals) == 1 and a.of("round")[-1]["round"] == rounds, finals
    assert max(e["group"] for p in (a, b) for e in p.of("round")) == 2
    fitted, plain = b.of("ready")[0], a.of("ready")[0]
    assert (fitted["micro_batch"], fitted["grad_accum"], fitted["device"]) == (2, 2, "cpu")
    assert (plain["micro_batch"], plain["grad_accum"]) == (4, 1)
    assert "fitted to cpu: micro-batch 2 x 2 accumulated" in b.log_tail(200)

    out = tmp_path / "model"
    done = subprocess.run(
        [*COMMAND, "export", swarm, "--data-dir", str(tmp_path / "a"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert finals.pop()[:16] in done.stdout  # the digest the swarm agreed on
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    load_export_in_transformers(PROBE, out)
