"""A pipeline stage built alone (pipeline/stages.py ``build_gpt_stage``, the daemon's
``task_stage``): every peer builds the same weights from the seed and the names, they
follow GPT's initial distribution, the last stage's head starts as stage 0's embedding,
the creator's signatures are what each peer builds, and a peer of one stage of a model
far larger than its memory never holds more than its stage."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from swarmloco.errors import SwarmlocoError
from swarmloco.pipeline.daemon import _work, build_pipeline_manifest, task_stage
from swarmloco.pipeline.manifest import pipeline_of, stage_signatures
from swarmloco.pipeline.stages import (
    LlamaStage,
    build_gpt_stage,
    build_stage,
    cut_llama,
    split_evenly,
)
from swarmloco.train.llama import Llama, rotary_tables
from swarmloco.train.spec import GPTConfig, LlamaConfig
from swarmloco.train.tasks import build_manifest, run_from_manifest

CONFIG = GPTConfig(vocab_size=256, seq_len=32, n_layer=6, n_head=4, n_embd=64)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_every_peer_builds_the_same_stage_from_the_seed_and_another_seed_another():
    for k in range(3):
        mine, theirs = build_gpt_stage(CONFIG, 3, k, seed=5), build_gpt_stage(CONFIG, 3, k, seed=5)
        other = build_gpt_stage(CONFIG, 3, k, seed=6)
        a, b, c = weights(mine), weights(theirs), weights(other)
        assert a.keys() == b.keys() == c.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
            if ".ln" not in f".{name}":
                assert not torch.equal(a[name], c[name]), name


def test_a_stage_has_the_gpts_initial_distribution_and_the_head_starts_as_the_embedding():
    stages = [build_gpt_stage(CONFIG, 2, k, seed=1) for k in range(2)]
    scaled = 0.02 / math.sqrt(2 * CONFIG.n_layer)
    for stage in stages:
        for name, p in stage.named_parameters():
            if ".ln" in f".{name}":
                assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
            elif name.endswith(("proj.weight", "down.weight")):
                assert p.std().item() == pytest.approx(scaled, rel=0.1), name
            else:
                assert p.std().item() == pytest.approx(0.02, rel=0.1), name
    assert torch.equal(stages[1].head, stages[0].wte.weight)
    # Two blocks of the same stage, and the same block in two runs' cuts, differ: each
    # parameter is named by its place in the whole model.
    assert not torch.equal(stages[0].blocks[0].mlp.up.weight, stages[0].blocks[1].mlp.up.weight)
    assert split_evenly(CONFIG.n_layer, 2)[1].start == 3
    # Together they are a model: an untrained byte model's loss is about ln 256.
    x, y = torch.randint(0, 256, (2, 2, CONFIG.seq_len))
    with torch.no_grad():
        loss = stages[1](stages[0](x), y)
    assert float(loss) == pytest.approx(math.log(256), rel=0.02)


@pytest.mark.parametrize("task", ["gpt-bytes", "llama"])
def test_the_creators_signatures_are_what_each_peer_builds(task):
    creator = "ab" * 32
    _, _, _, run = run_from_manifest(build_manifest(task, "tiny", creator=creator))
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, delay=1))
    manifest = build_pipeline_manifest(task, "tiny", 2, creator=creator, run=run)
    pipeline = pipeline_of(manifest)
    assert pipeline is not None
    task, model, _, run = run_from_manifest(manifest)
    for k in range(2):
        built = task_stage(task, model, run, 2, k)
        (signature,) = stage_signatures(run.spec, [built], task.layer_unit)
        assert signature == pipeline.signatures[k]


LLAMA = LlamaConfig(
    vocab_size=256, seq_len=32, n_layer=5, n_head=4, n_kv_head=2, n_embd=64, ffn=176
)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_llama_cut_in_stages_computes_what_the_whole_llama_computes(stages):
    torch.manual_seed(0)
    whole = Llama(LLAMA)
    cut = cut_llama(whole, stages)
    x, y = torch.randint(0, 256, (2, 3, LLAMA.seq_len))
    loss = whole(x, y)
    loss.backward()
    h = x
    for stage in cut[:-1]:
        h = stage(h)
    cut_loss = cut[-1](h, y)
    cut_loss.backward()
    torch.testing.assert_close(cut_loss, loss, rtol=1e-6, atol=1e-6)
    # Every layer's gradients are the whole model's (the embedding's is split: tied in the
    # whole model, the head and the embedding are two copies once cut).
    layers = [layer for stage in cut for layer in stage.model.layers]
    for mine, ref in zip(layers, whole.model.layers, strict=True):
        for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    embedding = cut[0].model.embed_tokens.weight.grad + cut[-1].lm_head.weight.grad
    torch.testing.assert_close(
        embedding, whole.model.embed_tokens.weight.grad, rtol=1e-5, atol=1e-7
    )
    assert [len(stage.model.layers) for stage in cut] == [len(r) for r in split_evenly(5, stages)]


def test_a_llama_stage_built_alone_has_llamas_names_distribution_and_rotary_tables():
    stages = [build_stage(LLAMA, 2, k, seed=4) for k in range(2)]
    assert all(isinstance(stage, LlamaStage) for stage in stages)
    again = build_stage(LLAMA, 2, 1, seed=4)
    for (name, p), q in zip(stages[1].named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.norm.weight" in names
    scaled = 0.02 / math.sqrt(2 * LLAMA.n_layer)
    for stage in stages:
        for name, p in stage.named_parameters():
            if "norm" in name:
                assert torch.all(p == 1.0), name
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert p.std().item() == pytest.approx(scaled, rel=0.15), name
            else:
                assert p.std().item() == pytest.approx(0.02, rel=0.15), name
        cos, sin = rotary_tables(LLAMA)
        assert torch.equal(stage.rope_cos, cos) and torch.equal(stage.rope_sin, sin)
    assert torch.equal(stages[1].lm_head.weight, stages[0].model.embed_tokens.weight)
    x, y = torch.randint(0, 256, (2, 2, LLAMA.seq_len))
    with torch.no_grad():
        loss = stages[1](stages[0](x), y)
    assert float(loss) == pytest.approx(math.log(256), rel=0.02)


BUILD_THE_LAST_STAGE = """
import resource, sys, torch
from swarmloco.pipeline.stages import build_gpt_stage
from swarmloco.train.spec import GPTConfig
torch.set_num_threads(1)
config = GPTConfig(vocab_size=256, seq_len=128, n_layer=24, n_head=16, n_embd=2048)
stage = build_gpt_stage(config, 24, 23, seed=0)
params = sum(p.numel() for p in stage.parameters())
print(params, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_a_stage_of_a_model_bigger_than_the_peers_memory_is_built_within_the_stages():
    # 24 blocks of 2048: 1.2B parameters, 4.8 GB in fp32. The last stage of 24 is one
    # block and the head: 51M parameters, 0.2 GB.
    whole = 24 * 12 * 2048**2 + (256 + 128) * 2048
    # Scratch of over 1 MiB is mapped and given back when freed (glibc's threshold moves
    # up with what is freed otherwise): the peak is what the build holds, not heap slack.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run(
        [sys.executable, "-c", BUILD_THE_LAST_STAGE],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    params, peak = (int(x) for x in done.stdout.split())
    assert params == 12 * 2048**2 + 256 * 2048 + 2 * 2048 + 2 * 2 * 2048
    # The process's peak: the interpreter and torch, the stage, one parameter's scratch
    # (0.58 GB here); half the whole model's bytes at most, whatever the allocator keeps
    # (one loaded run saw 1.44 GB): the whole model is never built.
    assert peak < 4 * params + 1.5e9, (peak, params)
    assert peak < 0.5 * 4 * whole, (peak, whole)


def first_llama_stage() -> tuple[torch.nn.Module, Mapping[str, Any], Any]:
    """Stage 0 of a two-stage tiny Llama run: the module, the model's config, the run."""
    creator = "ab" * 32
    _, _, _, run = run_from_manifest(build_manifest("llama", "tiny", creator=creator))
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, delay=1))
    manifest = build_pipeline_manifest("llama", "tiny", 2, creator=creator, run=run)
    task, model, _, run = run_from_manifest(manifest)
    return task_stage(task, model, run, 2, 0), model, run


