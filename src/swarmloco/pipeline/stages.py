"""The built-in GPT (``train/model.py``) and Llama (``train/llama.py``) cut into pipeline
stages.

Stage 0 holds the token (and, in the GPT, position) embeddings and its share of the
blocks; the last stage holds its blocks, the final norm and the head, and returns the
loss; a stage between holds blocks only. The blocks are split as evenly as their count
allows, the earlier stages taking one more where they do not divide. The head is the
embedding's transpose in the one-process model (tied); cut apart, the last stage holds
its own copy, initialised from the embedding, and trains it on its own (a pipelined run
is its own model, and its signature says so).

:func:`cut_gpt` and :func:`cut_llama` cut a model already built (one process holds it
all: the tests' reference). :func:`build_stage` builds one stage alone, for a model no
peer can hold: its modules are made on the ``meta`` device (no memory, no draw from any
generator), then each parameter is drawn from the model's initial distribution by a
generator of its own, seeded by the run's seed and the parameter's name in the whole
model, so every peer building a stage builds the same one, and a creator building each
stage in turn the same ones.
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmloco.train.llama import Llama, RMSNorm, rotary_tables
from swarmloco.train.model import GPT, GPTConfig
from swarmloco.train.spec import LlamaConfig


def split_evenly(layers: int, stages: int) -> list[range]:
    """The blocks of each stage: ``layers`` split into ``stages`` runs, the first ones
    one longer where they do not divide."""
    if stages < 1 or layers < stages:
        raise ValueError(f"cannot cut {layers} block(s) into {stages} stage(s)")
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for k in range(stages):
        n = base + (k < extra)
        out.append(range(start, start + n))
        start += n
    return out


class GPTStage(nn.Module):
    """One stage of the GPT: ``forward(x)`` gives the next stage's input (token ids in at
    stage 0, activations ``(b, t, n_embd)`` out), or at the last stage ``forward(x,
    targets)`` gives the mean cross-entropy."""

    scaled = ("proj.weight", "down.weight")
    """The parameters GPT-2 initialises scaled down: they write into the residual stream."""

    def __init__(self, model: GPT, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config: GPTConfig = model.config
        self.first, self.last = first, last
        self.first_block = blocks.start
        if first:
            self.wte = copy.deepcopy(model.wte)
            self.wpe = copy.deepcopy(model.wpe)
            self.drop = copy.deepcopy(model.drop)
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in blocks)
        if last:
            self.ln_f = copy.deepcopy(model.ln_f)
            self.head = nn.Parameter(model.wte.weight.detach().clone())

    def name_in_whole_model(self, name: str) -> str:
        """A parameter's name in the whole GPT: the blocks numbered from the stage's first;
        the last stage's head starts as the embedding it is cut from."""
        if name == "head":
            return "wte.weight"
        return renumbered(name, "blocks", self.first_block)

    def reset_buffers(self) -> None:
        """(Nothing: the GPT has no buffers.)"""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            if t > self.config.seq_len:
                raise ValueError(f"sequence of {t} tokens exceeds seq_len {self.config.seq_len}")
            pos = torch.arange(t, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        logits = F.linear(self.ln_f(x), self.head)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def cut_gpt(model: GPT, stages: int) -> list[GPTStage]:
    """``model`` cut into ``stages`` stages (copies: the model is left as it was)."""
    runs = split_evenly(model.config.n_layer, stages)
    return [
        GPTStage(model, blocks, first=k == 0, last=k == stages - 1) for k, blocks in enumerate(runs)
    ]


def gpt_stages(config: GPTConfig, stages: int, *, seed: int = 0) -> list[GPTStage]:
    """The GPT of ``config`` (initialised from ``seed``, as every peer builds it) cut into
    ``stages`` stages."""
    torch.manual_seed(seed)
    return cut_gpt(GPT(config), stages)


class _LlamaBody(nn.Module):
    """A stage's part of ``LlamaForCausalLM.model`` (named as there)."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm


class LlamaStage(nn.Module):
    """One stage of the Llama, under ``LlamaForCausalLM``'s names (``model.embed_tokens``,
    ``model.layers.<i>`` numbered within the stage, ``model.norm``, ``lm_head``): token ids
    in at stage 0, activations ``(b, t, n_embd)`` out, the mean cross-entropy at the last
    stage given ``targets``. Each stage keeps the rotary tables (a buffer, not state)."""

    scaled = ("o_proj.weight", "down_proj.weight")
    """The parameters initialised scaled down: they write into the residual stream."""
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, model: Llama, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config: LlamaConfig = model.config
        self.first, self.last = first, last
        self.first_block = layers.start
        self.model = _LlamaBody()
        if first:
            self.model.embed_tokens = copy.deepcopy(model.model.embed_tokens)
        self.model.layers = nn.ModuleList(copy.deepcopy(model.model.layers[i]) for i in layers)
        if last:
            self.model.norm = copy.deepcopy(model.model.norm)
            self.lm_head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
            with torch.no_grad():  # tied in one process: cut apart, a copy of the embedding
                self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        cos, sin = rotary_tables(self.config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def name_in_whole_model(self, name: str) -> str:
        if name == "lm_head.weight" and self.config.tie_embeddings:
            return "model.embed_tokens.weight"
        return renumbered(name, "model.layers", self.first_block)

    def reset_buffers(self) -> None:
        """The rotary tables, computed again (a stage made on ``meta`` has none)."""
        cos, sin = rotary_tables(self.config)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len {self.config.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        if self.first:
            x = self.model.embed_tokens(x)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        if not self.last:
            return x
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def cut_llama(model: Llama, stages: int) -> list[LlamaStage]:
    """``model`` cut into ``stages`` stages (copies: the model is left as it was)."""
    runs = split_evenly(model.config.n_layer, stages)
    return [
        LlamaStage(model, layers, first=k == 0, last=k == stages - 1)
        for k, layers in enumerate(runs)
    ]


Stage = GPTStage | LlamaStage


def build_stage(
    config: GPTConfig | LlamaConfig,
    stages: int,
    stage: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> Stage:
    """Stage ``stage`` of ``stages`` of the model of ``config`` (the built-in GPT's or
    Llama's), built alone (see the module) on ``device``; its weights depend on ``seed``
    and the names alone."""
    runs = split_evenly(config.n_layer, stages)
    if not 0 <= stage < stages:
        raise ValueError(f"no stage {stage} in {stages}")
    first, last = stage == 0, stage == stages - 1
    built: Stage
    with torch.device("meta"):
        if isinstance(config, GPTConfig):
            built = GPTStage(GPT(config), runs[stage], first=first, last=last)
        else:
            built = LlamaStage(Llama(config), runs[stage], first=first, last=last)
    built = built.to_empty(device=device)
    built.reset_buffers()
    norms = set()
    with torch.no_grad():
        for module in built.modules():
            if isinstance(module, nn.LayerNorm | RMSNorm):  # ones (and zeros): nothing drawn
                for p in module.parameters(recurse=False):
                    p.fill_(1.0 if p is module.weight else 0.0)
                    norms.add(id(p))
        for name, p in built.named_parameters():
            if id(p) in norms:
                continue
            whole = built.name_in_whole_model(name)
            std = 0.02
            if whole.endswith(built.scaled):  # GPT-2's scaled init of the residual writes
                std = 0.02 / math.sqrt(2 * config.n_layer)
            g = torch.Generator().manual_seed(_seed_of(seed, whole))
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
    return built


def build_gpt_stage(
    config: GPTConfig,
    stages: int,
    stage: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> GPTStage:
    """:func:`build_stage` of the GPT."""
    built = build_stage(config, stages, stage, seed=seed, device=device)
    assert isinstance(built, GPTStage)
    return built


def renumbered(name: str, prefix: str, first: int) -> str:
    """``name`` (of a stage's parameter) with the layer index after ``prefix`` counted from
    ``first``, the stage's first layer in the whole model."""
    if not name.startswith(prefix + "."):
        return name
    index, rest = name[len(prefix) + 1 :].split(".", 1)
    return f"{prefix}.{int(index) + first}.{rest}"


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # a generator's seed: 63 bits
