"""States in files: what a peer serves, keeps as its fallback and downloads, out of its memory.

A state of a large model is 8 bytes a parameter (``theta_g`` and the outer momentum, fp32).
A peer holds its own state in memory once; the copies it needs besides (the state it
serves while the next round changes its own, the state it falls back to while an adopted
one is on probation, a state being downloaded) go to files instead (DESIGN section 6,
"Host memory").

Each file is an unnamed temporary file (``O_TMPFILE`` where the file system has it,
otherwise created and unlinked at once): nothing is left on disk once its last descriptor
closes, and a crash leaves nothing behind. A :class:`FileSource` owns the descriptor and
reads with ``pread`` (any thread, no shared position), so the bytes come from the page
cache and never count as the peer's memory; the file goes when the last snapshot that
reads it does. A full disk raises ``OSError`` where the file is written; the caller
decides what that costs.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import torch

from swarmloco.core.state import (
    StateHasher,
    StateSnapshot,
    TensorSpec,
    raw_bytes,
    spec_of,
)

WRITE_BYTES = 16 * 1024 * 1024
"""Bytes written (and hashed) at once: the GIL is released for each, and a slab stays in
the CPU's caches between the hash and the write."""


def _unnamed(directory: Path) -> IO[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryFile(dir=directory, prefix=".state-", buffering=0)


class FileSource:
    """The bytes of a state in an unnamed file, read with ``pread``; the file is gone once
    this object is (its descriptor closes with it)."""

    def __init__(self, file: IO[bytes], size: int) -> None:
        self._file = file
        self._fd = file.fileno()
        self.size = size

    def read(self, offset: int, size: int) -> bytes:
        self._check(offset, size)
        data = os.pread(self._fd, size, offset)
        while len(data) < size:  # a short read (signals, some file systems)
            more = os.pread(self._fd, size - len(data), offset + len(data))
            if not more:
                raise OSError(f"the state file ended at {offset + len(data)} of {self.size} bytes")
            data += more
        return data

    def read_into(self, offset: int, out: memoryview) -> None:
        self._check(offset, len(out))
        pos = 0
        while pos < len(out):
            got = os.preadv(self._fd, [out[pos:]], offset + pos)
            if got <= 0:
                raise OSError(f"the state file ended at {offset + pos} of {self.size} bytes")
            pos += got

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"bytes {offset}..{offset + size} of a {self.size}-byte state")

    def close(self) -> None:
        self._file.close()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(data):
        pos += os.pwrite(fd, data[pos:], offset + pos)


def write_state(
    directory: Path,
    *,
    swarm_id: str,
    round: int,
    tensors: Mapping[str, torch.Tensor],
    digest: bytes | None = None,
) -> StateSnapshot:
    """A snapshot of ``tensors`` in a new unnamed file under ``directory``, hashed as it is
    written (``digest``, when given, is trusted instead). The tensors are read, never
    copied whole: they must not change until this returns. OSError (a full disk) leaves
    nothing behind."""
    ordered = [(name, tensors[name]) for name in sorted(tensors)]
    specs = tuple(spec_of(name, tensor) for name, tensor in ordered)
    hasher = StateHasher(specs) if digest is None else None
    file = _unnamed(directory)
    try:
        offset = 0
        for _, tensor in ordered:
            raw = raw_bytes(tensor)
            for start in range(0, len(raw), WRITE_BYTES):
                piece = raw[start : start + WRITE_BYTES]
                if hasher is not None:
                    hasher.update(piece)
                _write_all(file.fileno(), piece, offset)
                offset += len(piece)
    except BaseException:
        file.close()
        raise
    if hasher is not None:
        digest = hasher.digest()
    assert digest is not None
    return StateSnapshot.from_source(
        swarm_id=swarm_id, round=round, specs=specs, digest=digest, source=FileSource(file, offset)
    )


class FileSink:
    """Where a download writes the state's bytes as they arrive: an unnamed file."""

    def __init__(self, directory: Path, specs: tuple[TensorSpec, ...]) -> None:
        self.size = sum(spec.nbytes for spec in specs)
        self._file = _unnamed(directory)
        self._fd = self._file.fileno()
        try:  # the room for all of it now: a disk that cannot hold it fails at once
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._file.close()
                raise
            # the file system cannot reserve: a full disk shows when a chunk is written

    def write(self, offset: int, data: bytes | memoryview) -> None:
        _write_all(self._fd, memoryview(data).cast("B"), offset)

    def source(self) -> FileSource:
        return FileSource(self._file, self.size)

    def discard(self) -> None:
        self._file.close()
