"""The built-in ``llama`` task: the model, its presets, its manifest and its export format
(docs/DESIGN.md, "Built-in tasks")."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

from swarmloco.core.runspec import RunSpec
from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.llama import Llama, hf_config, layer_unit
from swarmloco.train.spec import LLAMA_PRESETS, LlamaConfig
from swarmloco.train.tasks import (
    RunConfig,
    build_manifest,
    describe_tasks,
    get_task,
    run_from_manifest,
)

SMALL = LlamaConfig(vocab_size=300, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn=48)


def build(config: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(config)


@pytest.mark.parametrize("preset", sorted(LLAMA_PRESETS))
def test_every_preset_has_the_parameters_its_config_counts(preset):
    config = LLAMA_PRESETS[preset]
    with torch.device("meta"):  # the 1b preset without 4 GB of weights
        model = Llama(config)
    assert sum(p.numel() for p in model.parameters()) == config.parameters


def test_presets_are_the_published_shapes():
    # SmolLM2-135M and -360M, TinyLlama-1.1B: their parameter counts.
    assert LLAMA_PRESETS["135m"].parameters == 134_515_008
    assert LLAMA_PRESETS["360m"].parameters == 361_821_120
    assert LLAMA_PRESETS["1b"].parameters == 1_100_048_384
    assert 15e6 < LLAMA_PRESETS["20m"].parameters < 25e6


def test_parameter_names_are_hugging_faces():
    names = [n for n, _ in build(SMALL).named_parameters()]
    assert names[:3] == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    assert names[-1] == "model.norm.weight"  # tied: no lm_head of its own
    untied = build(dataclasses.replace(SMALL, tie_embeddings=False))
    assert [n for n, _ in untied.named_parameters()][-1] == "lm_head.weight"


def test_forward_gives_logits_or_the_loss_and_refuses_long_sequences():
    model = build(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (3, SMALL.seq_len))
    assert model(x).shape == (3, SMALL.seq_len, SMALL.vocab_size)
    loss = model(x, x)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # At initialisation the loss is about that of a uniform guess.
    assert abs(loss.item() - torch.log(torch.tensor(SMALL.vocab_size)).item()) < 1.0
    with pytest.raises(ValueError, match="exceeds seq_len"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_attention_is_causal():
    model = build(SMALL).eval()
    x = torch.randint(0, SMALL.vocab_size, (1, SMALL.seq_len))
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_a_few_inner_steps_learn_a_fixed_batch():
    loop = InnerLoop(
        build(SMALL), InnerConfig(lr=3e-3, warmup_steps=0, batch_size=4), torch.device("cpu")
    )
    rows = torch.randint(0, SMALL.vocab_size, (4, SMALL.seq_len + 1))

    def batches():
        while True:
            yield rows[:, :-1], rows[:, 1:]

    stream = batches()
    first = loop.train_step(stream)
    for _ in range(30):
        last = loop.train_step(stream)
    assert last < 0.5 * first, (first, last)


def test_flops_per_token_counts_the_matrices_the_model_has():
    for config in (SMALL, dataclasses.replace(SMALL, tie_embeddings=False)):
        model = build(config)
        matrices = sum(
            m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
        )  # the head is a Linear, tied or not; the embedding lookup is not a product
        attention = 12 * config.n_layer * config.n_embd * config.seq_len
        assert config.flops_per_token() == 6 * matrices + attention


def test_config_validation_says_what_is_wrong():
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        LlamaConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="divisible by n_head"):
        LlamaConfig(n_embd=130, n_head=4)
    with pytest.raises(ValueError, match="must be even"):
        LlamaConfig(n_embd=36, n_head=4, n_kv_head=2)


def test_layer_units_follow_the_decoder_layers():
    assert layer_unit("model.layers.7.mlp.up_proj.weight") == "block.7"
    assert layer_unit("model.embed_tokens.weight") == "embeddings"
    assert layer_unit("model.norm.weight") == layer_unit("lm_head.weight") == "head"


def test_a_llama_manifest_round_trips_and_builds_the_same_model():
    spec = RunSpec(sync_every=10, fragments=2, delay=2)
    run = RunConfig(inner=InnerConfig(batch_size=4), spec=spec)
    manifest = build_manifest("llama", "tiny", creator="ab" * 32, run=run)
    task, model, _, again = run_from_manifest(manifest)
    assert task.name == "llama" and model == dataclasses.asdict(LLAMA_PRESETS["tiny"])
    assert again.spec.fragments == 2
    names = [name for name, *_ in manifest.model["signature"]["params"]]
    assert names == [n for n, _ in task.build_model(model).named_parameters()]
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        build_manifest("llama", "tiny", creator="", model_overrides={"n_kv_head": 3})
    with pytest.raises(ValueError, match="known options"):
        build_manifest("llama", "tiny", creator="", model_overrides={"n_heads": 3})


def test_create_help_lists_the_llama_presets():
    text = describe_tasks()
    assert "llama:" in text
    for preset in LLAMA_PRESETS:
        assert f"    {preset} " in text
    assert "135M parameters (30 layers, 576 wide, 2048 tokens of context); H=500" in text
    assert get_task("llama").default_run("1b").spec.sync_every == 500


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="the hf extra is not installed"
)
@pytest.mark.parametrize("tied", [True, False])
def test_the_weights_and_config_load_as_hugging_faces_llama_with_the_same_logits(tmp_path, tied):
    from transformers import LlamaForCausalLM

    config = dataclasses.replace(SMALL, tie_embeddings=tied)
    model = build(config).eval()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config)))
    hf, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randint(0, config.vocab_size, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, model(x), rtol=1e-4, atol=1e-4)