def test_a_stage_computes_as_the_peer_chooses_bf16_or_fp32_never_fp16():
    """The run's precision (auto: bf16 autocast on a GPU, fp32 on the CPU), or the peer's
    --precision; fp16 would need a loss scale across the stages and is refused."""
    stage, model, run = first_llama_stage()
    assert _work(stage, model, run, "auto", 2).autocast is None  # on the CPU
    assert _work(stage, model, run, "fp32", 2).autocast is None
    assert _work(stage, model, run, "bf16", 2).autocast is torch.bfloat16
    with pytest.raises(SwarmlocoError, match="fp16"):
        _work(stage, model, run, "fp16", 2)


def test_a_step_holds_a_micro_batch_a_stage_where_its_batch_allows():
    """Micro-batches of 4 to 8 sequences (fewer only when the batch is), at least as many
    to a step as there are stages where the batch allows: the micro-batches of one step
    are all a stage admits at once."""
    stage, model, run = first_llama_stage()
    cases = ((16, 2, 8), (16, 4, 4), (64, 4, 8), (32, 8, 4), (4, 2, 4), (6, 4, 4), (3, 4, 3))
    for batch, stages, micro in cases:
        inner = dataclasses.replace(run.inner, batch_size=batch, grad_accum=1)
        work = _work(stage, model, dataclasses.replace(run, inner=inner), "auto", stages)
        assert (work.step_samples, work.ids.max_batch) == (batch, micro), (batch, stages)
        assert work.activations.max_batch == micro


def test_a_stage_steps_with_the_data_parallel_inner_optimizer():
    """The same AdamW as a data-parallel peer's over the stage's parameters: weight decay
    on matrices only (before, a stage decayed its norms' gains too), the run's betas."""
    creator = "ab" * 32
    _, _, _, run = run_from_manifest(build_manifest("llama", "tiny", creator=creator))
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, delay=1))
    manifest = build_pipeline_manifest("llama", "tiny", 2, creator=creator, run=run)
    task, model, _, run = run_from_manifest(manifest)
    assert run.inner.weight_decay > 0
    for k in (0, 1):
        stage = task_stage(task, model, run, 2, k)
        groups = _work(stage, model, run, "auto", 2).optimizer.param_groups
        decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
        assert [g["weight_decay"] for g in groups] == [run.inner.weight_decay, 0.0]
        for name, p in stage.named_parameters():
            assert (id(p) in decayed) == (p.dim() >= 2), name
        assert all(g["betas"] == (run.inner.beta1, run.inner.beta2) for g in groups)
