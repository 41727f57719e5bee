"""The round's result as it arrives: every result chunk checked and decoded into the output
tensor (or kept as it came, for an output kept encoded), whoever reduced it (a remote
reducer or this member). No I/O.

Decoding is one multiply per element (q * s), the same on every member for the same bytes:
identical bits everywhere, so that every member's digest of its result is the same.

A remote reducer's result is bounded like a sender's slice (:class:`ResultBound`): what
the group's aggregator makes of slices within the group's norm bound cannot exceed a norm
every member computes alike from the group and the chunk's contributors, and a result past
it is refused (``too-large``), its reducer struck and its part reduced again by the next
member. A reducer that lies within that bound is left to the audits (``audit.py``), which
recompute a random segment of its part from its senders' bytes (docs/SECURITY.md, "Bounded
influence").
"""

from __future__ import annotations

import math

import torch

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import (
    CodecConfig,
    Encoded,
    blocks_norm_sq,
    dequantize_into_,
    store_encoded_,
)
from swarmloco.errors import SwarmlocoError
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.reduction import rounding_allowance, slice_bound
from swarmloco.net.averaging.view import RoundView
from swarmloco.net.rejections import Rejection


def decode_chunk(
    payload: memoryview, scales: memoryview, numel: int, codec: CodecConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's quantized values and scales, their sizes checked (Rejection otherwise)."""
    wire.check_sizes(
        payload, scales, numel=numel, block_size=codec.block_size, scale_bytes=codec.scale_bytes
    )
    return wire.tensor_from(payload, torch.int8), wire.tensor_from(scales, codec.scale_torch_dtype)


class ResultBound:
    """The most a reducer's result may measure, part by part (see the module docstring).

    Each sender's slice of a part decodes to at most ``s = slice_bound(B)`` (the reducer's
    check, with ``B`` the group's norm bound). Chunk ``k``'s aggregate over its contributors
    ``C`` is no longer than ``sqrt(sum over j in C of f_j * ||x_j,k||^2)``: a weighted mean is
    a convex combination (``f_j = w_j / sum of the weights of C``); a trimmed mean averages
    ``m - 2t`` of the ``m`` values of each coordinate (``f_j = 1 / (m - 2t)``); CenteredClip
    stays in the convex hull of the rows (``f_j = 1``). Over the chunks so far the squared
    norm is thus at most ``s^2 * sum over j of F_j``, ``F_j`` the largest ``f_j`` of member
    ``j`` so far; quantizing the result adds at most the rounding an honest reducer's scales
    allow. Every member computes the same bound from the same group and bitmaps."""

    def __init__(self, *, group: Group, aggregator: AggregatorConfig, codec: CodecConfig) -> None:
        self._weights = group.weights
        self._aggregator = aggregator
        self._block = codec.block_size
        bound = group.norm_bound(aggregator.norm_clip)
        self._slice = slice_bound(bound, self._block) if math.isfinite(bound) else math.inf
        # part -> (epoch, reducer), the squared norm of its result so far, F_j per member
        self._parts: dict[int, tuple[tuple[int, int], float, dict[int, float]]] = {}

    def _shares(self, members: list[int]) -> dict[int, float]:
        """``f_j`` of each contributor of one chunk."""
        method = self._aggregator.method
        if method == "mean":
            total = sum(self._weights[j] for j in members)
            return {j: self._weights[j] / total for j in members}
        if method == "trimmed_mean":
            m = len(members)
            kept = m - 2 * min(self._aggregator.trim, (m - 1) // 2)
            return dict.fromkeys(members, 1.0 / kept)
        return dict.fromkeys(members, 1.0)

    def check(
        self,
        part: int,
        epoch: int,
        reducer: int,
        payload: torch.Tensor,
        scales: torch.Tensor,
        contributors: list[int],
    ) -> None:
        """Account for the next result chunk of ``part`` from ``reducer`` at ``epoch`` (a
        new claim on the part starts the account again); Rejection ``too-large`` if it takes
        the part's result past what its contributors' slices can average to."""
        if not math.isfinite(self._slice) or not contributors:
            return
        claim = (epoch, reducer)
        held = self._parts.get(part)
        if held is None or held[0] != claim:
            held = (claim, 0.0, {})
        _, norm_sq, shares = held
        shares = dict(shares)
        for member, share in self._shares(contributors).items():
            shares[member] = max(shares.get(member, 0.0), share)
        norm_sq += blocks_norm_sq(payload, scales, self._block)
        mean = self._slice * math.sqrt(sum(shares.values()))
        allowed = (mean + rounding_allowance(mean, self._block)) * (1 + 1e-3)
        if math.sqrt(norm_sq) > allowed:
            raise Rejection(
                "too-large",
                f"the result of part {part} reaches norm {math.sqrt(norm_sq):.3g}, above the "
                f"{allowed:.3g} its contributors' bounded slices can average to",
            )
        self._parts[part] = (claim, norm_sq, shares)


class Output:
    """The output tensor of one round and the view that records what it holds."""

    def __init__(
        self,
        *,
        result: torch.Tensor | Encoded,
        group: Group,
        view: RoundView,
        codec: CodecConfig,
        aggregator: AggregatorConfig | None = None,
    ) -> None:
        """``result``: fp32 (each chunk decoded into it) or encoded (each chunk kept as it
        came, its scales checked as the decoder checks them); ``aggregator``: the round's,
        whose norm bound remote reducers' results are held to (None: not held)."""
        self.result = result
        self._group = group
        self._view = view
        self._codec = codec
        self._bound = (
            ResultBound(group=group, aggregator=aggregator, codec=codec)
            if aggregator is not None
            else None
        )

    def receive(self, reducer: int, message: wire.ResultMessage, raw: bytes) -> bool:
        """Decode a remote reducer's result chunk (``raw``, the message as it came) into the
        output; False when it is stale, Rejection if the reducer sent nonsense."""
        if not self._view.expects(message.part, message.epoch, reducer):
            return False
        spans = self._view.spans[message.part]
        if message.index >= len(spans):
            raise Rejection("bad-result", f"result chunk {message.index} of part {message.part}")
        numel = spans[message.index].numel
        payload, scales = decode_chunk(message.payload, message.scales, numel, self._codec)
        try:
            return self.apply(
                message.part,
                message.epoch,
                reducer,
                message.index,
                payload,
                scales,
                message.contributors,
                raw,
            )
        except Rejection:
            raise
        except SwarmlocoError as exc:  # CodecError: NaN/Inf, negative or huge scales
            raise Rejection("bad-result", str(exc)) from None

    def apply(
        self,
        part: int,
        epoch: int,
        reducer: int,
        index: int,
        payload: torch.Tensor,
        scales: torch.Tensor,
        bits: bytes,
        message: bytes,
    ) -> bool:
        """Decode one result chunk (``message``, the result message it came in) into the
        output; False when it is stale (another reducer or epoch holds the part now).
        CodecError when the decoder refuses it, Rejection ``too-large`` when a remote
        reducer's result passes its bound."""
        view = self._view
        if not view.expects(part, epoch, reducer):
            return False
        view.check_result(part, index, bits)
        span = view.spans[part][index]
        start = self._group.part_range(part)[0] + span.start
        # Recorded as received only once decoded and within bounds: a chunk the decoder
        # or the bound refuses (NaN or huge scales, a result too long) must leave its part
        # incomplete, so that failing its reducer moves the part on (a complete part would
        # stay, its slice of the result whatever the reused buffer held, different on
        # every member).
        if isinstance(self.result, Encoded):
            store_encoded_(self.result, start, payload, scales)
        else:
            dequantize_into_(self.result[start : start + span.numel], payload, scales, self._codec)
        if self._bound is not None and reducer != view.me:
            contributors = wire.members_of(bits, self._group.size)
            self._bound.check(part, epoch, reducer, payload, scales, contributors)
        view.on_result(part, index, bits, message)
        return True
