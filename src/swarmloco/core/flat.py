"""A flat, fragment-ordered view of a model's parameters.

The outer step, the codec and the exchange all work on one flat fp32 vector. Parameters are
laid out fragment by fragment (in model order within a fragment), and every fragment starts
on a codec block boundary and is padded with zeros to whole blocks, so a fragment is a
contiguous, block-aligned slice that the codec quantizes in place without a copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from swarmloco.core.codec import padded_numel


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    fragment: int
    start: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class FlatLayout:
    """Where each named parameter lives in the flat vector."""

    def __init__(
        self,
        shapes: Sequence[tuple[str, tuple[int, ...]]],
        fragment_of: Sequence[int],
        block_size: int,
    ) -> None:
        if len(shapes) != len(fragment_of):
            raise ValueError("one fragment index per parameter is needed")
        self.block_size = block_size
        self.num_fragments = max(fragment_of) + 1 if fragment_of else 0
        slots: list[Slot] = []
        self.fragment_ranges: list[tuple[int, int]] = []
        offset = 0
        for f in range(self.num_fragments):
            start = offset
            for (name, shape), frag in zip(shapes, fragment_of, strict=True):
                if frag == f:
                    slot = Slot(name, tuple(shape), f, offset)
                    slots.append(slot)
                    offset += slot.numel
            offset = start + padded_numel(offset - start, block_size)
            self.fragment_ranges.append((start, offset))
        self.numel = offset
        order = {name: i for i, (name, _) in enumerate(shapes)}
        self.slots = sorted(slots, key=lambda s: order[s.name])
        self.real_numel = sum(s.numel for s in self.slots)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32)

    def fragment(self, flat: torch.Tensor, f: int) -> torch.Tensor:
        start, stop = self.fragment_ranges[f]
        return flat[start:stop]

    @torch.no_grad()
    def gather(
        self, params: Sequence[torch.Tensor], out: torch.Tensor, fragment: int | None = None
    ) -> torch.Tensor:
        """Copy parameters (in layout order of ``slots``) into ``out`` (fp32, CPU)."""
        for slot, p in zip(self.slots, params, strict=True):
            if fragment is None or slot.fragment == fragment:
                out[slot.start : slot.start + slot.numel].copy_(p.detach().reshape(-1))
        return out

    @torch.no_grad()
    def scatter(
        self, flat: torch.Tensor, params: Sequence[torch.Tensor], fragment: int | None = None
    ) -> None:
        """Copy the flat vector's values into the parameters (any device and dtype)."""
        for slot, p in zip(self.slots, params, strict=True):
            if fragment is None or slot.fragment == fragment:
                p.copy_(flat[slot.start : slot.start + slot.numel].view(slot.shape))

    @torch.no_grad()
    def lerp_into(
        self,
        flat: torch.Tensor,
        params: Sequence[torch.Tensor],
        weight: float,
        fragment: int | None = None,
    ) -> None:
        """``p <- lerp(flat, p, weight)``: 0 takes the flat (global) value, 1 keeps ``p``."""
        for slot, p in zip(self.slots, params, strict=True):
            if fragment is None or slot.fragment == fragment:
                g = (
                    flat[slot.start : slot.start + slot.numel]
                    .view(slot.shape)
                    .to(p.device, p.dtype)
                )
                p.copy_(torch.lerp(g, p, weight))
