"""Tensors between pipeline stages, and the checks of what a remote peer sends.

A stage's input and output travel as ``StageTensor`` messages: raw fp32, bf16 or int64
buffers, or the codec's blockwise int8 (``core/codec.py``: a scale per block, about a
quarter of fp32's bytes). :func:`unpack` refuses, with a :class:`Rejection` and its code,
anything that is not what the receiving side expects at that boundary (:class:`Boundary`):
the wrong encoding, a shape other than ``(batch, tokens[, width])`` within the bounds, a
buffer of the wrong length, NaN or Inf, values over the bound, token ids outside the
vocabulary. Nothing is decoded before its size is checked.

The int8 encoder's kernel is compiled only for a tensor that repays the compile (the
data-parallel rule, :func:`~swarmloco.core.codec.settle_backend`), and :func:`prepare`
compiles it before a peer serves: a compile takes seconds to a minute on a fresh machine,
too long for a call under a deadline.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from swarmloco.core.codec import (
    CodecConfig,
    CodecError,
    Encoded,
    decode,
    encode,
    padded_numel,
    settle_backend,
)
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import stage_pb2 as pb

RAW = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64}
ENCODINGS = (*RAW, "int8")
ACTIVATION_BOUND = 1e4
"""The largest magnitude an activation or its gradient may hold (a transformer block's
output, or its gradient, stays far below it; 1e30 is an attack or a diverged peer)."""
BLOCK_SIZE = 1024
"""Values per scale of an int8 tensor this side packs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boundary:
    """What may cross one boundary between stages: token ids ``(batch, tokens)`` (``width``
    0; ``vocab`` bounds them), or activations ``(batch, tokens, width)`` bounded by
    ``bound``."""

    width: int
    max_batch: int
    max_tokens: int
    vocab: int = 0
    bound: float = ACTIVATION_BOUND

    @property
    def ids(self) -> bool:
        return self.width == 0

    @property
    def max_numel(self) -> int:
        """The values of the largest tensor that may cross."""
        return self.max_batch * self.max_tokens * max(self.width, 1)

    def check_shape(self, shape: tuple[int, ...], what: str) -> None:
        rank = 2 if self.ids else 3
        if len(shape) != rank or (rank == 3 and shape[2] != self.width):
            want = "(batch, tokens)" if self.ids else f"(batch, tokens, {self.width})"
            raise Rejection("bad-shape", f"{what}: shape {shape}, expected {want}")
        if not 1 <= shape[0] <= self.max_batch or not 1 <= shape[1] <= self.max_tokens:
            raise Rejection(
                "bad-shape",
                f"{what}: {shape[0]} x {shape[1]} is outside 1..{self.max_batch} sequences "
                f"of 1..{self.max_tokens} tokens",
            )


def wire_codec(numel: int, block_size: int = BLOCK_SIZE) -> CodecConfig:
    """The codec an int8 tensor of ``numel`` values is packed with: compiled kernels where
    they repay their compile, eager below (the same bits either way)."""
    return settle_backend(CodecConfig(block_size=block_size), numel)


def prepare(boundary: Boundary, encoding: str) -> float:
    """Compile now what packing the largest tensor ``boundary`` admits in ``encoding``
    compiles on its first use (nothing, for a tensor the eager kernel packs); returns the
    seconds it took."""
    if encoding != "int8" or boundary.ids:
        return 0.0
    codec = wire_codec(boundary.max_numel)
    if codec.backend == "eager":
        return 0.0
    started = time.monotonic()
    encode(torch.linspace(-1.0, 1.0, 4 * codec.block_size), codec)
    return time.monotonic() - started


def pack(x: torch.Tensor, encoding: str, *, block_size: int = BLOCK_SIZE) -> pb.StageTensor:
    """``x`` on the wire (``encoding``: f32, bf16, i64 or int8). A floating tensor that
    holds NaN or Inf is not sent: :class:`Rejection` ``not-finite`` (the other side would
    refuse it)."""
    shape = [int(d) for d in x.shape]
    not_finite = Rejection("not-finite", f"this stage computed NaN or Inf (shape {tuple(shape)})")
    if encoding == "int8":
        try:  # the encoder checks its scales: one pass finds NaN or Inf
            enc = encode(x.detach().float().cpu(), wire_codec(x.numel(), block_size))
        except CodecError:
            raise not_finite from None
        return pb.StageTensor(
            shape=shape,
            encoding="int8",
            data=enc.payload.numpy().tobytes(),
            scales=enc.scales.numpy().tobytes(),
            block_size=block_size,
        )
    if encoding not in RAW:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise not_finite
    raw = x.detach().to(RAW[encoding]).cpu().contiguous()
    data = raw.view(torch.int16) if encoding == "bf16" else raw  # numpy has no bfloat16
    return pb.StageTensor(shape=shape, encoding=encoding, data=data.numpy().tobytes())


def unpack(message: pb.StageTensor, boundary: Boundary, what: str) -> torch.Tensor:
    """The tensor ``message`` holds, as ``boundary`` allows it (fp32 activations, int64
    ids); raises :class:`Rejection` otherwise."""
    shape = tuple(int(d) for d in message.shape)
    boundary.check_shape(shape, what)
    numel = math.prod(shape)
    encoding = message.encoding
    if boundary.ids != (encoding == "i64"):
        raise Rejection("malformed", f"{what}: encoding {encoding!r} at this boundary")
    if encoding == "int8":
        x = _int8(message, numel, what).view(shape)
    elif encoding in RAW:
        dtype = RAW[encoding]
        size = numel * (torch.finfo(dtype).bits if dtype.is_floating_point else 64) // 8
        if len(message.data) != size:
            raise Rejection("malformed", f"{what}: {len(message.data)} bytes for {shape}")
        as_read = torch.int16 if dtype == torch.bfloat16 else dtype
        x = torch.frombuffer(bytearray(message.data), dtype=as_read).view(dtype).view(shape)
    else:
        raise Rejection("malformed", f"{what}: unknown encoding {encoding!r}")
    if boundary.ids:
        if numel and (int(x.min()) < 0 or int(x.max()) >= boundary.vocab):
            raise Rejection("out-of-bounds", f"{what}: token ids outside 0..{boundary.vocab - 1}")
        return x
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        raise Rejection("not-finite", f"{what}: holds NaN or Inf")
    if numel and float(x.abs().max()) > boundary.bound:
        raise Rejection("out-of-bounds", f"{what}: a value over {boundary.bound:g} in magnitude")
    return x


def _int8(message: pb.StageTensor, numel: int, what: str) -> torch.Tensor:
    block = int(message.block_size)
    if not 16 <= block <= 1 << 20:
        raise Rejection("malformed", f"{what}: block size {block}")
    padded = padded_numel(numel, block)
    if len(message.data) != padded or len(message.scales) != 4 * (padded // block):
        raise Rejection("malformed", f"{what}: int8 payload or scales of the wrong length")
    payload = torch.frombuffer(bytearray(message.data), dtype=torch.int8)
    scales = torch.frombuffer(bytearray(message.scales), dtype=torch.float32)
    try:
        return decode(Encoded(payload, scales, (numel,), block), "eager")
    except CodecError as exc:
        raise Rejection("not-finite", f"{what}: {exc}") from None


def wire_bytes(message: pb.StageTensor) -> int:
    """What ``message`` costs on the wire (its buffers)."""
    return len(message.data) + len(message.scales)
