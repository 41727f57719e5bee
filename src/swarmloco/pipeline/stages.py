"""The built-in GPT (``train/model.py``) cut into pipeline stages.

Stage 0 holds the token and position embeddings and its share of the blocks; the last
stage holds its blocks, the final norm and the head, and returns the loss; a stage between
holds blocks only. The blocks are split as evenly as their count allows, the earlier
stages taking one more where they do not divide. The head is the embedding's transpose in
the one-process model (tied); cut apart, the last stage holds its own copy, initialised
from the embedding, and trains it on its own (a pipelined run is its own model, and its
signature says so).
"""

from __future__ import annotations

import copy

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
