"""The Llama architecture in plain torch, under Hugging Face's parameter names.

RMSNorm in fp32, rotary embeddings (the rotate-half form), SwiGLU, grouped-query attention
through ``scaled_dot_product_attention`` (keys and values expanded to the query heads, so
CUDA picks the flash kernel), no biases. The names of the parameters are
``LlamaForCausalLM``'s, so exported weights load with ``from_pretrained`` beside the
config :func:`hf_config` writes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarmloco.train.spec import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, ``(seq_len, head_dim)``, in fp32."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, hd = config.n_embd, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, hd
        self.q_proj = nn.Linear(d, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(d, config.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(d, config.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(config.n_head * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        group = self.n_head // self.n_kv_head
        if group > 1:  # each key-value head serves `group` query heads
            k = k[:, :, None].expand(b, self.n_kv_head, group, t, self.head_dim)
            v = v[:, :, None].expand(b, self.n_kv_head, group, t, self.head_dim)
            k = k.reshape(b, self.n_head, t, self.head_dim)
            v = v.reshape(b, self.n_head, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)


class Llama(nn.Module):
    """``LlamaForCausalLM``'s structure: ``model`` (embedding, layers, norm) and
    ``lm_head`` (the embedding's weight when tied)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.checkpointing = False
        """Recompute each layer's activations in the backward pass (train/fit.py turns it
        on when not even one sequence fits otherwise)."""
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # Scaled init of the projections that write into the residual stream (GPT-2's).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(b, t, vocab)``, or the mean cross-entropy if ``targets`` are given."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len {self.config.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(idx)
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def layer_unit(param_name: str) -> str:
    """The layer a parameter belongs to, for Streaming DiLoCo's strided fragments."""
    if param_name.startswith("model.layers."):
        return "block." + param_name.split(".")[2]
    if param_name.startswith("model.embed_tokens."):
        return "embeddings"
    return "head"


def hf_config(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of Hugging Face's ``LlamaForCausalLM`` for this model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
