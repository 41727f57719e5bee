"""Crash-safe checkpoints of a peer's whole training state.

A checkpoint is a directory under the store's root::

    ckpt-<sequence>-r<round>-s<step>/
        tensors.safetensors   every tensor (global params, outer momentum, local params,
                              optimizer moments, RNG states), raw buffers, never pickle
        state.msgpack         everything else, with tensors replaced by references
        MANIFEST.json         written last: format, swarm id, sequence, round, step,
                              verified, size and SHA-256 of each file

It is written into a hidden temporary directory, every file is fsynced, the manifest goes
last, and only then is the directory renamed into place (and the root fsynced). A kill -9 at
any moment therefore leaves either the complete new checkpoint or none of it; a directory
whose manifest is missing or whose files do not match it does not count as a checkpoint.
A full disk fails the save with a clear error and leaves the earlier checkpoints as they
were.

**Order.** A checkpoint's place is the order it was written in, not its round: its
sequence number is one more than the highest of any checkpoint directory on disk, valid or
not. A peer that rolled back from a poisoned round 85 to its own round 80, or that started
afresh (steps back at 0) beside corrupt checkpoints, writes checkpoints that are newer than
those, and stay so across restarts. Directories of the earlier format
(``ckpt-<round>-<step>``) are still read, older than every numbered one.

**Verified.** A checkpoint whose global state was adopted from other peers and is still on
probation is saved with ``verified=False``; :meth:`CheckpointStore.latest` with
``verified=True`` finds the newest one this peer trained and checked itself, to roll back
to.

**What is kept.** The newest ``keep`` valid checkpoints, and the newest valid verified one
however many unverified ones came after it. Validity is the hash check: a checkpoint whose
manifest reads well but whose files do not match it is not one of the ``keep``. Invalid
directories are never deleted (a person may want to look at them); so the newest valid
checkpoint never is. The verdict on each directory is cached for the store's life, keyed by
its files' inode, size and modification time: a checkpoint this process wrote was hashed as
it was written, one already on disk is hashed once, and saving does not read every kept
checkpoint back. Loading always hashes what it loads.

A :class:`BackgroundWriter` splits a save: the caller's thread writes the files straight
from the state's tensors into the page cache (no copy of the state in memory), and a thread
of its own hashes them, fsyncs them, writes the manifest and renames the directory, the
seconds that a large model's state takes. A GPU's tensors are cloned on their card where it
has the room (:func:`clone_on_device`): the caller's thread leaves their places in the file
as holes, and the writer's thread fills them from the clones before it hashes.

Nested state (an optimizer's ``state_dict``, a data loader's state, RNG states) goes through
:func:`flatten` / :func:`unflatten`: tensors go to the safetensors file, the rest to msgpack.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import math
import mmap
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import msgpack
import torch

from swarmloco.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "swarmloco-checkpoint/1"
TENSORS = "tensors.safetensors"
STATE = "state.msgpack"
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^ckpt-(\d{10})-r(\d{10})-s(\d{12})$")
_OLD_NAME = re.compile(r"^ckpt-(\d{10})-(\d{12})$")  # before sequence numbers: older
_TMP_PREFIX = ".tmp-"
_HASH_BLOCK = 1 << 20


# --- nested state <-> (msgpack skeleton, flat tensors) ------------------------------------


def flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "t") -> Any:
    """A msgpack-able copy of ``obj`` with every tensor moved into ``tensors`` (the tensors
    themselves: a checkpoint writes them before training changes them).

    Tensors become ``{"__tensor__": name}``, tuples ``{"__tuple__": [...]}``, dicts with
    non-string keys ``{"__items__": [[k, v], ...]}`` and integers beyond 64 bits
    ``{"__bigint__": "digits"}`` so that :func:`unflatten` gives back the same structure
    (an optimizer state dict keys its parameters by int; an RNG state holds 128-bit ints).
    """
    if isinstance(obj, torch.Tensor):
        name = f"{prefix}.{len(tensors)}"
        tensors[name] = obj.detach()  # the tensor itself: written where it is, not copied
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


def _nothing() -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Staged:
    """A checkpoint whose files are written (not yet hashed, fsynced or in place): the first
    half of :meth:`CheckpointStore.save`, taken on the training thread."""

    tmp: Path
    final: Path
    sequence: int
    round: int
    step: int
    verified: bool
    nbytes: int
    seconds: float
    """What writing the files took the caller's thread (all that training waited for)."""
    holes: tuple[tuple[int, torch.Tensor], ...] = ()
    """Where in the tensors' file a clone's bytes go, and the clone: written by
    :meth:`CheckpointStore.commit` (the writer's thread) once ``ready`` returns."""
    ready: Callable[[], None] = _nothing
    """Waits until the clones are made (a GPU computes them after the call that asked)."""


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
    sequence: int = 0
    """Its place in the order of writing (0: a directory of the earlier format)."""
    verified: bool = True
    """False: its global state was adopted from other peers and was on probation."""


