"""A pipelined run's export, written a stage at a time (pipeline/export.py), without a
network: the stages' weights arrive in any order, the built-in Llama comes out as one
safetensors file under the whole model's names (its head untied), any other model as a
file a stage; each stage's round and digest in the metadata. The same over real peers,
loaded in transformers: tests/e2e/test_pipeline_export.py (this file has another name:
pytest imports a test module by its file's name)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import parameters_in_order
from swarmloco.errors import SwarmlocoError
from swarmloco.pipeline.export import StagesWriter
from swarmloco.pipeline.manifest import pipeline_manifest, pipeline_of
from swarmloco.pipeline.stages import cut_llama, gpt_stages, renumbered, split_evenly
from swarmloco.runtime.export import Latest
from swarmloco.train.llama import Llama
from swarmloco.train.spec import GPTConfig, LlamaConfig

SPEC = RunSpec(sync_every=4, delay=1)
CREATOR = "ab" * 32
LLAMA = LlamaConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, n_kv_head=1, n_embd=16, ffn=32)


def weights(manifest, stages):
    """Each stage's flat state, as its swarm would hand it out."""
    pipeline = pipeline_of(manifest)
    assert pipeline is not None
    out = []
    for k, (stage, signature) in enumerate(zip(stages, pipeline.signatures, strict=True)):
        layout = signature.layout(SPEC.codec.block_size)
        theta = layout.gather(parameters_in_order(stage, signature.params), layout.zeros())
        out.append(Latest(theta, round=10 + k, digest=f"{k:02x}" * 32, source=f"peer {k}"))
    return out


def llama_run():
    """The small Llama cut in two, and its pipelined run's manifest."""
    torch.manual_seed(0)
    stages = cut_llama(Llama(LLAMA), 2)
    model = dataclasses.asdict(LLAMA)
    return stages, pipeline_manifest(SPEC, stages, creator=CREATOR, task="llama", model=model)


def test_a_pipelined_llama_is_written_as_one_model_a_stage_at_a_time_in_any_order(tmp_path):
    stages, manifest = llama_run()
    writer = StagesWriter(manifest, tmp_path)
    latest = weights(manifest, stages)
    writer.add(1, latest[1])  # the last stage's first: it came first
    with pytest.raises(SwarmlocoError, match=r"stages \[0\]"):
        writer.finish()
    writer.add(0, latest[0])
    done = writer.finish()
    assert done.rounds == (10, 11) and done.files == ("model.safetensors",)
    written = load_file(tmp_path / "model.safetensors")
    runs = split_evenly(LLAMA.n_layer, 2)
    for stage, layers in zip(stages, runs, strict=True):
        for name, p in stage.named_parameters():
            assert torch.equal(written.pop(renumbered(name, "model.layers", layers.start)), p)
    assert written == {}  # nothing else, and nothing twice (the head is its own: untied)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["stage_rounds"] == "10,11"
    assert metadata["stage_digests"] == ",".join(["00" * 32, "01" * 32])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 3
    assert (tmp_path / "manifest.json").read_bytes() == manifest.to_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]


def test_any_other_model_is_written_a_file_a_stage(tmp_path):
    stages = gpt_stages(GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, n_embd=16), 3)
    manifest = pipeline_manifest(SPEC, stages, creator=CREATOR, task="gpt-bytes")
    writer = StagesWriter(manifest, tmp_path)
    for k, latest in reversed(list(enumerate(weights(manifest, stages)))):
        writer.add(k, latest)
    done = writer.finish()
    assert done.files == tuple(f"stage-{k:02d}.safetensors" for k in range(3))
    for k, stage in enumerate(stages):
        written = load_file(tmp_path / done.files[k])
        assert written.keys() == dict(stage.named_parameters()).keys()
        assert all(torch.equal(written[n], p) for n, p in stage.named_parameters())
        with safe_open(tmp_path / done.files[k], "pt") as f:
            assert f.metadata()["round"] == str(10 + k)
    assert not (tmp_path / "config.json").exists()


def test_an_export_that_fails_halfway_leaves_no_partial_file(tmp_path):
    stages, manifest = llama_run()
    writer = StagesWriter(manifest, tmp_path)
    writer.add(0, weights(manifest, stages)[0])  # ... and stage 1 never comes
    assert [p.name for p in tmp_path.iterdir()] != []  # the file in the making
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SwarmlocoError, match="aborted"):
        writer.whole.finish({})  # type: ignore[union-attr]
