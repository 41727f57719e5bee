"""A pinned dataset on this peer: its index and shards fetched from whichever source has
them, each checked against the dataset id and the index's hashes, kept in a cache
(``docs/DESIGN.md`` section 11).

A source is a local directory (a copy of the prepared dataset: ``--dataset DIR``, read in
place when its files match) or an HTTP(S) mirror (the manifest's: ``URL/index.json``,
``URL/shard-00000.bin``, ...). The index is taken only if it hashes to the dataset id; a
shard only if its size and SHA-256 are the index's; a source that serves anything else, or
nothing, is named in the log and the next one is asked. The cache (``DATA_DIR/datasets/ID``)
holds what was fetched, each file written whole under a temporary name first; a cached
shard is hashed again when it is first opened in a process, and one that no longer matches
(a disk error, an edit) is fetched again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from swarmloco.dataset.index import (
    INDEX,
    MAX_INDEX_BYTES,
    TOKENIZER,
    DatasetIndex,
    sha256_of,
    shard_name,
    write_whole,
)
from swarmloco.errors import DataError
from swarmloco.progress import Progress
from swarmloco.train.spec import DataSpec

logger = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 30.0


class Source(Protocol):
    """Where a dataset's files may be read from."""

    def read(self, name: str, limit: int) -> bytes:
        """The file ``name`` (at most ``limit`` bytes: more is refused); OSError if the
        source does not have it or cannot be reached."""
        ...


@dataclasses.dataclass(frozen=True)
class LocalSource:
    directory: Path

    def read(self, name: str, limit: int) -> bytes:
        path = self.directory / name
        if path.stat().st_size > limit:
            raise OSError(f"{path} holds more than {limit:,} bytes")
        return path.read_bytes()

    def __str__(self) -> str:
        return str(self.directory)


@dataclasses.dataclass(frozen=True)
class HttpSource:
    url: str
    """The mirror's base URL: its files are ``url/index.json``, ``url/shard-00000.bin``..."""
    timeout_s: float = HTTP_TIMEOUT_S

    def read(self, name: str, limit: int) -> bytes:
        try:
            with urllib.request.urlopen(
                f"{self.url.rstrip('/')}/{name}", timeout=self.timeout_s
            ) as response:
                data = response.read(limit + 1)
        except urllib.error.URLError as exc:
            raise OSError(f"{self.url}: {exc.reason}") from None
        except (ValueError, TimeoutError) as exc:
            raise OSError(f"{self.url}: {exc}") from None
        if len(data) > limit:
            raise OSError(f"{self.url}/{name} holds more than {limit:,} bytes")
        return data

    def __str__(self) -> str:
        return self.url


def sources_for(mirrors: Sequence[str], local: Sequence[Path]) -> list[Source]:
    """Local copies first (no traffic), then the mirrors in the manifest's order."""
    return [*(LocalSource(Path(d)) for d in local), *(HttpSource(url) for url in mirrors)]


