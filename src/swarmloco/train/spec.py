"""What a task is made of, as plain data: model configs, presets and data specs.

Torch-free, so that a manifest can be built and checked without loading torch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from swarmloco.core.config import require, require_fraction, require_int

DataSource = Literal["stdlib", "text", "tokens", "dataset"]
TOKEN_DTYPES = ("uint8", "uint16", "int32", "uint32", "int64")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A decoder-only transformer (pre-LayerNorm, GELU MLP, tied embeddings)."""

    vocab_size: int = 256
    """Vocabulary size; 256 for byte-level tokens."""
    seq_len: int = 128
    """Context length in tokens."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Model width."""
    dropout: float = 0.0
    """Dropout probability (0 for short runs)."""

    @property
    def parameters(self) -> int:
        """How many parameters the model has (token and position embeddings, per block the
        attention's 4 d^2 and the MLP's 8 d^2 weights and two LayerNorms, a final
        LayerNorm; the head is tied to the token embedding)."""
        d = self.n_embd
        blocks = self.n_layer * (12 * d * d + 4 * d)
        return (self.vocab_size + self.seq_len) * d + blocks + 2 * d

    def __post_init__(self) -> None:
        require_int("vocab_size", self.vocab_size, minimum=2)
        require_int("seq_len", self.seq_len, minimum=2)
        require_int("n_layer", self.n_layer, minimum=1)
        require_int("n_head", self.n_head, minimum=1)
        require_int("n_embd", self.n_embd, minimum=8)
        require(
            self.n_embd % self.n_head == 0,
            f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})",
        )
        require_fraction("dropout", self.dropout, closed_high=False)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per weight of every matrix (the blocks' and the tied
        head's) and attention's 12 * layers * width * seq_len, as for the llama task."""
        d = self.n_embd
        matrices = self.n_layer * 12 * d * d + self.vocab_size * d
        return 6 * matrices + 12 * self.n_layer * d * self.seq_len

    def num_params(self) -> int:
        """Parameter count (tied head counted once)."""
        d = self.n_embd
        block = 12 * d * d + 4 * d  # attention 4d^2, MLP 8d^2, two LayerNorms
        return self.n_layer * block + (self.vocab_size + self.seq_len) * d + 2 * d


GPT_PRESETS: dict[str, GPTConfig] = {
    # About 0.8M parameters: learns visible Python structure on 2 CPU cores in minutes.
    "tiny": GPTConfig(seq_len=128, n_layer=4, n_head=4, n_embd=128),
    # About 11M parameters: a laptop-GPU or patient-CPU model.
    "small": GPTConfig(seq_len=256, n_layer=6, n_head=6, n_embd=384),
    # About 128M parameters (GPT-2-small width; deeper, since byte tokens need no big
    # embedding table): a GPU model.
    "base": GPTConfig(seq_len=1024, n_layer=18, n_head=12, n_embd=768),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama-architecture decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query
    attention, no biases (Hugging Face's ``LlamaConfig`` under shorter names)."""

    vocab_size: int = 256
    """Vocabulary size."""
    seq_len: int = 128
    """Context length in tokens (``max_position_embeddings``)."""
    n_layer: int = 4
    """Decoder layers."""
    n_head: int = 4
    """Query heads per layer."""
    n_kv_head: int = 2
    """Key-value heads per layer (grouped-query attention; equal to n_head: none)."""
    n_embd: int = 128
    """Model width (``hidden_size``)."""
    ffn: int = 352
    """Width of the SwiGLU MLP (``intermediate_size``)."""
    rope_theta: float = 10_000.0
    """Base of the rotary embeddings' frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    tie_embeddings: bool = True
    """The output head shares the token embedding's weights."""

    def __post_init__(self) -> None:
        require_int("vocab_size", self.vocab_size, minimum=2)
        require_int("seq_len", self.seq_len, minimum=2)
        require_int("n_layer", self.n_layer, minimum=1)
        require_int("n_head", self.n_head, minimum=1)
        require_int("n_kv_head", self.n_kv_head, minimum=1)
        require_int("n_embd", self.n_embd, minimum=8)
        require_int("ffn", self.ffn, minimum=1)
        require(
            self.n_embd % self.n_head == 0,
            f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})",
        )
        require(
            self.n_head % self.n_kv_head == 0,
            f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})",
        )
        require(
            (self.n_embd // self.n_head) % 2 == 0,
            f"the head width n_embd / n_head ({self.n_embd // self.n_head}) must be even "
            "(rotary embeddings turn pairs of values)",
        )
        require(
            isinstance(self.rope_theta, int | float) and self.rope_theta > 1,
            f"rope_theta must be a number above 1, got {self.rope_theta!r}",
        )
        require(
            isinstance(self.norm_eps, int | float) and 0 < self.norm_eps < 1,
            f"norm_eps must be in (0, 1), got {self.norm_eps!r}",
        )
        require(isinstance(self.tie_embeddings, bool), "tie_embeddings must be true or false")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def parameters(self) -> int:
        """How many parameters the model has (the token embedding, per layer the attention's
        query, key, value and output matrices, the MLP's three and two RMSNorms, a final
        RMSNorm, and the head unless tied)."""
        d, kv = self.n_embd, self.n_kv_head * self.head_dim
        layer = 2 * d * d + 2 * d * kv + 3 * d * self.ffn + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layer * layer + d + head

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward and backward): 6 per weight of every matrix a
        token passes through (the head, not the embedding lookup) and attention's
        12 * layers * width * seq_len (PaLM, appendix B)."""
        matrices = self.parameters - self.vocab_size * self.n_embd * (not self.tie_embeddings)
        matrices -= (2 * self.n_layer + 1) * self.n_embd  # norms: no matrix product
        return 6 * matrices + 12 * self.n_layer * self.n_embd * self.seq_len


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # About 0.8M parameters on bytes: the CPU tests' and demos' size.
    "tiny": LlamaConfig(),
    # About 18M: SmolLM2's vocabulary and head width at a quarter of 135M's width.
    "20m": LlamaConfig(
        vocab_size=49_152, seq_len=1024, n_layer=8, n_head=4, n_kv_head=2, n_embd=256, ffn=704
    ),
    # SmolLM2-135M's shape (135M parameters).
    "135m": LlamaConfig(
        vocab_size=49_152,
        seq_len=2048,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        n_embd=576,
        ffn=1536,
    ),
    # SmolLM2-360M's shape (362M parameters).
    "360m": LlamaConfig(
        vocab_size=49_152,
        seq_len=2048,
        n_layer=32,
        n_head=15,
        n_kv_head=5,
        n_embd=960,
        ffn=2560,
    ),
    # TinyLlama-1.1B's shape (1.1B parameters, untied head).
    "1b": LlamaConfig(
        vocab_size=32_000,
        seq_len=2048,
        n_layer=22,
        n_head=32,
        n_kv_head=4,
        n_embd=2048,
        ffn=5632,
        tie_embeddings=False,
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Which tokens a run trains on and how the validation set is split off.

    ``stdlib`` is the ``.py`` files of the running interpreter's standard library as bytes;
    ``text`` is the user's own files or directories (all regular files below them), as bytes;
    ``tokens`` is pre-tokenized ``.npy`` arrays or raw ``.bin`` files of ``token_dtype``;
    ``dataset`` is a dataset ``swarmloco data prepare`` made, pinned by its id and fetched
    from a local copy or the ``mirrors`` (``dataset/fetch.py``).
    Text sources are split into train and validation *by file*; token files and a
    dataset's shards by position (the last ``val_fraction`` of each).
    """

    source: DataSource = "stdlib"
    """stdlib, text, tokens or dataset."""
    paths: tuple[str, ...] = ()
    """Files or directories (text), or token files (tokens); empty for stdlib."""
    suffixes: tuple[str, ...] = ()
    """For text directories: only files with these endings (e.g. ``.py``); empty: all."""
    token_dtype: str = "uint16"
    """Element type of raw ``.bin`` token files."""
    val_fraction: float = 0.05
    """Share of the data held out for evaluation."""
    eval_sequences: int = 64
    """Size of the fixed evaluation set, in sequences."""
    dataset: str = ""
    """The dataset's id (``dataset``: the hash of its index)."""
    mirrors: tuple[str, ...] = ()
    """HTTP(S) base URLs that serve the dataset's files (``dataset``)."""

    def __post_init__(self) -> None:
        require(
            self.source in ("stdlib", "text", "tokens", "dataset"),
            f"data source must be stdlib, text, tokens or dataset, got {self.source!r}",
        )
        require(isinstance(self.paths, tuple), "paths must be a tuple of strings")
        require(isinstance(self.mirrors, tuple), "mirrors must be a tuple of URLs")
        if self.source == "dataset":
            require(
                re.fullmatch(r"[0-9a-f]{40}", self.dataset) is not None,
                f"a dataset id is 40 hex digits, got {self.dataset!r}",
            )
            require(not self.paths, "a dataset is pinned by its id: no paths")
            for url in self.mirrors:
                require(
                    isinstance(url, str) and url.startswith(("http://", "https://")),
                    f"a dataset mirror is an http(s) URL, got {url!r}",
                )
        else:
            require(
                not self.dataset and not self.mirrors,
                "dataset and mirrors belong to the dataset source",
            )
        require(
            self.source in ("stdlib", "dataset") or bool(self.paths),
            f"data source {self.source!r} needs at least one path (--data PATH)",
        )
        require(self.token_dtype in TOKEN_DTYPES, f"token_dtype must be one of {TOKEN_DTYPES}")
        require(0.0 < self.val_fraction < 0.5, "val_fraction must be in (0, 0.5)")
        require_int("eval_sequences", self.eval_sequences, minimum=1)
