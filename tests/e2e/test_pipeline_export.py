"""A pipelined run of the built-in Llama exports as one model (docs/DESIGN.md section 10,
"Export"): while two `swarmloco join` peers serve its two stages, `swarmloco export RUN
--peer` takes each stage's latest state from its stage swarm and writes one
``model.safetensors`` that Hugging Face's ``LlamaForCausalLM`` loads, its head untied, with
the logits the two stages compute in turn. From one peer's data directory alone, the stage
that peer never served is named."""

from __future__ import annotations

import json
import subprocess

import pytest
from swarmutil import COMMAND, Bootstrap, PeerProcess, load_export_in_transformers

pytestmark = pytest.mark.timeout(420)

# The two stages, built as a stage peer builds them and loaded from the export under their
# own names, in turn, beside Hugging Face's model of the exported directory.
PROBE = """
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
from swarmloco.core.config import from_mapping
from swarmloco.core.manifest import SwarmManifest
from swarmloco.pipeline.stages import build_stage, renumbered, split_evenly
from swarmloco.train.spec import LlamaConfig
from swarmloco.train.tasks import run_from_manifest
out = sys.argv[1]
manifest = SwarmManifest.from_bytes(open(out + "/manifest.json", "rb").read())
_, model, _, _ = run_from_manifest(manifest)
config = from_mapping(LlamaConfig, model)
weights = load_file(out + "/model.safetensors")
with safe_open(out + "/model.safetensors", "pt") as f:
    metadata = f.metadata()
stages = []
for k, layers in enumerate(split_evenly(config.n_layer, 2)):
    stage = build_stage(config, 2, k, seed=0).eval()
    names = [n for n, _ in stage.named_parameters()]
    stage.load_state_dict({n: weights[renumbered(n, "model.layers", layers.start)] for n in names})
    stages.append(stage)
from transformers import LlamaForCausalLM
hf, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
g = torch.Generator().manual_seed(0)
x = torch.randint(0, config.vocab_size, (2, 24), generator=g)
with torch.no_grad():
    piped = stages[1](stages[0](x))
    gap = (hf.eval()(x).logits - piped).abs().max().item()
tied = bool(torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]))
print(json.dumps({"gap": gap, "missing": list(info["missing_keys"]),
                  "unexpected": list(info["unexpected_keys"]), "tied": tied,
                  "metadata": metadata, "names": len(weights)}))
"""


def test_a_pipelined_llama_exports_as_one_model_that_transformers_loads(tmp_path):
    with Bootstrap(tmp_path / "boot") as boot:
        run = PeerProcess.publish(
            tmp_path / "creator", boot.endpoint, "--task", "llama", "--stages", "2"
        )
        with PeerProcess.join(run, boot.endpoint, tmp_path / "s1") as s1:
            s1.wait_for("ready", timeout=120)  # its record: the next peer takes stage 0
            with PeerProcess.join(run, boot.endpoint, tmp_path / "s0") as s0:
                for p in (s0, s1):
                    p.wait_for("round", lambda e: e["round"] >= 2, timeout=240)
                out = tmp_path / "model"
                done = subprocess.run(
                    [*COMMAND, "export", run, "--peer", boot.endpoint, "--out", str(out),
                     "--timeout", "120"],
                    capture_output=True, text=True, timeout=200,
                )  # fmt: skip
                for p in (s0, s1):
                    assert p.stop() == 0, p.log_tail()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported the 2 stages of run" in done.stdout, done.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    # Each stage's round and digest: one its peer published for that round.
    published = [{e["round"]: e["digest"] for e in p.of("round")} for p in (s0, s1)]
    # From one peer's data directory alone: the stage it never served is named.
    alone = subprocess.run(
        [*COMMAND, "export", run, "--data-dir", str(tmp_path / "s0"), "--out",
         str(tmp_path / "partial")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert alone.returncode != 0
    assert "holds no checkpoint of stage 1" in alone.stderr and "--peer" in alone.stderr
    found = load_export_in_transformers(PROBE, out)
    assert not found["tied"]  # the last stage trained its own head
    rounds = [int(r) for r in found["metadata"]["stage_rounds"].split(",")]
    digests = found["metadata"]["stage_digests"].split(",")
    for k in (0, 1):
        assert published[k][rounds[k]] == digests[k], (k, rounds, published[k])