class DatasetCache:
    """The dataset ``dataset_id`` as this peer holds it, in ``root`` (made if missing)."""

    def __init__(self, root: Path, dataset_id: str, sources: Sequence[Source]) -> None:
        self.root = root
        self.dataset_id = dataset_id
        self.sources = list(sources)
        self._checked: set[Path] = set()  # files hashed in this process, and good

    def index(self) -> DatasetIndex:
        """The dataset's index: the cached one, or the first a source serves whose hash
        is the dataset id."""
        cached = self.root / INDEX
        if cached.is_file():
            try:
                index = self._parse_index(cached.read_bytes(), str(cached))
                if index.dataset_id == self.dataset_id:
                    return index
            except DataError:
                pass
            logger.warning("the cached index in %s is not dataset %s: fetching it", self.root,
                           self.dataset_id)  # fmt: skip
        problems = []
        for source in self.sources:
            try:
                index = self._parse_index(source.read(INDEX, MAX_INDEX_BYTES), str(source))
            except (OSError, DataError) as exc:
                problems.append(f"{source}: {exc}")
                continue
            if index.dataset_id != self.dataset_id:
                problems.append(f"{source} serves dataset {index.dataset_id}, not this one")
                logger.warning("refused the index of %s: %s", source, problems[-1])
                continue
            self._keep(cached, json.dumps(index.to_json(), indent=1).encode())
            return index
        raise DataError(self._none(INDEX, problems))

    def shard(self, index: DatasetIndex, i: int) -> Path:
        """The path of shard ``i``, whole and matching the index: the cached file, or the
        first a source serves that matches."""
        name = shard_name(i)
        want = index.shards[i]
        size = want.tokens * index.token_bytes
        for copy in [s.directory / name for s in self.sources if isinstance(s, LocalSource)]:
            if self._matches(copy, size, want.sha256):
                return copy  # read in place: a local copy is not copied again
        path = self.root / name
        if path.is_file():
            if self._matches(path, size, want.sha256):
                return path
            logger.warning("cached %s does not match the index (corrupted): fetching it again",
                           path)  # fmt: skip
            path.unlink()
        problems = []
        for source in self.sources:
            try:
                data = source.read(name, size)
            except OSError as exc:
                problems.append(f"{source}: {exc}")
                continue
            if len(data) != size or hashlib.sha256(data).hexdigest() != want.sha256:
                problems.append(f"{source}: its {name} does not match the index")
                logger.warning("refused %s from %s: it does not match the index", name, source)
                continue
            self._keep(path, data)
            self._checked.add(path)
            return path
        raise DataError(self._none(name, problems))

    def complete(self, copies: Sequence[Path]) -> bool:
        """Whether the index and every shard are on this machine already, in ``copies`` or
        the cache (by size: the hashes are checked when the shards are opened)."""
        places = [*copies, self.root]
        index = None
        for place in places:
            with contextlib.suppress(OSError, DataError):
                found = self._parse_index((place / INDEX).read_bytes(), str(place))
                if found.dataset_id == self.dataset_id:
                    index = found
                    break
        if index is None:
            return False
        for i, shard in enumerate(index.shards):
            size = shard.tokens * index.token_bytes
            paths = [place / shard_name(i) for place in places]
            if not any(p.is_file() and p.stat().st_size == size for p in paths):
                return False
        return True

    def _matches(self, path: Path, size: int, sha256: str) -> bool:
        """Whether ``path`` holds what the index says (hashed once a process)."""
        if path in self._checked:
            return True
        if path.is_file() and path.stat().st_size == size and sha256_of(path) == sha256:
            self._checked.add(path)
            return True
        return False

    def tokenizer(self, index: DatasetIndex) -> Path:
        """The dataset's tokenizer file, matching the index's hash."""
        path = self.root / TOKENIZER
        if path.is_file() and sha256_of(path) == index.tokenizer_sha256:
            return path
        problems = []
        for source in self.sources:
            try:
                data = source.read(TOKENIZER, 64 << 20)
            except OSError as exc:
                problems.append(f"{source}: {exc}")
                continue
            if hashlib.sha256(data).hexdigest() != index.tokenizer_sha256:
                problems.append(f"{source}: its {TOKENIZER} does not match the index")
                continue
            self._keep(path, data)
            return path
        raise DataError(self._none(TOKENIZER, problems))

    def all_shards(self, index: DatasetIndex, *, progress: bool = True) -> list[Path]:
        """Every shard, fetched where missing (with a progress bar over the bytes)."""
        total = index.tokens * index.token_bytes
        bar = Progress(total, "dataset", enabled=progress)
        paths = []
        for i, shard in enumerate(index.shards):
            paths.append(self.shard(index, i))
            bar.update(shard.tokens * index.token_bytes)
        bar.close()
        return paths

    def _keep(self, path: Path, data: bytes) -> None:
        """``data`` into the cache as ``path``, whole (a full disk: a ``DataError``)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_whole(path, data)
        except OSError as exc:
            raise DataError(
                f"cannot keep {path.name} of dataset {self.dataset_id} in {self.root}: "
                f"{exc.strerror or exc} (free some space there, or give a copy with --dataset)"
            ) from None

    def _parse_index(self, data: bytes, where: str) -> DatasetIndex:
        try:
            value = json.loads(data)
        except ValueError as exc:
            raise DataError(f"{where}: the index is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise DataError(f"{where}: the index is not a JSON object")
        return DatasetIndex.from_json(value, where)

    def _none(self, name: str, problems: Sequence[str]) -> str:
        if not self.sources:
            return (
                f"dataset {self.dataset_id}: {name} is not cached in {self.root} and no source "
                "is known (give a local copy with --dataset DIR, or create the run with "
                "--dataset-mirror URL)"
            )
        return f"dataset {self.dataset_id}: no source served a good {name}: " + "; ".join(problems)


def local_tokens(
    spec: DataSpec,
    cache: Path,
    local: Sequence[Path],
    vocab_size: int,
    *,
    peers: Sequence[Source] = (),
    progress: bool = True,
) -> DataSpec:
    """The ``tokens`` spec of the pinned dataset ``spec`` names, its shards in this peer's
    ``cache`` (fetched where missing from the copies in ``local``, then ``peers``, then the
    mirrors): what the task reads. Refuses a dataset whose vocabulary the model cannot
    embed."""
    sources = sources_for(spec.mirrors, local)
    sources[len(local) : len(local)] = peers  # peers that hold it before the mirrors
    cache_of = DatasetCache(cache / spec.dataset, spec.dataset, sources)
    index = cache_of.index()
    if index.vocab_size > vocab_size:
        raise DataError(
            f"dataset {spec.dataset} has a vocabulary of {index.vocab_size:,} tokens, the "
            f"model {vocab_size:,}: create the run with --vocab-size {index.vocab_size}"
        )
    paths = cache_of.all_shards(index, progress=progress)
    try:  # not needed to train, but this peer serves the dataset whole to others
        cache_of.tokenizer(index)
    except DataError as exc:
        logger.warning("the dataset's tokenizer: %s", exc)
    logger.info(
        "dataset %s: %d shard(s), %s tokens, in %s",
        spec.dataset[:12],
        len(paths),
        f"{index.tokens:,}",
        cache_of.root,
    )
    return dataclasses.replace(
        spec,
        source="tokens",
        paths=tuple(str(p) for p in paths),
        token_dtype=index.dtype,
        dataset="",
        mirrors=(),
    )


EVAL_SHARDS = 4
"""A peer that fetches shards as it leases them fetches the first few at once: the run's
evaluation set is drawn from their held-out tails (the same on every peer)."""


class LazyDataset:
    """A pinned dataset on a peer that fetches each shard when it first leases it: the
    index, the tokenizer and the first :data:`EVAL_SHARDS` shards at once, the others from
    the sources of the moment (its copies, the swarm's serving peers, the mirrors) through
    :meth:`shard_tokens`. ``with`` keeps a client-only node to the swarm's peers open."""

    def __init__(
        self,
        spec: DataSpec,
        cache: Path,
        local: Sequence[Path],
        *,
        peers: Sequence[str],
        swarm_id: str,
        vocab_size: int,
    ) -> None:
        self.spec = spec
        self.local = list(local)
        self.swarm_id = swarm_id
        self.peers = tuple(peers)
        self.vocab_size = vocab_size
        self.cache = DatasetCache(cache / spec.dataset, spec.dataset, [])
        self._reader: object | None = None
        self._stack = contextlib.ExitStack()
        self._index: DatasetIndex | None = None

    def __enter__(self) -> LazyDataset:
        from swarmloco.dataset.peers import PeerReader

        if self.peers and not self.cache.complete(self.local):
            self._reader = self._stack.enter_context(PeerReader(self.peers))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _sources(self) -> list[Source]:
        sources = sources_for(self.spec.mirrors, self.local)
        if self._reader is not None:
            from swarmloco.dataset.peers import PeerReader

            assert isinstance(self._reader, PeerReader)
            try:
                peers = self._reader.sources(self.swarm_id, self.spec.dataset)
            except Exception as exc:  # the mirrors may still serve it
                logger.warning("could not list the swarm's peers for dataset files: %s", exc)
                peers = []
            sources[len(self.local) : len(self.local)] = peers
        return sources

    def start(self) -> tuple[DataSpec, DatasetIndex]:
        """The index (checked against the id), the tokenizer, and the evaluation shards:
        the ``tokens`` spec of those shards (the task reads its evaluation set from them),
        and the index."""
        self.cache.sources = self._sources()
        index = self.cache.index()
        if index.vocab_size > self.vocab_size:
            raise DataError(
                f"dataset {self.spec.dataset} has a vocabulary of {index.vocab_size:,} tokens, "
                f"the model {self.vocab_size:,}: create the run with --vocab-size "
                f"{index.vocab_size}"
            )
        try:  # not needed to train, but this peer serves it to others
            self.cache.tokenizer(index)
        except DataError as exc:
            logger.warning("the dataset's tokenizer: %s", exc)
        first = index.shards[: min(EVAL_SHARDS, len(index.shards))]
        bar = Progress(sum(s.tokens for s in first) * index.token_bytes, "dataset")
        paths = []
        for i, shard in enumerate(first):
            paths.append(self.cache.shard(index, i))
            bar.update(shard.tokens * index.token_bytes)
        bar.close()
        logger.info(
            "dataset %s: %d shard(s), %s tokens; %d at hand, the others fetched as leased",
            self.spec.dataset[:12],
            len(index.shards),
            f"{index.tokens:,}",
            len(paths),
        )
        self._index = index
        spec = dataclasses.replace(
            self.spec,
            source="tokens",
            paths=tuple(str(p) for p in paths),
            token_dtype=index.dtype,
            dataset="",
            mirrors=(),
        )
        return spec, index

    def shard_tokens(self, i: int) -> Any:
        """Shard ``i``'s tokens (memory-mapped), fetched and checked first if need be."""
        from swarmloco.train.data import load_token_file

        path = self.cache.root / shard_name(i)
        if not any((d / shard_name(i)).is_file() for d in self.local) and not path.is_file():
            self.cache.sources = self._sources()
            logger.info("fetching shard %d of dataset %s", i, self.spec.dataset[:12])
        assert self._index is not None, "start() first"
        return load_token_file(self.cache.shard(self._index, i), self._index.dtype)
