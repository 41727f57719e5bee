"""Training data: token stores, random batch streams with exact save/restore, eval windows.

The default data is the Python standard library's own ``.py`` files as bytes (vocabulary
256): real text that every Python install ships, so the default task needs no download.
Every worker draws random windows from its own generator stream (seeded by the run seed and
the worker's index); the stream's state is a small dict that a checkpoint saves and restores
exactly. The evaluation set is a fixed list of windows spread evenly over the held-out data,
the same on every worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmloco.errors import DataError
from swarmloco.train.spec import DataSpec

log = logging.getLogger(__name__)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class TokenStore:
    """One or more 1-D token arrays (in memory or memory-mapped) sampled as one."""

    def __init__(self, segments: list[np.ndarray], name: str) -> None:
        self.segments = [s for s in segments if len(s) > 0]
        self.name = name
        self.sizes = np.array([len(s) for s in self.segments], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum())

    def _starts_table(self, window: int) -> np.ndarray:
        usable = np.maximum(self.sizes - window + 1, 0)
        if usable.sum() == 0:
            raise DataError(
                f"the {self.name} data ({self.num_tokens} tokens in {len(self.sizes)} pieces) "
                f"has no piece of {window} tokens: use more data or a shorter seq_len"
            )
        return np.concatenate([[0], np.cumsum(usable)])

    def windows(self, starts: np.ndarray, window: int) -> np.ndarray:
        """Windows of ``window`` tokens at positions in the concatenation of usable starts."""
        table = self._starts_table(window)
        seg = np.searchsorted(table, starts, side="right") - 1
        out = np.empty((len(starts), window), dtype=np.int64)
        for row, (s, pos) in enumerate(zip(seg, starts - table[seg], strict=True)):
            out[row] = self.segments[s][pos : pos + window]
        return out

    def usable_starts(self, window: int) -> int:
        return int(self._starts_table(window)[-1])


@dataclasses.dataclass
class TokenData:
    train: TokenStore
    val: TokenStore
    vocab_size: int
    description: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _in_val(key: str, val_fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def _text_files(root: Path, suffixes: tuple[str, ...]) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise DataError(f"data path {root} does not exist")
    found: list[tuple[tuple[str, ...], Path]] = []
    for top, dirs, names in os.walk(root):  # symlinked directories are not entered
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # never walked: site-packages is big
        rel_top = Path(top).relative_to(root).parts
        for name in names:
            path = Path(top, name)
            if name in _SKIP_DIRS or not path.is_file():
                continue
            if suffixes and path.suffix not in suffixes:
                continue
            found.append(((*rel_top, name), path))
    found.sort(key=lambda item: item[0])  # the order of the paths' parts, as sorted Paths
    return [("/".join(parts), path) for parts, path in found]


def _load_text(
    roots: list[Path], suffixes: tuple[str, ...], val_fraction: float
) -> tuple[TokenStore, TokenStore, str]:
    """Every text file under ``roots``, read straight into one array per split (no copy of
    a file's bytes is kept besides the array: the standard library's 31 MB take 31 MB)."""
    files = [
        (path, _in_val(key, val_fraction))
        for root in roots
        for key, path in _text_files(root, suffixes)
    ]
    sizes = []
    for path, _ in files:
        try:
            sizes.append(path.stat().st_size)
        except OSError:
            sizes.append(0)
    buffers = {
        split: np.empty(
            sum(n for n, (_, v) in zip(sizes, files, strict=True) if v == split), dtype=np.uint8
        )
        for split in (False, True)
    }
    filled = dict.fromkeys(buffers, 0)
    skipped = 0
    count = 0
    for (path, in_val), size in zip(files, sizes, strict=True):
        buf, at = buffers[in_val], filled[in_val]
        try:
            with path.open("rb") as fh:
                got = fh.readinto(buf[at : at + size].data)
        except OSError as exc:
            log.warning("skipping unreadable file %s: %s", path, exc)
            skipped += 1
            continue
        if 0 in buf[at : at + min(got, 8192)]:
            skipped += 1  # binary, not text
            continue
        count += 1
        filled[in_val] = at + got  # a file that shrank since its stat leaves no gap
    train, val = buffers[False][: filled[False]], buffers[True][: filled[True]]
    if not count:
        raise DataError(f"no readable text files under {', '.join(map(str, roots))}")
    if len(val) == 0 or len(train) == 0:
        # Too few files to split by file: hold out the tail instead.
        both = np.concatenate([train, val])
        cut = int(len(both) * (1 - val_fraction))
        train, val = both[:cut], both[cut:]
    note = f", {skipped} binary/unreadable skipped" if skipped else ""
    desc = f"{count} text files, {len(train):,} train / {len(val):,} val bytes{note}"
    return TokenStore([train], "train"), TokenStore([val], "validation"), desc


def load_token_file(path: Path, token_dtype: str) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"token file {path} does not exist")
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            arr = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
    except (ValueError, OSError) as exc:
        raise DataError(f"cannot read token file {path}: {exc}") from exc
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(
            f"token file {path} must hold a 1-D integer array, got {arr.dtype} {arr.shape}"
        )
    return arr


def load_tokens(spec: DataSpec, vocab_size: int) -> TokenData:
    """Load (or memory-map) the tokens a :class:`DataSpec` names and split off validation."""
    if spec.source == "dataset":
        raise DataError(
            f"dataset {spec.dataset} is pinned, not local: a peer fetches its shards first "
            "(swarmloco.dataset.fetch.local_tokens) and reads those"
        )
    if spec.source == "stdlib":
        root = stdlib_root()
        train, val, desc = _load_text([root], (".py",), spec.val_fraction)
        desc = f"Python {sysconfig.get_python_version()} standard library: {desc}"
    elif spec.source == "text":
        train, val, desc = _load_text(
            [Path(p) for p in spec.paths], spec.suffixes, spec.val_fraction
        )
    else:
        trains, vals = [], []
        for p in spec.paths:
            arr = load_token_file(Path(p), spec.token_dtype)
            cut = int(len(arr) * (1 - spec.val_fraction))
            trains.append(arr[:cut])
            vals.append(arr[cut:])
        train, val = TokenStore(trains, "train"), TokenStore(vals, "validation")
        desc = f"{len(spec.paths)} token files, {train.num_tokens:,} train / {val.num_tokens:,} val"
    if spec.source != "tokens" and vocab_size < 256:
        raise ValueError(f"byte-level data needs vocab_size >= 256, got {vocab_size}")
    return TokenData(train=train, val=val, vocab_size=vocab_size, description=desc)


class BatchStream:
    """Random training windows for one worker, with exactly restorable state.

    Worker ``w`` of a run seeded ``s`` draws from the PCG64 stream ``SeedSequence([s, w])``:
    independent of every other worker, and the same after a save and restore.
    """

    def __init__(
        self,
        store: TokenStore,
        *,
        seq_len: int,
        batch_size: int,
        vocab_size: int,
        seed: int,
        worker: int,
    ) -> None:
        self.store = store
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, worker])))
        self._usable = store.usable_starts(seq_len + 1)
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both ``(batch_size, seq_len)`` int64."""
        starts = self._rng.integers(0, self._usable, size=self.batch_size)
        windows = torch.from_numpy(self.store.windows(starts, self.seq_len + 1))
        self.batches_drawn += 1
        top = int(windows.max())
        if top >= self.vocab_size or int(windows.min()) < 0:
            raise DataError(
                f"token id {top} is outside the vocabulary of {self.vocab_size}: "
                "is token_dtype right, and vocab_size large enough?"
            )
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: the generator state and the number of batches drawn."""
        return {"rng": self._rng.bit_generator.state, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self._rng.bit_generator.state = state["rng"]
            self.batches_drawn = int(state["batches_drawn"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"data loader state is malformed: {exc}") from exc


def eval_windows(store: TokenStore, *, seq_len: int, count: int) -> torch.Tensor:
    """The fixed evaluation set: ``count`` windows of ``seq_len + 1`` spread evenly."""
    usable = store.usable_starts(seq_len + 1)
    starts = np.linspace(0, usable - 1, num=min(count, usable)).astype(np.int64)
    return torch.from_numpy(store.windows(starts, seq_len + 1))
