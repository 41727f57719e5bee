"""Crash-safe checkpoints of a peer's whole training state.

A checkpoint is a directory under the store's root::

    ckpt-<round>-<step>/
        tensors.safetensors   every tensor (global params, outer momentum, local params,
                              optimizer moments, RNG states), raw buffers, never pickle
        state.msgpack         everything else, with tensors replaced by references
        MANIFEST.json         written last: format, swarm id, round, step, size and
                              SHA-256 of each file

It is written into a hidden temporary directory, every file is fsynced, the manifest goes
last, and only then is the directory renamed into place (and the root fsynced). A kill -9 at
any moment therefore leaves either the complete new checkpoint or none of it; a directory
whose manifest is missing or whose files do not match it does not count as a checkpoint.
The newest ``keep`` checkpoints are kept. A full disk fails the save with a clear error and
leaves the earlier checkpoints as they were.

A :class:`BackgroundWriter` writes on a thread of its own: the caller waits only for a copy
of the state in memory, not for the seconds that writing, hashing and fsyncing a large
model's state take.

Nested state (an optimizer's ``state_dict``, a data loader's state, RNG states) goes through
:func:`flatten` / :func:`unflatten`: tensors go to the safetensors file, the rest to msgpack.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import msgpack
import torch
from safetensors.torch import load_file

from swarmloco.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "swarmloco-checkpoint/1"
TENSORS = "tensors.safetensors"
STATE = "state.msgpack"
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^ckpt-(\d{10})-(\d{12})$")
_TMP_PREFIX = ".tmp-"
_HASH_BLOCK = 1 << 20


# --- nested state <-> (msgpack skeleton, flat tensors) ------------------------------------


def flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "t") -> Any:
    """A msgpack-able copy of ``obj`` with every tensor moved into ``tensors``.

    Tensors become ``{"__tensor__": name}``, tuples ``{"__tuple__": [...]}``, dicts with
    non-string keys ``{"__items__": [[k, v], ...]}`` and integers beyond 64 bits
    ``{"__bigint__": "digits"}`` so that :func:`unflatten` gives back the same structure
    (an optimizer state dict keys its parameters by int; an RNG state holds 128-bit ints).
    """
    if isinstance(obj, torch.Tensor):
        name = f"{prefix}.{len(tensors)}"
        tensors[name] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": name}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: flatten(v, tensors, prefix) for k, v in obj.items()}
        return {"__items__": [[k, flatten(v, tensors, prefix)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors, prefix) for v in obj]}
    if isinstance(obj, list):
        return [flatten(v, tensors, prefix) for v in obj]
    if isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
        return {"__bigint__": str(obj)}  # msgpack carries 64 bits (RNG states hold 128)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__}")


def unflatten(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            name = obj["__tensor__"]
            if name not in tensors:
                raise CheckpointError(f"checkpoint state refers to a missing tensor {name!r}")
            return tensors[name]
        if set(obj) == {"__tuple__"}:
            return tuple(unflatten(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: unflatten(v, tensors) for k, v in obj["__items__"]}
        if set(obj) == {"__bigint__"}:
            return int(obj["__bigint__"])
        return {k: unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    return obj


@dataclasses.dataclass(frozen=True)
class StateCopy:
    """A nested state flattened into private CPU tensors and a msgpack-able skeleton."""

    skeleton: Any
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def copy_state(state: Mapping[str, Any]) -> StateCopy:
    """A copy of ``state`` that training may no longer change (every tensor copied to the
    CPU): what a checkpoint writes, taken at one instant."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(dict(state), tensors)
    return StateCopy(skeleton, tensors)


# --- the store ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: ``state`` is the nested state given to :meth:`save`."""

    path: Path
    swarm_id: str
    round: int
    step: int
    created_at: float
    state: dict[str, Any]


def checkpoint_name(round_: int, step: int) -> str:
    return f"ckpt-{round_:010d}-{step:012d}"


