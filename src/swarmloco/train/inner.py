"""The inner loop: AdamW steps with warmup + cosine, clipping, accumulation, mixed precision.

Inner optimizer state never leaves the peer. On CUDA the step runs under bf16 autocast (fp16
with a gradient scaler where bf16 is missing) and the model is compiled; on CPU it runs in
fp32 eagerly unless asked otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from swarmloco.core.config import (
    require,
    require_fraction,
    require_int,
    require_non_negative,
    require_positive,
)
from swarmloco.core.schedules import warmup_cosine
from swarmloco.core.toolchain import missing_compiler
from swarmloco.errors import SwarmlocoError

log = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16", "fp16"]
CompileMode = Literal["auto", "on", "off"]
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class InnerConfig:
    """The local optimizer and batch of one worker."""

    lr: float = 4e-4
    """Peak AdamW learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (not on norms or biases)."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    total_steps: int = 10_000
    """Steps of the cosine decay (the learning rate stays at its floor after)."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of the peak learning rate."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    batch_size: int = 16
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    precision: Precision = "auto"
    """auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16 or fp16."""
    compile: CompileMode = "auto"
    """torch.compile the model: auto (on CUDA only), on, off."""

    def __post_init__(self) -> None:
        require_positive("lr", self.lr)
        require_fraction("beta1", self.beta1, closed_high=False)
        require_fraction("beta2", self.beta2, closed_high=False)
        require_non_negative("weight_decay", self.weight_decay)
        require_int("warmup_steps", self.warmup_steps, minimum=0)
        require_int("total_steps", self.total_steps, minimum=1)
        require_fraction("min_lr_ratio", self.min_lr_ratio)
        require_non_negative("grad_clip", self.grad_clip)
        require_int("batch_size", self.batch_size, minimum=1)
        require_int("grad_accum", self.grad_accum, minimum=1)
        require(
            self.precision in ("auto", "fp32", "bf16", "fp16"),
            f"unknown precision {self.precision!r}",
        )
        require(
            self.compile in ("auto", "on", "off"),
            f"compile must be auto, on or off, got {self.compile!r}",
        )

    def lr_at(self, step: int) -> float:
        return warmup_cosine(
            step,
            base_lr=self.lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_ratio=self.min_lr_ratio,
        )


def resolve_precision(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "fp16":
        return torch.float16
    if precision == "auto" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def inner_adamw(module: nn.Module, config: InnerConfig) -> torch.optim.AdamW:
    """The inner optimizer of ``module`` (on its device): AdamW with the weight decay on its
    matrices only (not on norms' gains or biases), fused on CUDA. A pipeline stage's is the
    same, over the stage's parameters."""
    params = list(module.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=config.lr_at(0),
        betas=(config.beta1, config.beta2),
        fused=bool(params) and params[0].is_cuda,
    )


class InnerLoop:
    """Owns a worker's model on its device, its AdamW and its step counter."""

    def __init__(self, model: nn.Module, config: InnerConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.model = model.to(device)
        self.optimizer = inner_adamw(self.model, config)
        self.amp_dtype = resolve_precision(config.precision, device)
        # fp16 gradients underflow without loss scaling; on the model's own device (a scaler
        # made for "cuda" silently disables itself anywhere else).
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)
        want_compile = config.compile == "on" or (
            config.compile == "auto" and device.type == "cuda"
        )
        if want_compile and (missing := missing_compiler(device.type)) is not None:
            if config.compile == "on":
                raise SwarmlocoError(f"torch.compile cannot build kernels here: {missing}")
            log.warning("training without torch.compile (slower): %s", missing)
            want_compile = False
        self.compiled = want_compile
        """Whether the model runs through ``torch.compile``."""
        self._forward: Callable[..., torch.Tensor] = (
            torch.compile(self.model) if want_compile else self.model  # type: ignore[assignment]
        )
        self.step = 0
        self.lr_step: Callable[[], int] = lambda: self.step
        """The step the learning rate is scheduled on: this loop's own by default; a peer
        of a swarm schedules on the swarm's global step."""

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def train_step(self, batches: Iterator[Batch]) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss of
        those it trained (0.0 if every one was empty).

        An empty micro-batch (no rows: the last sequences of a dataset ran out) trains
        nothing: it runs on one row of zeros with weight 0, so that a model whose backward
        is a collective of several ranks (DDP, FSDP) is joined by every rank."""
        cfg = self.config
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.lr_step())
        total = torch.zeros((), device=self.device)
        trained = 0
        for _ in range(cfg.grad_accum):
            x, y = next(batches)
            empty = x.shape[0] == 0
            if empty:
                x = torch.zeros((1, *x.shape[1:]), dtype=x.dtype)
                y = torch.zeros((1, *y.shape[1:]), dtype=y.dtype)
            else:
                trained += 1
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                loss = self._forward(x, y) / cfg.grad_accum
                if empty:
                    loss = loss * 0.0
            self.scaler.scale(loss).backward()
            total += loss.detach()
        if cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss_value = float(total)
        if trained < cfg.grad_accum:  # the mean of those trained
            loss_value = loss_value * cfg.grad_accum / trained if trained else 0.0
        if loss_value != loss_value:  # NaN: never let it reach the pseudo-gradient silently
            raise FloatingPointError(f"inner loss is NaN at step {self.step}")
        return loss_value

    @torch.no_grad()
    def evaluate(self, windows: torch.Tensor, batch_size: int = 32) -> float:
        """Mean cross-entropy over the fixed evaluation windows."""
        return evaluate(self.model, windows, self.device, self.amp_dtype, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), **self.loop_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_loop_state_dict(state)

    def loop_state_dict(self) -> dict[str, Any]:
        """The loop's own state without the optimizer's (a swarm checkpoints that itself)."""
        return {"scaler": self.scaler.state_dict(), "step": self.step}

    def load_loop_state_dict(self, state: dict[str, Any]) -> None:
        # Precision is each peer's own choice: a state saved without loss scaling (fp32,
        # bf16) resumes under fp16 with a fresh scale, and a scale is dropped where unused.
        if self.scaler.is_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: torch.Tensor,
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
    batch_size: int = 32,
) -> float:
    """Token-weighted mean cross-entropy of ``model`` over ``windows`` (rows of seq_len + 1)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        rows = windows[i : i + batch_size].to(device)
        ctx = (
            torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        )
        with ctx:
            loss = model(rows[:, :-1], rows[:, 1:])
        total += float(loss) * len(rows)
        count += len(rows)
    model.train(was_training)
    return total / max(count, 1)
