"""The global state one peer hands to another: named flat tensors, their layout, their digest.

A :class:`StateSnapshot` is what a donor serves and a joining peer receives (DESIGN
section 6): the swarm id, the round number and named flat tensors (``theta_g`` and the
outer momentum, see :data:`THETA_G` and :data:`MOMENTUM`). Its digest
(:func:`state_digest`) is BLAKE2b-256 over the tensors' names, dtypes and sizes and then
their raw bytes, in the canonical order (sorted by name). Peers publish it under
``digest/<r>`` and compare it to find the majority state of a round; a joining peer checks
the state it downloaded against it. :class:`StateHasher` computes the same digest
incrementally, over the bytes as they arrive in chunks.

On the wire and in the digest a tensor is its raw little-endian buffer, never a pickle.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

import torch

from swarmloco.core.agreement import DIGEST_BYTES
from swarmloco.core.manifest import check_swarm_id

THETA_G = "theta_g"
"""Name of the global parameters (flat fp32) in a snapshot."""
MOMENTUM = "momentum"
"""Name of the outer optimizer's momentum buffer (flat fp32, absent in a fresh swarm)."""
LANDED = "landed"
"""Name of the sequences of a pinned dataset that landed in the state (int64, of any length
up to :data:`MAX_LANDED_VALUES`; absent until some did: ``dataset.ledger.Landed``)."""
MAX_LANDED_VALUES = 1 << 22
"""Values a state's landed sequences hold at most (32 MiB: a million ranges)."""
TOKENS = "tokens"
"""Name of the swarm's token count (int64[1]: the summed weights of every round's group;
absent in a fresh swarm)."""

MAX_NAME_CHARS = 128
_NAME = re.compile(rf"[A-Za-z0-9_.\-/]{{1,{MAX_NAME_CHARS}}}")
_DIGEST_DOMAIN = b"swarmloco/v1/state\x00"

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "int64": torch.int64,
        "int32": torch.int32,
        "int16": torch.int16,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "bool": torch.bool,
    }
)
"""The dtypes a state may hold, by their wire name."""
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One flat tensor of a state: its name, dtype (a key of :data:`DTYPES`) and length."""

    name: str
    dtype: str
    numel: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def empty(self) -> torch.Tensor:
        """A new, uninitialized tensor of this spec."""
        return torch.empty(self.numel, dtype=DTYPES[self.dtype])


def check_name(name: str) -> str | None:
    """Why ``name`` cannot name a tensor of a state, or None if it can."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return (
            f"tensor name {str(name)[:40]!r} must be 1 to {MAX_NAME_CHARS} characters of "
            "letters, digits and _ . - /"
        )
    return None


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The spec of a flat, contiguous CPU tensor; ValueError for any other tensor."""
    problem = check_name(name)
    if problem:
        raise ValueError(problem)
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(
            f"tensor {name!r} has dtype {tensor.dtype}; a state holds only {', '.join(DTYPES)}"
        )
    if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(
            f"tensor {name!r} must be flat, contiguous and on the CPU, got shape "
            f"{tuple(tensor.shape)} on {tensor.device}"
        )
    return TensorSpec(name, dtype, tensor.numel())


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's buffer as bytes (no copy; writable: writing changes the tensor)."""
    _require_little_endian()
    return tensor.detach().view(torch.uint8).numpy().data.cast("B")