_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class _HashingWriter:
    """A file written once, hashed as it is written, fsynced on close."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return {"bytes": self.size, "sha256": self._hash.hexdigest()}


def _write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` in the safetensors format straight from their buffers (no
    serialized copy in memory); returns the file's size and hash."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot checkpoint tensor {name!r} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    out = _HashingWriter(path)
    try:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for t in tensors.values():
            if t.numel():
                out.write(t.reshape(-1).view(torch.uint8).numpy().data)
    except BaseException:
        out.close()
        raise
    return out.close()


def _write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    out = _HashingWriter(path)
    try:
        out.write(data)
    except BaseException:
        out.close()
        raise
    return out.close()


class CheckpointStore:
    """The checkpoints of one peer of one swarm, under ``root`` (one writer at a time).

    Use it as a context manager (or call :meth:`open` and :meth:`close`). Opening takes an
    exclusive lock on ``root/.lock`` (a second daemon on the same data directory fails at
    once instead of interleaving saves) and removes temporary directories that a killed
    save left behind. The constructor does no I/O.
    """

    def __init__(
        self, root: Path | str, *, swarm_id: str, keep: int = 3, readonly: bool = False
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.swarm_id = swarm_id
        self.keep = keep
        self.readonly = readonly
        """Only read (no lock, nothing cleaned up): safe beside a running peer, since a
        checkpoint appears and disappears by renaming."""
        self._lock: IO[str] | None = None
        self._reading = False

    def open(self) -> CheckpointStore:
        if self._lock is not None or self._reading:
            return self
        if self.readonly:
            if not self.root.is_dir():
                raise CheckpointError(f"no checkpoints in {self.root}")
            self._reading = True
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / ".lock", "a+")  # noqa: SIM115 (held until close())
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise CheckpointError(
                f"checkpoint directory {self.root} is in use by another process; "
                "give each peer its own --data-dir"
            ) from None
        self._lock = lock
        for leftover in self.root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return self

    def close(self) -> None:
        self._reading = False
        if self._lock is not None:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CheckpointStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self, *, writing: bool = False) -> None:
        if writing and self.readonly:
            raise CheckpointError("the checkpoint store was opened read-only")
        if self._lock is None and not self._reading:
            raise CheckpointError("the checkpoint store is not open (use it in a with block)")

    # -- saving --

    def save(self, *, round: int, step: int, state: Mapping[str, Any]) -> Path:
        """Write ``state`` (nested dicts/lists of tensors and plain values) as the checkpoint
        of (``round``, ``step``) and return its directory; then drop all but the newest
        ``keep`` checkpoints. Raises :class:`CheckpointError` when the disk is full or not
        writable; earlier checkpoints are left as they were."""
        return self.write(round=round, step=step, copy=copy_state(state))

    def write(self, *, round: int, step: int, copy: StateCopy) -> Path:
        """:meth:`save` of a state copied before (by :func:`copy_state`): the part that
        may run on another thread while training changes the original state."""
        self._require_open(writing=True)
        final = self.root / checkpoint_name(round, step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        started = time.monotonic()
        try:
            tmp.mkdir()
            files = {
                TENSORS: _write_safetensors(tmp / TENSORS, copy.tensors),
                STATE: _write_bytes(tmp / STATE, msgpack.packb(copy.skeleton, use_bin_type=True)),
            }
            manifest = {
                "format": FORMAT,
                "swarm_id": self.swarm_id,
                "round": round,
                "step": step,
                "created_at": time.time(),
                "files": files,
            }
            _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            replaced = None
            if final.exists():  # the same (round, step) saved again: replace it
                replaced = self._discard(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CheckpointError(
                    f"no space to write checkpoint {final.name} in {self.root} "
                    f"({os.strerror(e.errno or 0)}); free some space. "
                    f"Earlier checkpoints are intact: {self._names() or 'none'}"
                ) from e
            raise CheckpointError(
                f"cannot write checkpoint {final.name} in {self.root}: {e}"
            ) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        total = sum(int(f["bytes"]) for f in files.values())
        logger.info(
            "checkpoint %s saved: %.1f MB in %.2f s",
            final.name,
            total / 1e6,
            time.monotonic() - started,
        )
        self._prune()
        return final

    def _names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if _NAME.match(p.name))

    def _prune(self) -> None:
        valid = [p for p in self._candidates() if self._read_manifest(p) is not None]
        for stale in valid[self.keep :]:
            shutil.rmtree(self._discard(stale), ignore_errors=True)

    def _discard(self, path: Path) -> Path:
        """Rename a checkpoint out of the way before deleting it: a kill in the middle of a
        deletion must not leave a half-deleted directory under a checkpoint's name (the
        temporary name is cleaned up on the next open)."""
        doomed = self.root / f"{_TMP_PREFIX}old-{path.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(path, doomed)
        return doomed

    # -- loading --

    def _candidates(self) -> list[Path]:
        """Checkpoint directories, newest first."""
        return [self.root / n for n in reversed(self._names())]

    def _read_manifest(self, path: Path) -> dict[str, Any] | None:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return None
        return manifest

    def _verify(self, path: Path) -> tuple[dict[str, Any] | None, str]:
        manifest = self._read_manifest(path)
        if manifest is None:
            return None, "no valid manifest (an interrupted save)"
        if manifest.get("swarm_id") != self.swarm_id:
            return None, f"belongs to swarm {manifest.get('swarm_id')!r}"
        files = manifest.get("files")
        if not isinstance(files, dict) or set(files) != {TENSORS, STATE}:
            return None, "manifest lists the wrong files"
        for name, expected in files.items():
            file = path / name
            try:
                size = file.stat().st_size
            except OSError:
                return None, f"{name} is missing"
            if size != expected.get("bytes") or _sha256(file) != expected.get("sha256"):
                return None, f"{name} does not match its hash in the manifest"
        return manifest, ""

    def inventory(self) -> list[tuple[Path, str]]:
        """Every checkpoint directory, newest first, with '' if valid or why it is not."""
        return [(p, self._verify(p)[1]) for p in self._candidates()]

    def latest(self) -> Checkpoint | None:
        """The newest valid checkpoint of this swarm, or None. Invalid ones are skipped with
        a warning (never deleted: a person may want to look at them)."""
        self._require_open()
        for path in self._candidates():
            manifest, why = self._verify(path)
            if manifest is None:
                logger.warning("skipping checkpoint %s: %s", path, why)
                continue
            try:
                return self._load(path, manifest)
            except (CheckpointError, OSError, ValueError) as e:
                logger.warning("skipping checkpoint %s: %s", path, e)
        return None

    def _load(self, path: Path, manifest: Mapping[str, Any]) -> Checkpoint:
        tensors = load_file(str(path / TENSORS))
        skeleton = msgpack.unpackb((path / STATE).read_bytes(), raw=False, strict_map_key=False)
        state = unflatten(skeleton, tensors)
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path} holds no state mapping")
        return Checkpoint(
            path=path,
            swarm_id=str(manifest["swarm_id"]),
            round=int(manifest["round"]),
            step=int(manifest["step"]),
            created_at=float(manifest["created_at"]),
            state=state,
        )


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint the :class:`BackgroundWriter` finished writing."""

    path: Path
    round: int
    step: int
    nbytes: int
    copy_seconds: float
    """What the caller's thread spent copying the state (all that training waited for)."""
    write_seconds: float


