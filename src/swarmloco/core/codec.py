"""The int8 codec: blockwise absmax quantization of flat fp32 vectors.

A vector is cut into blocks of ``block_size`` elements; each block is sent as int8 values
``q = round(x / s)`` with one scale ``s = absmax(block) / 127`` (fp32 by default, fp16 as an
option). So every element is reconstructed within ``s / 2 = absmax / 254`` of its value, and
the wire carries ``1 + scale_bytes / block_size`` bytes per element (1.0039 with fp32 scales
and blocks of 1024).

The hot functions take *block-aligned* flat tensors (length a multiple of ``block_size``):
the buffers of the averaging layer are allocated padded with zeros (:func:`padded_zeros`) so
that quantizing a part is one pass over memory with no copy. :func:`encode` / :func:`decode`
accept any shape and pad when they must.

Determinism: decoding is one IEEE multiplication per element (``float(q) * s``), the same on
every machine and backend, so every member of a group that decodes the same bytes holds the
same bits. Accumulation (``acc += w * q * s``) happens only on the member that reduces a part;
its result is re-quantized before anyone uses it.

Speed: the quantize and error-feedback kernels are compiled with ``torch.compile`` (one
fused loop per block) when the platform can compile and the vector is large enough to repay
the compile (:func:`settle_backend`), and run as plain eager torch otherwise. Decoding is not
compiled: inductor's CPU code reads int8 eight values at a time through a partial load, and
torch's own mixed-type ``mul(out=)`` / ``addcmul_`` run twice as fast on the same input (one
pass, no temporary), on every backend. ``scripts/bench_codec.py`` measures both against a
memory copy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import torch

from swarmloco.core.config import require, require_int
from swarmloco.core.toolchain import missing_compiler
from swarmloco.errors import CodecError

log = logging.getLogger(__name__)

QMAX = 127
MAX_SCALE = float(torch.finfo(torch.float32).max) / 128
"""The largest scale a decoder accepts: an int8 value (at most 128 in magnitude) times it
is still a finite float32, so decoding valid input never yields Inf."""
R = TypeVar("R")
ScaleDType = Literal["float32", "float16"]
Backend = Literal["auto", "compiled", "eager"]
_SCALE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How pseudo-gradients are quantized on the wire."""

    block_size: int = 1024
    """Elements per scale; larger blocks cost fewer bytes but quantize coarser."""
    scale_dtype: ScaleDType = "float32"
    """Wire type of the per-block scales (float16 halves their cost; see module notes)."""
    chunk_bytes: int = 1 << 20
    """Target wire size of one chunk (int8 payload plus scales); about 1 MiB."""
    error_feedback: bool = False
    """Keep the quantization residual and add it to the next round's update."""
    backend: Backend = "auto"
    """``compiled`` (torch.compile), ``eager`` (plain torch) or ``auto`` (compiled if possible)."""

    def __post_init__(self) -> None:
        require_int("block_size", self.block_size, minimum=16)
        require(self.block_size <= 1 << 20, f"block_size must be <= 1048576, got {self.block_size}")
        require(
            self.scale_dtype in _SCALE_DTYPES,
            f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, got {self.scale_dtype!r}",
        )
        require_int("chunk_bytes", self.chunk_bytes, minimum=64)
        require(
            self.backend in ("auto", "compiled", "eager"),
            f"backend must be auto, compiled or eager, got {self.backend!r}",
        )

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    @property
    def scale_bytes(self) -> int:
        return 4 if self.scale_dtype == "float32" else 2

    def wire_bytes(self, numel: int) -> int:
        """Bytes on the wire for a vector of ``numel`` elements (payload padded to blocks)."""
        blocks = num_blocks(numel, self.block_size)
        return blocks * (self.block_size + self.scale_bytes)

    def blocks_per_chunk(self) -> int:
        return max(1, self.chunk_bytes // (self.block_size + self.scale_bytes))

    def max_chunk_bytes(self) -> int:
        """The most payload and scales one chunk carries on the wire."""
        return self.blocks_per_chunk() * (self.block_size + self.scale_bytes)


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def padded_numel(numel: int, block_size: int) -> int:
    return num_blocks(numel, block_size) * block_size


def padded_zeros(numel: int, block_size: int) -> torch.Tensor:
    """A zero fp32 buffer of ``numel`` elements rounded up to whole blocks."""
    return torch.zeros(padded_numel(numel, block_size), dtype=torch.float32)


# --------------------------------------------------------------------------- kernels
# Each kernel works on a (blocks, block_size) view. They are written once and either run
# eagerly or through torch.compile; eager and compiled give the same bits (tested).


def _quantize_kernel(
    xb: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = xb.abs().amax(dim=1)  # NaN propagates, so one finiteness check of the scales
    # Quantize with the scale as sent: an fp16 scale rounded down would push |x / s| a hair
    # above 127, which the clamp absorbs.
    scale = (absmax / QMAX).to(scale_dtype).float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xb * inverse[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.to(scale_dtype)


def _quantize_into_kernel(
    xb: torch.Tensor, qb: torch.Tensor, scale_out: torch.Tensor, scale_dtype: torch.dtype
) -> None:
    q, scale = _quantize_kernel(xb, scale_dtype)
    qb.copy_(q)
    scale_out.copy_(scale)


# torch converts the int8 operand of a mixed-type operation through a temporary of its
# size: in slices of this many values it stays in cache, and a large vector decodes at the
# speed of a small one.
_DECODE_SLICE = 1 << 20


def _slices(q: torch.Tensor) -> Iterator[slice]:
    """The rows of ``q`` (blocks) in slices of about ``_DECODE_SLICE`` values."""
    step = max(1, _DECODE_SLICE // q.shape[1])
    return (slice(i, i + step) for i in range(0, q.shape[0], step))


def _decode_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, weight: float) -> None:
    """``out = float(q) * (s * weight)`` per block: one rounding per element, the same
    bits as ``q.float() * s`` when ``weight`` is 1."""
    s = (scale.float() if weight == 1.0 else scale.float() * weight)[:, None]
    for i in _slices(q):
        torch.mul(q[i], s[i], out=out[i])


def _accumulate(acc: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, weight: float) -> None:
    """``acc += float(q) * (s * weight)`` per block, in one pass (the product and the sum
    may be rounded once, as one fused multiply-add)."""
    s = (scale.float() * weight)[:, None]
    for i in _slices(q):
        acc[i].addcmul_(q[i], s[i])


def _subtract_kernel(acc: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    acc.sub_(q.float() * scale.float()[:, None])  # the product rounded, then the difference


def _trim_pair_kernel(
    hi: torch.Tensor, lo: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
) -> None:
    x = q.float() * scale.float()[:, None]
    lo.copy_(torch.minimum(hi, x))
    hi.copy_(torch.maximum(hi, x))


def _trim_one_kernel(
    hi: torch.Tensor,
    lo: torch.Tensor,
    middle: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    x = q.float() * scale.float()[:, None]
    fell = torch.minimum(hi, x)  # what the largest so far does not keep
    hi.copy_(torch.maximum(hi, x))
    middle.add_(torch.maximum(lo, fell))  # of the two below the largest, the larger
    lo.copy_(torch.minimum(lo, fell))


class _Kernels:
    """The kernels, compiled on first use when the backend allows it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compiled: dict[str, Callable[..., Any]] = {}
        self._compile_failed: str | None = None

    def get(self, name: str, eager: Callable[..., R], backend: Backend) -> Callable[..., R]:
        if backend == "eager" or (backend == "auto" and self._compile_failed is not None):
            return eager
        if (missing := missing_compiler("cpu")) is not None:
            if backend == "compiled":
                raise CodecError(f"the compiled codec cannot be built here: {missing}")
            self._compile_failed = missing
            log.warning("the codec runs eager (slower on large models): %s", missing)
            return eager
        with self._lock:
            fn = self._compiled.get(name)
            if fn is None:
                fn = torch.compile(eager, dynamic=True, fullgraph=True)
                self._compiled[name] = fn
        return fn  # type: ignore[no-any-return]

    def run(self, name: str, eager: Callable[..., R], backend: Backend, *args: object) -> R:
        fn = self.get(name, eager, backend)
        # Always without autograd, and on tensors that are nobody's view (``detach``: the
        # same memory): a compiled kernel guards on the grad mode and on the layout of
        # its inputs' bases, and one warmed up on fresh tensors with autograd on would
        # compile again for a round's slices under no_grad (seconds to a minute).
        with torch.no_grad():
            if fn is eager:
                return eager(*args)
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            try:
                return fn(*args)
            except Exception as exc:  # compilation needs a C compiler and a supported platform
                if backend == "compiled":
                    raise CodecError(f"the compiled codec failed: {exc}") from exc
                self._compile_failed = f"{type(exc).__name__}: {exc}"
                log.warning("torch.compile is unavailable (%s); using the eager codec", exc)
                return eager(*args)

    @property
    def compile_failure(self) -> str | None:
        return self._compile_failed


_KERNELS = _Kernels()


def compile_failure() -> str | None:
    """Why the compiled codec is not in use (None if it is, or was never tried)."""
    return _KERNELS.compile_failure


def _blocks(x: torch.Tensor, block_size: int, what: str) -> torch.Tensor:
    if x.dim() != 1 or not x.is_contiguous():
        raise CodecError(f"{what} must be a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    if x.numel() % block_size:
        raise CodecError(
            f"{what} has {x.numel()} elements, not a multiple of the block size {block_size}"
        )
    return x.view(-1, block_size)


def _check_scales(scale: torch.Tensor, what: str) -> None:
    finite = torch.isfinite(scale)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise CodecError(
            f"{what} contains NaN or Inf (first in block {bad}); refusing to encode it"
        )


# --------------------------------------------------------------------------- block-aligned API


def quantize(
    x: torch.Tensor,
    config: CodecConfig,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a block-aligned fp32 vector: int8 values (same length) and one scale per block.

    ``out``: existing (int8 values, scales) buffers to write into (e.g. reused every round,
    which spares the page faults of fresh memory); new tensors by default.
    Raises CodecError if ``x`` holds NaN or Inf.
    """
    if x.dtype != torch.float32:
        raise CodecError(f"expected a float32 tensor, got {x.dtype}")
    xb = _blocks(x, config.block_size, "input")
    if out is None:
        q, scale = _KERNELS.run(
            "quantize", _quantize_kernel, config.backend, xb, config.scale_torch_dtype
        )
    else:
        q, scale = out
        if q.dtype != torch.int8 or q.shape != x.shape or not q.is_contiguous():
            raise CodecError(f"out values must be contiguous int8 of shape {tuple(x.shape)}")
        if scale.dtype != config.scale_torch_dtype or scale.shape != (xb.shape[0],):
            raise CodecError(f"out scales must be {xb.shape[0]} x {config.scale_dtype}")
        _KERNELS.run(
            "quantize_into",
            _quantize_into_kernel,
            config.backend,
            xb,
            q.view(-1, config.block_size),
            scale,
            config.scale_torch_dtype,
        )
    _check_scales(scale, "input")
    return q.view(-1), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block_size: int, backend: Backend = "auto"
) -> torch.Tensor:
    """Decode int8 values: one IEEE multiplication per element, identical everywhere
    (``backend`` is accepted for symmetry with the encoders; decoding never compiles)."""
    qb = _blocks(q, block_size, "payload")
    _check_decode_args(qb, scale)
    out = torch.empty(qb.shape, dtype=torch.float32)
    _decode_into(out, qb, scale, 1.0)
    return out.view(-1)


def dequantize_accumulate_(
    acc: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: float,
    config: CodecConfig,
) -> None:
    """``acc += weight * decode(q, scale)`` in place, in one pass."""
    ab, qb = _decode_target(acc, q, scale, weight, config, "accumulator")
    _accumulate(ab, qb, scale, float(weight))


def dequantize_into_(
    out: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    config: CodecConfig,
    weight: float = 1.0,
) -> None:
    """``out = weight * decode(q, scale)`` in place, in one pass (``out`` need not be zeroed).

    With weight 1 this is exactly :func:`dequantize` (``s * 1.0 == s``), written into an
    existing buffer: the averaging layer decodes results into a reused buffer this way and
    starts each reducer's sum with its first contribution, so no buffer is zero-filled.
    """
    ob, qb = _decode_target(out, q, scale, weight, config, "output")
    _decode_into(ob, qb, scale, float(weight))


def dequantize_trim_one_(
    hi: torch.Tensor,
    lo: torch.Tensor,
    middle: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    config: CodecConfig,
    *,
    taken: int,
) -> None:
    """Decode one row into a running trimmed mean that drops one value at each end, in
    one pass: per coordinate ``hi`` keeps the largest value so far, ``lo`` the smallest,
    and every other value is added to ``middle``. ``taken`` is the number of rows already
    in: the first row is written to ``hi``, the second splits into ``hi`` and ``lo``, the
    third starts ``middle`` (none of the three needs initialised buffers before it writes
    them). After ``n >= 3`` rows the trimmed mean is ``middle / (n - 2)``; nothing is ever
    subtracted, so a huge value cannot cancel the others."""
    require_int("taken", taken, minimum=0)
    mb, qb = _decode_target(middle, q, scale, 1.0, config, "middle sum")  # checks q, scale
    hb = _blocks_like(hi, mb, config, "largest values")
    lb = _blocks_like(lo, mb, config, "smallest values")
    if taken == 0:
        _decode_into(hb, qb, scale, 1.0)
        return
    if taken == 1:
        _KERNELS.run("trim_pair", _trim_pair_kernel, config.backend, hb, lb, qb, scale)
        return
    if taken == 2:
        mb.zero_()
    _KERNELS.run("trim_one", _trim_one_kernel, config.backend, hb, lb, mb, qb, scale)


def _decode_target(
    target: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: float,
    config: CodecConfig,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks of the in-place decoders; the block views of ``target`` and ``q``."""
    if target.dtype != torch.float32:
        raise CodecError(f"{what} must be float32, got {target.dtype}")
    if not math.isfinite(weight):
        raise CodecError(f"weight must be finite, got {weight}")
    tb = _blocks(target, config.block_size, what)
    qb = _blocks(q, config.block_size, "payload")
    if tb.shape != qb.shape:
        raise CodecError(f"payload has {q.numel()} elements, {what} {target.numel()}")
    _check_decode_args(qb, scale)
    return tb, qb


def _blocks_like(
    target: torch.Tensor, like: torch.Tensor, config: CodecConfig, what: str
) -> torch.Tensor:
    """``target``'s block view, checked to match ``like`` (a checked target's)."""
    if target.dtype != torch.float32:
        raise CodecError(f"{what} must be float32, got {target.dtype}")
    tb = _blocks(target, config.block_size, what)
    if tb.shape != like.shape:
        raise CodecError(f"{what} has {target.numel()} elements, expected {like.numel()}")
    return tb


def check_encoded(q: torch.Tensor, scale: torch.Tensor, config: CodecConfig) -> None:
    """CodecError for int8 values and scales the decoders would refuse (decoding nothing)."""
    _check_decode_args(_blocks(q, config.block_size, "payload"), scale)


def _check_decode_args(qb: torch.Tensor, scale: torch.Tensor) -> None:
    if qb.dtype != torch.int8:
        raise CodecError(f"payload must be int8, got {qb.dtype}")
    if scale.dim() != 1 or scale.numel() != qb.shape[0]:
        raise CodecError(f"expected {qb.shape[0]} scales, got {scale.numel()}")
    if scale.dtype not in (torch.float32, torch.float16):
        raise CodecError(f"scales must be float32 or float16, got {scale.dtype}")
    finite = torch.isfinite(scale) & (scale >= 0) & (scale <= MAX_SCALE)
    if not bool(finite.all()):
        raise CodecError(f"scales must be finite, non-negative and at most {MAX_SCALE:.3g}")


# --------------------------------------------------------------------------- any-shape API


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An encoded tensor: int8 payload padded to whole blocks, scales, and the real shape."""

    payload: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    block_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.payload.numel() + self.scales.numel() * self.scales.element_size()


def encoded_zeros(numel: int, config: CodecConfig) -> Encoded:
    """A block-aligned flat vector of ``numel`` zeros, encoded (a buffer to encode or
    receive into: about 1 byte a value instead of fp32's 4)."""
    blocks = num_blocks(numel, config.block_size)
    return Encoded(
        torch.zeros(blocks * config.block_size, dtype=torch.int8),
        torch.zeros(blocks, dtype=config.scale_torch_dtype),
        (blocks * config.block_size,),
        config.block_size,
    )


def encoded_slice(encoded: Encoded, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and scales of ``[start, stop)`` of a flat encoded vector (views; whole
    blocks)."""
    b = encoded.block_size
    if start % b or stop % b or not 0 <= start <= stop <= encoded.payload.numel():
        raise CodecError(f"values {start}..{stop} are not whole blocks of {b} of the vector")
    return encoded.payload[start:stop], encoded.scales[start // b : stop // b]


def decode_slice_into(out: torch.Tensor, encoded: Encoded, start: int) -> None:
    """``out = decode(encoded)[start : start + len(out)]`` (whole blocks), in place: the
    same bits as decoding the whole vector."""
    q, scale = encoded_slice(encoded, start, start + out.numel())
    dequantize_into_(out, q, scale, CodecConfig(block_size=encoded.block_size))


def store_encoded_(encoded: Encoded, start: int, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Keep received values and scales at ``start`` of a flat encoded vector, as they
    came (CodecError, and nothing kept, for scales the decoder would refuse)."""
    into_q, into_scale = encoded_slice(encoded, start, start + q.numel())
    _check_decode_args(q.view(-1, encoded.block_size), scale)
    if scale.dtype != into_scale.dtype:
        raise CodecError(f"scales are {scale.dtype}, this vector's {into_scale.dtype}")
    into_q.copy_(q)
    into_scale.copy_(scale)


def blocks_norm_sq(payload: torch.Tensor, scales: torch.Tensor, block_size: int) -> float:
    """The squared L2 norm of what int8 ``payload`` (whole blocks) and its block ``scales``
    decode to, without decoding them: per block, the norm of its int8 values (exact in
    float32: at most 128 * sqrt(block)) times its scale."""
    per_block = torch.linalg.vector_norm(payload.view(-1, block_size).to(torch.float32), dim=1)
    return float(torch.dot(per_block.double().square(), scales.double().square()))


def encoded_norm(encoded: Encoded) -> float:
    """The L2 norm of what ``encoded`` decodes to, a slab at a time (nothing of its size
    is decoded)."""
    b = encoded.block_size
    blocks = encoded.payload.view(-1, b)
    squares = sum(blocks_norm_sq(blocks[i], encoded.scales[i], b) for i in _slices(blocks))
    return math.sqrt(squares)


def _padded_flat(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.detach().reshape(-1).to(torch.float32)
    extra = padded_numel(flat.numel(), block_size) - flat.numel()
    if extra:
        flat = torch.cat([flat, flat.new_zeros(extra)])
    return flat.contiguous()


def encode(x: torch.Tensor, config: CodecConfig | None = None) -> Encoded:
    """Encode a tensor of any shape (copies to pad it to whole blocks when needed)."""
    config = config or CodecConfig()
    q, scale = quantize(_padded_flat(x, config.block_size), config)
    return Encoded(q, scale, tuple(x.shape), config.block_size)


def decode(encoded: Encoded, backend: Backend = "auto") -> torch.Tensor:
    """Decode an :class:`Encoded` back to a float32 tensor of its shape."""
    flat = dequantize(encoded.payload, encoded.scales, encoded.block_size, backend)
    return flat[: encoded.numel].reshape(encoded.shape)


def l2_norm(x: torch.Tensor) -> float:
    """The L2 norm of ``x`` as a Python float: in float32 (one fast pass), and again in
    float64 only if that overflowed (squares of values above ~1.8e19 do)."""
    norm = float(torch.linalg.vector_norm(x))
    if math.isfinite(norm):
        return norm
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


class ErrorFeedback:
    """The sender-side residual of error feedback (*1-bit Adam*, section 3.1).

    ``encode(x)`` sends ``q(x + e)`` and keeps ``e <- (x + e) - decode(q(x + e))``. Call
    :meth:`rollback` when the round that carried the message is aborted: the caller's delta
    still holds the whole update, so the residual must return to what it was.
    """

    def __init__(self, numel: int, config: CodecConfig) -> None:
        self.config = config
        self.residual = padded_zeros(numel, config.block_size)
        self._backup = torch.empty_like(self.residual)
        self._can_rollback = False

    def encode(
        self, x: torch.Tensor, max_norm: float = math.inf
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x + residual`` and update the residual in place (no allocation).

        ``max_norm``: if ``x + residual`` is longer, it is scaled down to that L2 norm first
        (what is cut off is dropped, not carried to the next message).
        """
        if x.shape != self.residual.shape:
            raise CodecError(
                f"error feedback was set up for {self.residual.numel()} padded elements, "
                f"got {x.numel()}"
            )
        self._backup.copy_(self.residual)
        self.residual.add_(x)
        if math.isfinite(max_norm):
            norm = l2_norm(self.residual)
            if norm > max_norm:
                self.residual.mul_(max_norm / norm * (1 - 1e-6))
        try:
            q, scale = quantize(self.residual, self.config)
        except CodecError:
            self.residual.copy_(self._backup)
            raise
        # Exactly acc - decode(q, s) (no fused multiply-add): the residual is the true error.
        rb, qb = _decode_target(self.residual, q, scale, 1.0, self.config, "residual")
        _KERNELS.run("subtract", _subtract_kernel, self.config.backend, rb, qb, scale)
        self._can_rollback = True
        return q, scale

    def begin(self) -> None:
        """Start a message encoded a slab at a time (:meth:`encode_slab`): what
        :meth:`rollback` returns to."""
        self._backup.copy_(self.residual)
        self._can_rollback = True

    def encode_slab(
        self, start: int, x: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """:meth:`encode` of ``x``, the values ``[start, start + len(x))`` of the message
        (whole blocks), into ``out`` (values, scales); after :meth:`begin`."""
        residual = self.residual[start : start + x.numel()]
        residual.add_(x)
        q, scale = quantize(residual, self.config, out=out)
        rb, qb = _decode_target(residual, q, scale, 1.0, self.config, "residual")
        _KERNELS.run("subtract", _subtract_kernel, self.config.backend, rb, qb, scale)

    def scale(self, factor: float) -> None:
        """The message was scaled by ``factor`` (a norm bound): what it left out shrinks
        alike (what the bound cut off is dropped, as :meth:`encode` drops it)."""
        self.residual.mul_(factor)

    def rollback(self) -> None:
        """Undo the last :meth:`encode` (its round was aborted, nothing was applied)."""
        if self._can_rollback:
            self.residual.copy_(self._backup)
            self._can_rollback = False

    def commit(self) -> None:
        """The last encoded message was applied: it can no longer be rolled back."""
        self._can_rollback = False


# Below this many values, ``auto`` runs the eager kernels. Compiling them costs every new
# process 6-13 s of CPU (2 cores; inductor's on-disk cache warm, then cold), while the eager
# kernels cost little at this size: quantize, error feedback and one accumulate of 840K
# values take 16.8 ms eager against 10.0 ms compiled (11M values: 268 against 112 ms).
COMPILE_FROM = 1 << 22


def settle_backend(config: CodecConfig, numel: int) -> CodecConfig:
    """``config`` with ``auto`` settled for a run whose vector has ``numel`` values: eager
    below :data:`COMPILE_FROM` (the compile would cost more than it saves), ``auto``
    (compiled where the platform can) from there. An explicit backend is kept."""
    if config.backend == "auto" and numel < COMPILE_FROM:
        return dataclasses.replace(config, backend="eager")
    return config


def warm_up(config: CodecConfig, *, trimmed: bool = True) -> float:
    """Compile the kernels a round runs with ``config`` now (its error feedback's if it
    has it, and the trimmed mean's if ``trimmed``); return the seconds it took.

    The compiled kernels are built on first use, which takes seconds (a minute on a fresh
    GPU box). A peer calls this before it joins a swarm, so that its first round does not
    stall its event loop (and the other members, who would take the silence for a
    failure); a kernel a round does not run is not compiled.
    """
    started = time.monotonic()
    x = torch.linspace(-1.0, 1.0, 4 * config.block_size)
    q, scale = quantize(x, config)
    quantize(x, config, out=(torch.empty_like(q), torch.empty_like(scale)))
    dequantize(q, scale, config.block_size, config.backend)
    acc = torch.zeros_like(x)
    dequantize_accumulate_(acc, q, scale, 0.5, config)
    if config.error_feedback:
        ErrorFeedback(x.numel(), config).encode(x)
    dequantize_into_(acc, q, scale, config, 2.0)
    if trimmed:
        hi, lo = torch.empty_like(x), torch.empty_like(x)
        for taken in range(3):
            dequantize_trim_one_(hi, lo, acc, q, scale, config, taken=taken)
    return time.monotonic() - started


# --------------------------------------------------------------------------- chunks


@dataclasses.dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a block-aligned vector: blocks ``[first_block, first_block + blocks)``."""

    index: int
    first_block: int
    blocks: int
    block_size: int

    @property
    def start(self) -> int:
        return self.first_block * self.block_size

    @property
    def stop(self) -> int:
        return (self.first_block + self.blocks) * self.block_size

    @property
    def numel(self) -> int:
        return self.blocks * self.block_size


def chunk_spans(numel: int, config: CodecConfig) -> list[ChunkSpan]:
    """Cut a vector of ``numel`` elements (padded to blocks) into chunks of about
    ``config.chunk_bytes`` on the wire. Each chunk decodes on its own."""
    total = num_blocks(numel, config.block_size)
    per_chunk = config.blocks_per_chunk()
    return [
        ChunkSpan(i, first, min(per_chunk, total - first), config.block_size)
        for i, first in enumerate(range(0, total, per_chunk))
    ]