def checkpoint_name(sequence: int, round_: int, step: int) -> str:
    return f"ckpt-{sequence:010d}-r{round_:010d}-s{step:012d}"


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(sequence, round, step) of a checkpoint directory's name (sequence 0 for the
    earlier format), or None for anything else."""
    if m := _NAME.match(name):
        return int(m[1]), int(m[2]), int(m[3])
    if m := _OLD_NAME.match(name):
        return 0, int(m[1]), int(m[2])
    return None


def _age(name: str) -> tuple[int, int, int]:
    """Sort key, oldest first: every numbered checkpoint after every one of the earlier
    format, which follow each other by (round, step)."""
    parsed = parse_name(name)
    assert parsed is not None
    sequence, round_, step = parsed
    return (sequence, 0, 0) if sequence else (0, round_, step)


_Stamp = tuple[tuple[str, int, int, int] | tuple[str], ...]


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """What a directory's hash check found, and how its files looked then."""

    stamp: _Stamp
    manifest: dict[str, Any] | None
    why: str


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


def _settle(path: Path) -> dict[str, Any]:
    """A staged file's size and hash (read back, from the page cache), fsynced."""
    digest = _sha256(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": path.stat().st_size, "sha256": digest}


def _write_safetensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    later: Mapping[str, torch.Tensor] | None = None,
) -> tuple[int, list[tuple[int, torch.Tensor]]]:
    """Write ``tensors`` in the safetensors format straight from their buffers (no
    serialized copy in memory; a tensor off the CPU copied over alone); returns the bytes
    of tensor data, and the holes left for the tensors named in ``later``: the file
    offset of each and the tensor (``later``'s, of the same shape and dtype) to write there
    (:func:`_fill`)."""
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
    later = later or {}
    holes: list[tuple[int, torch.Tensor]] = []
    with open(path, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name, t in tensors.items():
            if not t.numel():
                continue
            if name in later:
                holes.append((out.tell(), later[name]))
                out.seek(t.numel() * t.element_size(), os.SEEK_CUR)
                continue
            flat = t.reshape(-1).to("cpu").contiguous()
            out.write(flat.view(torch.uint8).numpy().data)
        out.truncate(8 + len(encoded) + offset)  # a hole at the end is in the file too
    return offset, holes


def _fill(path: Path, holes: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Write each tensor of ``holes`` at its offset of ``path`` (a tensor on a GPU through
    one host copy of itself)."""
    with open(path, "r+b") as out:
        for position, t in holes:
            out.seek(position)
            out.write(t.reshape(-1).to("cpu").contiguous().view(torch.uint8).numpy().data)


DEVICE_SPARE = 0.1
"""The share of a card's free memory its checkpoint's clones leave free."""


def clone_on_device(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clones, on their card, of the tensors of ``tensors`` that live on a GPU, where every
    card's free memory (what no process holds: the next steps' activations find what the
    clones took) holds them with :data:`DEVICE_SPARE` of it to spare; none otherwise. A
    clone is a copy at the card's speed, and the card computes it after this returns
    (:func:`clones_ready`)."""
    on_gpu = {name: t for name, t in tensors.items() if t.is_cuda and t.numel()}
    need: dict[torch.device, int] = {}
    for t in on_gpu.values():
        need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    for device, nbytes in need.items():
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > free * (1 - DEVICE_SPARE):
            logger.info(
                "checkpoint: %.1f GB of %s's tensors written from the training thread (the "
                "card has %.1f GB free: too little to clone them)",
                nbytes / 1e9, device, free / 1e9,
            )  # fmt: skip
            return {}
    try:
        return {name: t.detach().clone() for name, t in on_gpu.items()}
    except torch.cuda.OutOfMemoryError:
        logger.info("checkpoint: the clones did not fit the card; written from the training thread")
        return {}


def clones_ready(clones: Mapping[str, torch.Tensor]) -> Callable[[], None]:
    """What waits, on another thread, until the card has made ``clones``."""
    events = []
    for device in {t.device for t in clones.values() if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def ready() -> None:
        for event in events:
            event.synchronize()

    return ready


def _write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class CheckpointStore:
    """The checkpoints of one peer of one swarm, under ``root`` (one writer at a time).

    Use it as a context manager (or call :meth:`open` and :meth:`close`). Opening takes an
    exclusive lock on ``root/.lock`` (a second daemon on the same data directory fails at
    once instead of interleaving saves) and removes temporary directories that a killed
    save left behind. The constructor does no I/O. One thread at a time: read with
    :meth:`valid` or :meth:`latest` once the :class:`BackgroundWriter`'s write in flight
    is collected, not while that write prunes.
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
        self._verdicts: dict[str, _Verdict] = {}
        self._rejected: dict[str, str] = {}
        self._sequence = 0  # the highest sequence number this store saw or wrote

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
        self._verdicts.clear()  # another process may write here before the next open
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

    def save(
        self, *, round: int, step: int, state: Mapping[str, Any], verified: bool = True
    ) -> Path:
        """Write ``state`` (nested dicts/lists of tensors and plain values) as the newest
        checkpoint, of (``round``, ``step``), and return its directory; then drop what is
        no longer kept (see the module docstring). ``verified``: False when the global
        state in it was adopted from other peers and is still on probation. Raises
        :class:`CheckpointError` when the disk is full or not writable; earlier checkpoints
        are left as they were."""
        return self.commit(self.stage(round=round, step=step, state=state, verified=verified))

    def stage(
        self,
        *,
        round: int,
        step: int,
        state: Mapping[str, Any],
        verified: bool = True,
        clone: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> Staged:
        """The first half of :meth:`save`, on the thread that owns ``state``: its files
        written into a hidden temporary directory straight from its tensors (no copy of the
        state in memory; a tensor on a GPU comes to the CPU alone, one at a time), into the
        page cache, but for the tensors ``clone`` (given the state's tensors by name)
        returns clones of: their places are left as holes, which :meth:`commit` fills from
        the clones. :meth:`commit` (any thread) does the rest: once this returns, the state
        may change."""
        self._require_open(writing=True)
        started = time.monotonic()
        try:
            sequence = self._next_sequence()
        except OSError as e:
            raise CheckpointError(f"cannot write a checkpoint in {self.root}: {e}") from e
        final = self.root / checkpoint_name(sequence, round, step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        tensors: dict[str, torch.Tensor] = {}
        with self._undone_on_failure(tmp, final):
            skeleton = flatten(dict(state), tensors)
            clones = clone(tensors) if clone is not None else {}
            tmp.mkdir()
            nbytes, holes = _write_safetensors(tmp / TENSORS, tensors, later=clones)
            (tmp / STATE).write_bytes(msgpack.packb(skeleton, use_bin_type=True))
        return Staged(
            tmp, final, sequence, round, step, verified, nbytes, time.monotonic() - started,
            tuple(holes), clones_ready(clones),
        )  # fmt: skip

    def commit(self, staged: Staged) -> Path:
        """The second half of :meth:`save`: hash and fsync the staged files, write the
        manifest last, rename the directory into place, drop what is no longer kept."""
        self._require_open(writing=True)
        tmp, final = staged.tmp, staged.final
        started = time.monotonic()
        with self._undone_on_failure(tmp, final):
            if staged.holes:
                staged.ready()
                _fill(tmp / TENSORS, staged.holes)
            files = {name: _settle(tmp / name) for name in (TENSORS, STATE)}
            manifest = {
                "format": FORMAT,
                "swarm_id": self.swarm_id,
                "sequence": staged.sequence,
                "round": staged.round,
                "step": staged.step,
                "verified": bool(staged.verified),
                "created_at": time.time(),
                "files": files,
            }
            _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        self._sequence = staged.sequence
        # Hashed as it was settled: no need to read it back to count it as valid.
        self._verdicts[final.name] = _Verdict(_stamp(final), manifest, "")
        total = sum(int(f["bytes"]) for f in files.values())
        logger.info(
            "checkpoint %s saved%s: %.1f MB in %.2f s",
            final.name,
            "" if staged.verified else " (adopted state, on probation)",
            total / 1e6,
            staged.seconds + time.monotonic() - started,
        )
        self._prune()
        return final

    @contextlib.contextmanager
    def _undone_on_failure(self, tmp: Path, final: Path) -> Iterator[None]:
        """Whatever fails inside removes the temporary directory; an OSError becomes the
        CheckpointError that says what to do."""
        try:
            yield
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(final, e) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _failed(self, final: Path, e: OSError) -> CheckpointError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return CheckpointError(
                f"no space to write checkpoint {final.name} in {self.root} "
                f"({os.strerror(e.errno or 0)}); free some space. "
                f"Earlier checkpoints are intact: {self._names() or 'none'}"
            )
        return CheckpointError(f"cannot write checkpoint {final.name} in {self.root}: {e}")

    def _next_sequence(self) -> int:
        """One more than the highest sequence number on disk (valid or not) or written by
        this store: a checkpoint written now is newer than every one before it, even
        after a restart or when corrupt ones carry higher rounds."""
        on_disk = (parse_name(name) for name in self._names())
        highest = max((parsed[0] for parsed in on_disk if parsed), default=0)
        return max(highest, self._sequence) + 1

    def _names(self) -> list[str]:
        """Checkpoint directory names, oldest first."""
        return sorted((p.name for p in self.root.iterdir() if parse_name(p.name)), key=_age)

    def _prune(self) -> None:
        """Delete the valid checkpoints that are no longer kept: beyond the newest
        ``keep`` valid ones, unless it is the newest verified one; and one that a save of
        the same (round, step, verified) just superseded. Invalid ones stay."""
        valid = []
        for path in self._candidates():
            manifest = self._judge(path).manifest
            if manifest is not None:
                valid.append((path, manifest))
        superseded = {
            older
            for (newer, m_new), (older, m_old) in itertools.pairwise(valid)
            if _point(m_new) == _point(m_old)
        }
        survivors = [(p, m) for p, m in valid if p not in superseded]
        kept = {p for p, _ in survivors[: self.keep]}
        verified = next((p for p, m in survivors if m.get("verified", True)), None)
        if verified is not None:
            kept.add(verified)  # the state to roll back to, whatever came after it
        for path, _ in valid:
            if path not in kept:
                self._verdicts.pop(path.name, None)
                shutil.rmtree(self._discard(path), ignore_errors=True)

    def _discard(self, path: Path) -> Path:
        """Rename a checkpoint out of the way before deleting it: a kill in the middle of a
        deletion must not leave a half-deleted directory under a checkpoint's name (the
        temporary name is cleaned up on the next open)."""
        doomed = self.root / f"{_TMP_PREFIX}old-{path.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(path, doomed)
        return doomed

    # -- judging --

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

    def _verify(self, path: Path) -> _Verdict:
        """Read the manifest and hash every file it lists (the verdict is cached)."""
        stamp = _stamp(path)
        manifest, why = self._check(path)
        verdict = _Verdict(stamp, manifest, why)
        self._verdicts[path.name] = verdict
        return verdict

    def _judge(self, path: Path) -> _Verdict:
        """:meth:`_verify`, or its cached verdict while the directory's files are the ones
        it judged (same inode, size and modification time); a rejected one is invalid."""
        if path.name in self._rejected:
            return _Verdict((), None, self._rejected[path.name])
        cached = self._verdicts.get(path.name)
        if cached is not None and cached.stamp == _stamp(path):
            return cached
        return self._verify(path)

    def _check(self, path: Path) -> tuple[dict[str, Any] | None, str]:
        manifest = self._read_manifest(path)
        if manifest is None:
            return None, "no valid manifest (an interrupted save)"
        if manifest.get("swarm_id") != self.swarm_id:
            return None, f"belongs to swarm {manifest.get('swarm_id')!r}"
        parsed = parse_name(path.name)
        assert parsed is not None
        sequence, round_, step = parsed
        named = {"round": round_, "step": step, **({"sequence": sequence} if sequence else {})}
        for key, value in named.items():
            if manifest.get(key) != value or isinstance(manifest.get(key), bool):
                return None, f"its manifest names {key} {manifest.get(key)!r}, its name {value}"
        if not isinstance(manifest.get("verified", True), bool):
            return None, f"its manifest's verified is {manifest.get('verified')!r}"
        files = manifest.get("files")
        if not isinstance(files, dict) or set(files) != {TENSORS, STATE}:
            return None, "manifest lists the wrong files"
        for name, expected in files.items():
            file = path / name
            if not isinstance(expected, dict):
                return None, f"manifest entry of {name} is not a mapping"
            try:
                size = file.stat().st_size
            except OSError:
                return None, f"{name} is missing"
            if size != expected.get("bytes") or _sha256(file) != expected.get("sha256"):
                return None, f"{name} does not match its hash in the manifest"
        return manifest, ""

    def reject(self, path: Path, why: str) -> None:
        """Count ``path`` as invalid from now on (for this store's life), though its hashes
        match: its content does not fit the peer. It is then not one of the kept
        checkpoints, and never deleted."""
        self._rejected[path.name] = why

    def inventory(self) -> list[tuple[Path, str]]:
        """Every checkpoint directory, newest first, with '' if valid or why it is not
        (every file hashed again)."""
        return [(p, self._rejected.get(p.name) or self._verify(p).why) for p in self._candidates()]

    # -- loading --

    def latest(self, *, verified: bool | None = None) -> Checkpoint | None:
        """The newest valid checkpoint of this swarm, or None; with ``verified=True``, the
        newest whose global state this peer trained and checked itself (what to roll back
        to). Invalid ones are skipped with a warning (never deleted: a person may want to
        look at them)."""
        return next(self.valid(verified=verified), None)

    def valid(
        self,
        *,
        verified: bool | None = None,
        on_skip: Callable[[Path, str], None] | None = None,
    ) -> Iterator[Checkpoint]:
        """Every valid checkpoint, newest first, loaded one at a time (each after its
        files were hashed again); with ``verified``, only those whose manifest says so.
        A directory that fails the hash check or cannot be read is skipped with a warning
        and reported to ``on_skip(path, why)``; one that cannot be read is also rejected
        (:meth:`reject`). A caller that finds a loaded checkpoint unfit for it rejects it
        and takes the next."""
        self._require_open()
        for path in self._candidates():
            if verified is not None:
                said = self._read_manifest(path)
                if said is not None and said.get("verified", True) is not verified:
                    continue  # not what was asked for: not worth hashing
            if path.name in self._rejected:
                why = self._rejected[path.name]
                manifest = None
            else:
                verdict = self._verify(path)
                manifest, why = verdict.manifest, verdict.why
            if manifest is not None:
                try:
                    found = self._load(path, manifest)
                except Exception as e:  # whatever its bytes make the parsers raise
                    why = f"cannot be read: {type(e).__name__}: {e}"
                    self.reject(path, why)
                else:
                    yield found
                    continue
            logger.warning("skipping checkpoint %s: %s", path, why)
            if on_skip is not None:
                on_skip(path, why)

    def _load(self, path: Path, manifest: Mapping[str, Any]) -> Checkpoint:
        tensors = _mapped_tensors(path / TENSORS)
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
            sequence=int(manifest.get("sequence", 0)),
            verified=bool(manifest.get("verified", True)),
        )


def _mapped_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, mapped from it rather than read: loading them
    into a model copies them page by page from the page cache, so resuming holds no second
    copy of the state in the peer's memory (private mappings: writing to one changes
    nothing on disk). A tensor whose offset does not suit its type is copied out."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{path} is too short for a safetensors file")
        header_len = int.from_bytes(file.read(8), "little")
        if header_len > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path} has a header of {header_len} bytes")
        header = json.loads(file.read(header_len))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    by_name = {v: k for k, v in _DTYPES.items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = by_name[info["dtype"]], tuple(info["shape"])
        start, stop = info["data_offsets"]
        offset = 8 + header_len + start
        count = (stop - start) // dtype.itemsize
        if count == 0 or mapped is None:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        if stop + 8 + header_len > size or count != math.prod(shape):
            raise CheckpointError(f"tensor {name!r} of {path} does not fit the file")
        with warnings.catch_warnings():  # (a private mapping is writable; torch cannot tell)
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset)
        if offset % dtype.itemsize:
            flat = flat.clone()
        tensors[name] = flat.view(shape)
    return tensors


def _stamp(path: Path) -> _Stamp:
    """How a checkpoint directory's files look: a verdict holds while this does."""
    stamp: list[tuple[str, int, int, int] | tuple[str]] = []
    for name in (MANIFEST, TENSORS, STATE):
        try:
            st = (path / name).stat()
        except OSError:
            stamp.append((name,))
            continue
        stamp.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


def _point(manifest: Mapping[str, Any]) -> tuple[Any, Any, bool]:
    """What a checkpoint holds the state of: saved twice, the later one supersedes."""
    return manifest.get("round"), manifest.get("step"), bool(manifest.get("verified", True))


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint the :class:`BackgroundWriter` finished writing."""

    path: Path
    round: int
    step: int
    nbytes: int
    copy_seconds: float
    """What the caller's thread spent writing the state's files into the page cache (all
    that training waited for)."""
    write_seconds: float
    """What the writer's thread spent hashing, fsyncing and putting it in place."""
    verified: bool = True


class BackgroundWriter:
    """Writes a store's checkpoints on a thread of its own while training goes on.

    :meth:`submit` writes the state's files on the caller's thread, straight from its
    tensors into the page cache (all training waits for: no copy of the state is made,
    DESIGN section 6, "Host memory"), and hands the hashing, fsyncing and renaming, which
    take seconds for a large model, to the writer thread. At most one write is in flight.
    :meth:`poll` reports a finished write, or raises its :class:`CheckpointError`;
    :meth:`wait` blocks for it. :meth:`close` waits for the write in flight, so that none is
    cut short by the process leaving (a kill -9 still leaves the earlier checkpoints
    intact).
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        clone: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = clone_on_device,
    ) -> None:
        self.store = store
        self.clone = clone
        """Which tensors are cloned and written on the writer's thread (see
        :meth:`CheckpointStore.stage`): a GPU's, where the card has the room."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: concurrent.futures.Future[Saved] | None = None

    @property
    def busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def submit(
        self, *, round: int, step: int, state: Mapping[str, Any], verified: bool = True
    ) -> None:
        """Write ``state``'s files now (the caller may change it as soon as this returns)
        and finish the checkpoint on the writer's thread (``verified``: as
        :meth:`CheckpointStore.save`). Raises if a write is still in flight (check
        :attr:`busy`) or the last one was not collected (:meth:`poll` or :meth:`wait`
        first); a failure to write is reported by them, as a failure to finish is."""
        if self._inflight is not None:
            if not self._inflight.done():
                raise RuntimeError("a checkpoint is still being written")
            raise RuntimeError("the previous checkpoint was not collected (call poll or wait)")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="swarmloco-checkpoint"
            )
        try:
            staged = self.store.stage(
                round=round, step=step, state=state, verified=verified, clone=self.clone
            )
        except CheckpointError as exc:
            failed: concurrent.futures.Future[Saved] = concurrent.futures.Future()
            failed.set_exception(exc)
            self._inflight = failed
            return
        self._inflight = self._pool.submit(self._commit, staged)

    def _commit(self, staged: Staged) -> Saved:
        started = time.monotonic()
        path = self.store.commit(staged)
        seconds = time.monotonic() - started
        return Saved(
            path,
            staged.round,
            staged.step,
            staged.nbytes,
            staged.seconds,
            seconds,
            staged.verified,
        )

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
