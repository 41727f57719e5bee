"""What a task is made of, as plain data: model configs, presets and data specs.

Torch-free, so that a manifest can be built and checked without loading torch.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from swarmloco.core.config import require, require_fraction, require_int

DataSource = Literal["stdlib", "text", "tokens"]
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
class DataSpec:
    """Which tokens a run trains on and how the validation set is split off.

    ``stdlib`` is the ``.py`` files of the running interpreter's standard library as bytes;
    ``text`` is the user's own files or directories (all regular files below them), as bytes;
    ``tokens`` is pre-tokenized ``.npy`` arrays or raw ``.bin`` files of ``token_dtype``.
    Text sources are split into train and validation *by file*; token files by position
    (the last ``val_fraction`` of each file).
    """

    source: DataSource = "stdlib"
    """stdlib, text or tokens."""
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

    def __post_init__(self) -> None:
        require(
            self.source in ("stdlib", "text", "tokens"),
            f"data source must be stdlib, text or tokens, got {self.source!r}",
        )
        require(isinstance(self.paths, tuple), "paths must be a tuple of strings")
        require(
            self.source == "stdlib" or bool(self.paths),
            f"data source {self.source!r} needs at least one path (--data PATH)",
        )
        require(self.token_dtype in TOKEN_DTYPES, f"token_dtype must be one of {TOKEN_DTYPES}")
        require(0.0 < self.val_fraction < 0.5, "val_fraction must be in (0, 0.5)")
        require_int("eval_sequences", self.eval_sequences, minimum=1)
