"""Fitting the run's batch to this peer's memory: the largest micro-batch that fits,
accumulated to the manifest's sequences per step, and activation checkpointing when not
even one sequence fits without it.

The arithmetic stays the run's: a step is the mean loss over ``batch_size * grad_accum``
sequences whatever the split, so a 16 GB card and an 80 GB card train the same run. The
memory a micro-batch of ``m`` sequences needs is modelled as ``fixed + m * per_sequence``:
on CUDA both are measured (one forward and backward at one and at two sequences, eager,
which needs at least what the compiled model needs); elsewhere they are estimated from
the parameter count and the activations of a transformer layer (``estimate_profile``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from swarmloco.errors import SwarmlocoError

log = logging.getLogger(__name__)

MARGIN = 0.10
"""Share of the budget left free: allocator fragmentation, the compiled graph's own
buffers, the evaluation pass and the round's copies."""


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """What training needs in device memory, by micro-batch size."""

    fixed_bytes: int
    """Whatever the micro-batch: weights, gradients, optimizer state, workspaces."""
    per_sequence_bytes: int
    """What each sequence of a micro-batch adds at the step's peak."""
    checkpointed_per_sequence_bytes: int | None = None
    """The same with activation checkpointing (None: the model has none)."""

    def need(self, micro_batch: int, *, checkpointing: bool = False) -> int:
        per = self.checkpointed_per_sequence_bytes if checkpointing else self.per_sequence_bytes
        if per is None:
            raise ValueError("this profile has no figure for activation checkpointing")
        return self.fixed_bytes + micro_batch * per


@dataclasses.dataclass(frozen=True)
class Fit:
    """The split of a step's sequences this peer trains with."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool
    need_bytes: int
    budget_bytes: int

    def short(self) -> str:
        """A few words for the dashboard."""
        text = f"micro-batch {self.micro_batch} x {self.grad_accum}"
        text += ", checkpointing" if self.checkpointing else ""
        return text + f", {self.need_bytes / 1e9:.0f} of {self.budget_bytes / 1e9:.0f} GB"

    def describe(self) -> str:
        return (
            f"micro-batch {self.micro_batch} x {self.grad_accum} accumulated"
            + (", activation checkpointing on" if self.checkpointing else "")
            + f" (needs about {self.need_bytes / 1e9:.1f} GB of a "
            f"{self.budget_bytes / 1e9:.1f} GB budget)"
        )


# Dense bf16 matrix rates from vendors' datasheets (without sparsity), FLOP/s, by a name
# torch.cuda.get_device_name contains; the first match counts. MFU is shown for these only.
_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, where the table above knows it (None: the CPU, or
    a card it does not list)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16 if key in name), None)


def choose_fit(
    sequences: int, profile: MemoryProfile, budget_bytes: int, *, margin: float = MARGIN
) -> Fit:
    """The largest micro-batch dividing ``sequences`` (a step's) whose need stays within
    ``budget_bytes`` less the margin; with activation checkpointing only when no micro-batch
    fits without. SwarmlocoError when not even one checkpointed sequence fits."""
    if sequences < 1:
        raise ValueError(f"a step has at least one sequence, got {sequences}")
    usable = budget_bytes * (1.0 - margin)
    sizes = [m for m in range(sequences, 0, -1) if sequences % m == 0]
    modes = [False] + ([True] if profile.checkpointed_per_sequence_bytes is not None else [])
    for checkpointing in modes:
        for m in sizes:
            need = profile.need(m, checkpointing=checkpointing)
            if need <= usable:
                return Fit(m, sequences // m, checkpointing, need, budget_bytes)
    least = profile.need(1, checkpointing=modes[-1])
    raise SwarmlocoError(
        f"the model does not fit: one sequence needs about {least / 1e9:.1f} GB"
        + (" with activation checkpointing" if modes[-1] else "")
        + f", the budget is {budget_bytes / 1e9:.1f} GB less {margin:.0%} kept free. Use a "
        "device with more memory, or give a larger --memory-budget if this one has it"
    )


def estimate_profile(
    parameters: int,
    *,
    n_layer: int,
    n_embd: int,
    seq_len: int,
    vocab_size: int,
    activation_bytes: int = 2,
) -> MemoryProfile:
    """A rough profile from the model's shape, where nothing can be measured: 16 bytes a
    parameter (fp32 weights, gradients and AdamW's two moments) and, per sequence, about
    34 values of the width per token and layer (Korthikanti et al., 2022, with attention's
    scores left to a fused kernel) plus the logits in fp32 twice (the loss and its
    gradient); checkpointing keeps one value of the width per token and layer, and one
    layer's activations."""
    per_layer = 34 * n_embd * seq_len * activation_bytes
    logits = 2 * 4 * vocab_size * seq_len + activation_bytes * vocab_size * seq_len
    per_sequence = n_layer * per_layer + logits
    checkpointed = n_layer * n_embd * seq_len * activation_bytes + per_layer + logits
    return MemoryProfile(16 * parameters, per_sequence, checkpointed)


def measure_profile(
    model: nn.Module,
    *,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    autocast: Callable[[], object],
    optimizer_state_bytes: int,
) -> MemoryProfile:
    """The profile of ``model`` (already on the CUDA ``device``), measured: the peak of one
    eager forward and backward at one and at two sequences, with checkpointing off and, if
    the model has it (a ``checkpointing`` attribute), on. ``optimizer_state_bytes``: what
    the optimizer will hold once it stepped (AdamW: two moments of every parameter)."""
    if device.type != "cuda":
        raise ValueError("memory is measured on CUDA devices only; estimate it elsewhere")

    def peak(m: int, checkpointing: bool) -> int | None:
        if hasattr(model, "checkpointing"):
            setattr(model, "checkpointing", checkpointing)  # noqa: B010 (a plain attribute)
        x = torch.randint(0, vocab_size, (m, seq_len), device=device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        try:
            with autocast():  # type: ignore[attr-defined]
                loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    was_training, was_checkpointing = model.training, getattr(model, "checkpointing", False)
    model.train()
    weights = torch.cuda.memory_allocated(device)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    try:
        plain = (peak(1, False), peak(2, False))
        checkpointed = (
            (peak(1, True), peak(2, True)) if hasattr(model, "checkpointing") else (None, None)
        )
    finally:
        model.train(was_training)
        if hasattr(model, "checkpointing"):
            setattr(model, "checkpointing", was_checkpointing)  # noqa: B010

    def split(one: int | None, two: int | None) -> tuple[int, int] | None:
        if one is None:
            return None
        if two is None:  # two sequences did not fit: the one-sequence peak is all we know
            return one, one
        per = max(two - one, 1)
        return one - per, per  # what the step holds whatever the batch, and per sequence

    fixed_extra = weights + grads + optimizer_state_bytes
    a, b = split(*plain), split(*checkpointed)
    if a is None and b is None:
        raise SwarmlocoError(
            "the model does not fit on this device: one sequence ran out of memory"
            + (" even with activation checkpointing" if hasattr(model, "checkpointing") else "")
        )
    if a is None:
        assert b is not None
        # Without checkpointing nothing fits: a per-sequence need above any budget.
        return MemoryProfile(fixed_extra + b[0], 1 << 62, b[1])
    return MemoryProfile(fixed_extra + a[0], a[1], b[1] if b is not None else None)