class BackgroundWriter:
    """Writes a store's checkpoints on a thread of its own while training goes on.

    :meth:`submit` copies the state on the caller's thread (the copy is all training waits
    for: a memory copy, where writing, hashing and fsyncing take seconds for a large model)
    and hands the write to the writer thread. At most one write is in flight. :meth:`poll`
    reports a finished write, or raises its :class:`CheckpointError`; :meth:`wait` blocks
    for it. :meth:`close` waits for the write in flight, so that none is cut short by the
    process leaving (a kill -9 still leaves the earlier checkpoints intact).
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: concurrent.futures.Future[Saved] | None = None

    @property
    def busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def submit(self, *, round: int, step: int, state: Mapping[str, Any]) -> None:
        """Copy ``state`` (the caller may change it as soon as this returns) and start
        writing the copy. Raises if a write is still in flight (check :attr:`busy`) or the
        last one was not collected (:meth:`poll` or :meth:`wait` first)."""
        if self._inflight is not None:
            if not self._inflight.done():
                raise RuntimeError("a checkpoint is still being written")
            raise RuntimeError("the previous checkpoint was not collected (call poll or wait)")
        started = time.monotonic()
        copy = copy_state(state)
        copied = time.monotonic() - started
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="swarmloco-checkpoint"
            )
        self._inflight = self._pool.submit(self._write, round, step, copy, copied)

    def _write(self, round: int, step: int, copy: StateCopy, copied: float) -> Saved:
        started = time.monotonic()
        path = self.store.write(round=round, step=step, copy=copy)
        return Saved(path, round, step, copy.nbytes, copied, time.monotonic() - started)

    def poll(self) -> Saved | None:
        """The write in flight if it has finished (its error raised if it failed), else
        None."""
        if self._inflight is None or not self._inflight.done():
            return None
        return self.wait()

    def wait(self) -> Saved | None:
        """Block until the write in flight (if any) is done; return it or raise its error."""
        future, self._inflight = self._inflight, None
        return None if future is None else future.result()

    def close(self) -> None:
        """Wait for the write in flight (its error is logged, not raised) and stop the
        thread."""
        if self._inflight is not None:
            try:
                self.wait()
            except Exception as e:
                logger.error("the last checkpoint could not be written: %s", e)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