class StateHasher:
    """:func:`state_digest`, incrementally: give it the tensors' bytes in order, any cuts."""

    def __init__(self, specs: Iterable[TensorSpec]) -> None:
        self._hash = hashlib.blake2b(_DIGEST_DOMAIN, digest_size=DIGEST_BYTES)
        specs = list(specs)
        self._hash.update(struct.pack("<I", len(specs)))
        for spec in specs:
            name, dtype = spec.name.encode(), spec.dtype.encode()
            self._hash.update(struct.pack("<H", len(name)) + name)
            self._hash.update(struct.pack("<H", len(dtype)) + dtype)
            self._hash.update(struct.pack("<Q", spec.numel))

    def update(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def digest(self) -> bytes:
        return self._hash.digest()


def state_digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """BLAKE2b-256 of named flat tensors: their specs, then their bytes, sorted by name."""
    ordered = sorted(tensors.items())
    hasher = StateHasher(spec_of(name, tensor) for name, tensor in ordered)
    for _, tensor in ordered:
        hasher.update(raw_bytes(tensor))
    return hasher.digest()


class StateSource(Protocol):
    """Where a snapshot's bytes are: its tensors' raw buffers concatenated in its order."""

    def read(self, offset: int, size: int) -> bytes | memoryview:
        """``size`` bytes from ``offset`` (a view where no copy is needed)."""
        ...

    def read_into(self, offset: int, out: memoryview) -> None:
        """``len(out)`` bytes from ``offset`` into ``out``."""
        ...


class MemorySource:
    """A snapshot's bytes in tensors held in memory (views of them: no copy)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._raws = [raw_bytes(t) for t in tensors]
        self._starts = list(itertools.accumulate((len(r) for r in self._raws), initial=0))

    def read(self, offset: int, size: int) -> bytes | memoryview:
        pieces = list(self._pieces(offset, size))
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def read_into(self, offset: int, out: memoryview) -> None:
        pos = 0
        for piece in self._pieces(offset, len(out)):
            out[pos : pos + len(piece)] = piece
            pos += len(piece)

    def _pieces(self, offset: int, size: int) -> Iterator[memoryview]:
        if offset < 0 or size < 0 or offset + size > self._starts[-1]:
            raise ValueError(f"bytes {offset}..{offset + size} of a {self._starts[-1]}-byte state")
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while size > 0:
            raw, at = self._raws[i], offset - self._starts[i]
            take = min(size, len(raw) - at)
            if take > 0:
                yield raw[at : at + take]
                offset, size = offset + take, size - take
            i += 1


PIECE_VALUES = 1 << 20
"""Values of a tensor read at once when a state is walked piece by piece (4 MB of fp32)."""


@dataclasses.dataclass(frozen=True, eq=False)
class StateSnapshot:
    """The global state of one round, as served and received. Build it with :meth:`of`
    (tensors in memory) or :meth:`from_source` (bytes elsewhere, e.g. a file).

    The tensors are in the canonical order (sorted by name). Whoever serves a snapshot
    must not modify its tensors while it is served: hand out a copy per round instead.
    Read it with :meth:`chunks` (the wire's bytes), :meth:`read_into` (one tensor into a
    buffer) or :meth:`pieces` (one tensor a piece at a time): none of these holds a
    file-backed state in memory whole.
    """

    swarm_id: str
    round: int
    specs: tuple[TensorSpec, ...]
    digest: bytes
    source: StateSource

    @classmethod
    def of(
        cls,
        *,
        swarm_id: str,
        round: int,
        tensors: Mapping[str, torch.Tensor],
        digest: bytes | None = None,
    ) -> StateSnapshot:
        """A snapshot of ``tensors`` (flat, contiguous, CPU); its digest is computed unless
        given (a peer that already published it need not hash the state again)."""
        ordered = {name: tensors[name] for name in sorted(tensors)}
        specs = tuple(spec_of(name, tensor) for name, tensor in ordered.items())
        if digest is None:
            digest = state_digest(ordered)
        return cls.from_source(
            swarm_id=swarm_id,
            round=round,
            specs=specs,
            digest=digest,
            source=MemorySource(ordered.values()),
        )

    @classmethod
    def from_source(
        cls,
        *,
        swarm_id: str,
        round: int,
        specs: Iterable[TensorSpec],
        digest: bytes,
        source: StateSource,
    ) -> StateSnapshot:
        """A snapshot of the tensors ``specs`` name, whose bytes ``source`` holds."""
        if not isinstance(round, int) or isinstance(round, bool) or round < 0:
            raise ValueError(f"round must be an integer >= 0, got {round!r}")
        specs = tuple(specs)
        if [s.name for s in specs] != sorted({s.name for s in specs}):
            raise ValueError("a state's tensors are named once each, in sorted order")
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a state digest has {DIGEST_BYTES} bytes, got {len(digest)}")
        return cls(check_swarm_id(swarm_id), round, specs, bytes(digest), source)

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    def spec(self, name: str) -> TensorSpec | None:
        return next((s for s in self.specs if s.name == name), None)

    def _offset(self, name: str) -> tuple[int, TensorSpec]:
        offset = 0
        for spec in self.specs:
            if spec.name == name:
                return offset, spec
            offset += spec.nbytes
        raise KeyError(name)

    def chunks(self, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        """The tensors' bytes, concatenated in order and cut every ``chunk_bytes``."""
        total = self.nbytes
        for offset in range(0, total, chunk_bytes):
            yield self.source.read(offset, min(chunk_bytes, total - offset))

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Tensor ``name`` into ``out`` (contiguous, of its dtype and length)."""
        offset, spec = self._offset(name)
        if out.dtype != DTYPES[spec.dtype] or out.numel() != spec.numel:
            raise ValueError(
                f"{name} is {spec.dtype}[{spec.numel}], not {out.dtype}[{out.numel()}]"
            )
        self.source.read_into(offset, raw_bytes(out.reshape(-1)))

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, whole, in a new buffer (for small tensors, and tests)."""
        spec = self._offset(name)[1]
        out = spec.empty()
        self.read_into(name, out)
        return out

    def pieces(self, name: str, values: int = PIECE_VALUES) -> Iterator[torch.Tensor]:
        """Tensor ``name`` in order, at most ``values`` values at a time. Each piece may
        be a buffer the next one overwrites: use it before asking for the next."""
        offset, spec = self._offset(name)
        buffer = torch.empty(min(values, spec.numel), dtype=DTYPES[spec.dtype])
        raw = raw_bytes(buffer)
        for start in range(0, spec.numel, values):
            n = min(values, spec.numel - start)
            self.source.read_into(offset + start * spec.itemsize, raw[: n * spec.itemsize])
            yield buffer[:n]

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every tensor, whole, by name: read into memory (small states and tests; a peer
        reads a large state with :meth:`pieces` or :meth:`read_into`)."""
        return MappingProxyType({spec.name: self.tensor(spec.name) for spec in self.specs})

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s.name}: {s.dtype}[{s.numel}]" for s in self.specs)
        return (
            f"StateSnapshot(swarm {self.swarm_id[:12]}, round {self.round}, {{{sizes}}}, "
            f"digest {self.digest.hex()[:16]})"
        )


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError(
            "swarmloco states are little-endian buffers; this machine is big-endian"
        )


@dataclasses.dataclass(frozen=True)
class StateSchema:
    """The tensors a peer expects in a state it downloads: names, dtypes and lengths.

    A state matches when it holds every tensor of the schema that is not ``optional``, and
    nothing else, each with the schema's dtype and length.
    """

    tensors: tuple[TensorSpec, ...]
    optional: frozenset[str] = frozenset()
    sized: frozenset[str] = frozenset()
    """Tensors of any length up to their spec's (the others have exactly theirs)."""

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"a schema names each tensor once, got {names}")
        for spec in self.tensors:
            problem = check_name(spec.name)
            if problem:
                raise ValueError(problem)
            if spec.dtype not in DTYPES:
                raise ValueError(f"unknown dtype {spec.dtype!r}; known: {', '.join(DTYPES)}")
        unknown = (self.optional | self.sized) - set(names)
        if unknown:
            raise ValueError(f"tensors {sorted(unknown)} are not in the schema")

    @classmethod
    def diloco(cls, numel: int) -> StateSchema:
        """``theta_g`` (fp32, ``numel``) and, except in a fresh swarm, the outer momentum
        and the swarm's token count; on a pinned dataset, the sequences that landed."""
        return cls(
            (
                TensorSpec(THETA_G, "float32", numel),
                TensorSpec(MOMENTUM, "float32", numel),
                TensorSpec(TOKENS, "int64", 1),
                TensorSpec(LANDED, "int64", MAX_LANDED_VALUES),
            ),
            optional=frozenset({MOMENTUM, TOKENS, LANDED}),
            sized=frozenset({LANDED}),
        )

    def mismatch(self, specs: Iterable[TensorSpec]) -> str | None:
        """Why a state of ``specs`` does not match this schema, or None when it does."""
        expected = {spec.name: spec for spec in self.tensors}
        seen = set()
        for spec in specs:
            want = expected.get(spec.name)
            if want is None:
                return f"it holds a tensor {spec.name!r} that this swarm's state has not"
            if spec.name in self.sized and spec.dtype == want.dtype:
                if 0 < spec.numel <= want.numel:
                    seen.add(spec.name)
                    continue
                return f"its {spec.name} holds {spec.numel} values, at most {want.numel} fit"
            if spec != want:
                return (
                    f"its {spec.name} is {spec.dtype}[{spec.numel}], this swarm's is "
                    f"{want.dtype}[{want.numel}]"
                )
            seen.add(spec.name)
        missing = sorted(set(expected) - seen - self.optional)
        if missing:
            return f"it lacks {', '.join(missing)}"
        return None
