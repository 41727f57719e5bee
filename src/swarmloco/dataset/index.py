"""A prepared dataset's index: what its shards hold, and the id that pins it
(``docs/DESIGN.md`` section 11).

The index names the token dtype, the vocabulary size, the end-of-text id, the tokenizer's
SHA-256 and each shard's token count and SHA-256; the dataset id is the BLAKE2b-160 of its
canonical JSON, as a swarm id is of its manifest. :func:`read_index` refuses, naming the
field, an index that is not one of ours; :func:`verify` hashes the shards against it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from swarmloco.core.manifest import canonical_json
from swarmloco.errors import DataError

FORMAT = "swarmloco-tokens/1"
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
PROVENANCE = "provenance.json"
DTYPES = {"uint16": 2, "uint32": 4}
MAX_INDEX_BYTES = 16 << 20  # a million shards' entries fit; a bigger file is not an index
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


@dataclasses.dataclass(frozen=True)
class Shard:
    tokens: int
    sha256: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetIndex:
    dtype: str
    """``uint16`` or ``uint32``: the shards' little-endian token type."""
    vocab_size: int
    eos: int
    """The end-of-text id put after each document."""
    tokenizer_sha256: str
    shards: tuple[Shard, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def token_bytes(self) -> int:
        return DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos": self.eos,
            "tokenizer_sha256": self.tokenizer_sha256,
            "shards": [{"tokens": s.tokens, "sha256": s.sha256} for s in self.shards],
        }

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def dataset_id(self) -> str:
        """BLAKE2b-160 of the canonical index, in lowercase hex (40 characters)."""
        return hashlib.blake2b(self.to_bytes(), digest_size=20).hexdigest()

    @classmethod
    def from_json(cls, value: Mapping[str, Any], where: str = INDEX) -> DatasetIndex:
        def field(name: str, kind: type, ok: Callable[[Any], bool] = lambda v: True) -> Any:
            v = value.get(name)
            if not isinstance(v, kind) or isinstance(v, bool) != (kind is bool) or not ok(v):
                raise DataError(f"{where}: field {name!r} is missing or invalid ({v!r:.80})")
            return v

        if value.get("format") != FORMAT:
            raise DataError(
                f"{where}: format {value.get('format')!r:.80} is not {FORMAT!r} "
                "(not a dataset swarmloco data prepare wrote)"
            )
        shards = []
        for i, entry in enumerate(field("shards", list)):
            if not isinstance(entry, dict):
                raise DataError(f"{where}: shard {i} is not an object")
            tokens, digest = entry.get("tokens"), entry.get("sha256")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
                raise DataError(f"{where}: shard {i} has no positive token count")
            if not isinstance(digest, str) or not _SHA256.match(digest):
                raise DataError(f"{where}: shard {i} has no SHA-256")
            shards.append(Shard(tokens, digest))
        dtype = field("dtype", str, lambda v: v in DTYPES)
        vocab = field("vocab_size", int, lambda v: 0 < v <= 1 << (8 * DTYPES[dtype]))
        return cls(
            dtype=dtype,
            vocab_size=vocab,
            eos=field("eos", int, lambda v: 0 <= v < vocab),
            tokenizer_sha256=field("tokenizer_sha256", str, lambda v: bool(_SHA256.match(v))),
            shards=tuple(shards),
        )


def read_index(directory: Path) -> DatasetIndex:
    """The index of the dataset in ``directory`` (``DataError`` naming what is wrong)."""
    path = directory / INDEX
    try:
        size = path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise DataError(f"{path}: {size:,} bytes is too large for a dataset index")
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DataError(
            f"{directory} holds no dataset (no {INDEX}; `swarmloco data prepare` writes one, "
            "last, so an interrupted preparation leaves none)"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} cannot be read as an index: {exc}") from exc
    if not isinstance(value, dict):
        raise DataError(f"{path} is not a JSON object")
    return DatasetIndex.from_json(value, str(path))


def write_whole(path: Path, data: bytes) -> None:
    """``data`` as ``path``, written under a temporary name of this writer's own and renamed
    when whole: writers of the same file at once (the ranks of a box filling one cache) each
    rename a whole file of their own, and a reader never sees a part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with partial.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(
    directory: Path, index: DatasetIndex, on_shard: Callable[[int], None] | None = None
) -> list[str]:
    """What is wrong with the files of ``directory`` against ``index`` (empty: nothing):
    each shard's size and SHA-256, and the tokenizer's."""
    problems = []
    tokenizer = directory / TOKENIZER
    if not tokenizer.is_file():
        problems.append(f"{TOKENIZER} is missing")
    elif sha256_of(tokenizer) != index.tokenizer_sha256:
        problems.append(f"{TOKENIZER} does not match the index's hash")
    for i, shard in enumerate(index.shards):
        path = directory / shard_name(i)
        want = shard.tokens * index.token_bytes
        if not path.is_file():
            problems.append(f"{path.name} is missing")
        elif path.stat().st_size != want:
            problems.append(f"{path.name} holds {path.stat().st_size:,} bytes, not {want:,}")
        elif sha256_of(path) != shard.sha256:
            problems.append(f"{path.name} does not match the index's hash")
        if on_shard is not None:
            on_shard(i)
    return problems
