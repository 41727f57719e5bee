"""The built-in GPT (``train/model.py``) cut into pipeline stages.

Stage 0 holds the token and position embeddings and its share of the blocks; the last
stage holds its blocks, the final norm and the head, and returns the loss; a stage between
holds blocks only. The blocks are split as evenly as their count allows, the earlier
stages taking one more where they do not divide. The head is the embedding's transpose in
the one-process model (tied); cut apart, the last stage holds its own copy, initialised
from the embedding, and trains it on its own (a pipelined run is its own model, and its
signature says so).

:func:`cut_gpt` cuts a model already built (one process holds it all: the tests'
reference). :func:`build_gpt_stage` builds one stage alone, for a model no peer can hold:
its modules are made on the ``meta`` device (no memory, no draw from any generator), then
each parameter is drawn from GPT's initial distribution by a generator of its own, seeded
by the run's seed and the parameter's name in the whole model, so every peer building a
stage builds the same one, and a creator building each stage in turn the same ones.
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmloco.train.model import GPT, GPTConfig


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

    def __init__(self, model: GPT, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config: GPTConfig = model.config
        self.first, self.last = first, last
        if first:
            self.wte = copy.deepcopy(model.wte)
            self.wpe = copy.deepcopy(model.wpe)
            self.drop = copy.deepcopy(model.drop)
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in blocks)
        if last:
            self.ln_f = copy.deepcopy(model.ln_f)
            self.head = nn.Parameter(model.wte.weight.detach().clone())

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


def build_gpt_stage(
    config: GPTConfig,
    stages: int,
    stage: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> GPTStage:
    """Stage ``stage`` of ``stages`` of the GPT of ``config``, built alone (see the module)
    on ``device``; its weights depend on ``seed`` and the names alone."""
    runs = split_evenly(config.n_layer, stages)
    if not 0 <= stage < stages:
        raise ValueError(f"no stage {stage} in {stages}")
    with torch.device("meta"):
        skeleton = GPT(config)
        built = GPTStage(skeleton, runs[stage], first=stage == 0, last=stage == stages - 1)
    built = built.to_empty(device=device)
    first_block = runs[stage].start
    with torch.no_grad():
        for module in built.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()  # ones and zeros: nothing drawn
        for name, p in built.named_parameters():
            if ".ln" in f".{name}":
                continue
            whole = _name_in_whole_model(name, first_block)
            std = 0.02
            if whole.endswith(("proj.weight", "down.weight")):  # GPT-2's scaled residual init
                std = 0.02 / math.sqrt(2 * config.n_layer)
            g = torch.Generator().manual_seed(_seed_of(seed, whole))
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
    return built


def _name_in_whole_model(name: str, first_block: int) -> str:
    """A stage parameter's name in the whole GPT: its blocks are numbered from the stage's
    first, and the last stage's head starts as the embedding it is cut from."""
    if name == "head":
        return "wte.weight"
    parts = name.split(".")
    if parts[0] == "blocks":
        parts[1] = str(int(parts[1]) + first_block)
    return ".".join(parts)


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # a generator's seed: 63 bits
