"""The round's result as it arrives: every result chunk checked and decoded into the output
tensor (or kept as it came, for an output kept encoded), whoever reduced it (a remote
reducer or this member). No I/O.

Decoding is one multiply per element (q * s), the same on every member for the same bytes:
identical bits everywhere, so that every member's digest of its result is the same.
"""

from __future__ import annotations

import torch

from swarmloco.core.codec import CodecConfig, Encoded, dequantize_into_, store_encoded_
from swarmloco.errors import SwarmlocoError
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.group import Group
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


class Output:
    """The output tensor of one round and the view that records what it holds."""

    def __init__(
        self,
        *,
        result: torch.Tensor | Encoded,
        group: Group,
        view: RoundView,
        codec: CodecConfig,
    ) -> None:
        """``result``: fp32 (each chunk decoded into it) or encoded (each chunk kept as it
        came, its scales checked as the decoder checks them)."""
        self.result = result
        self._group = group
        self._view = view
        self._codec = codec

    def receive(self, reducer: int, message: wire.ResultMessage) -> bool:
        """Decode a remote reducer's result chunk into the output; False when it is stale,
        Rejection if the reducer sent nonsense."""
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
            )
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
    ) -> bool:
        """Decode one result chunk into the output; False when it is stale (another
        reducer or epoch holds the part now). CodecError when the decoder refuses it."""
        view = self._view
        if not view.expects(part, epoch, reducer):
            return False
        view.check_result(part, index, bits)
        span = view.spans[part][index]
        start = self._group.part_range(part)[0] + span.start
        # Recorded as received only once decoded: a chunk the decoder refuses (NaN or huge
        # scales) must leave its part incomplete, so that failing its reducer moves the
        # part on (a complete part would stay, its slice of the result whatever the reused
        # buffer held, different on every member).
        if isinstance(self.result, Encoded):
            store_encoded_(self.result, start, payload, scales)
        else:
            dequantize_into_(self.result[start : start + span.numel], payload, scales, self._codec)
        view.on_result(part, index, bits)
        return True
