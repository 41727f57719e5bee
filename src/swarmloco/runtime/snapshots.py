"""What a peer's state donor serves: the committed global state of its last round, and
the round before it (a peer that decided to download a round as the swarm moved on asks
for that one).

A round's state is written into an unnamed file (``net/state/files.py``) and hashed as
it is written, on a thread of its own while training goes on (a large model's state takes
seconds): the peer holds its state in memory once, and what it serves lies in the page
cache (DESIGN section 6, "Host memory"). The writer reads ``theta_g`` and the momentum in
place, under the DiLoCo state's lock, taken before :meth:`Snapshots.hash_later` returns:
an outer step, an adoption or a load waits for the file rather than changing the state
under it. Until the new round's digest is known the donor serves the previous round's
snapshot, then the new one, and whatever waited for the digest (the round event, the
``digest/<r>`` record) runs on the training thread in :meth:`Snapshots.finish`. Rounds are
written one at a time and finish in order.

Without a directory (or when it cannot take the file: a full disk, said once in the log)
a snapshot is a copy in memory.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from swarmloco.core.state import StateSnapshot
from swarmloco.net.state.files import write_state
from swarmloco.train.diloco import DilocoState

logger = logging.getLogger(__name__)

Then = Callable[[bytes], None]


class Snapshots:
    """The donor's current snapshot, and the one being written. Use with ``with``."""

    def __init__(self, swarm_id: str, directory: Path | None = None) -> None:
        """``directory``: where the snapshots' unnamed files go (None: copies in memory)."""
        self.swarm_id = swarm_id
        self.directory = directory
        self.current: StateSnapshot | None = None
        """What the donor serves (read from the event loop's thread)."""
        self.previous: StateSnapshot | None = None
        """The snapshot ``current`` replaced, served to whoever asks for its round."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._hashing: tuple[concurrent.futures.Future[StateSnapshot], Then] | None = None
        self._disk_failed = False

    def __enter__(self) -> Snapshots:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "swarmloco-digest")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def store(self, diloco: DilocoState) -> StateSnapshot:
        """Serve the committed state of ``diloco`` as it is now, written and hashed here."""
        self.finish(wait=True)
        with diloco.lock:
            snapshot = self.keep(diloco.round, diloco.committed())
        self._replace(snapshot)
        return snapshot

    def publish(self, snapshot: StateSnapshot) -> None:
        """Serve ``snapshot`` (one nobody changes: a download, a fallback) from now on."""
        self.finish(wait=True)
        self._replace(snapshot)

    def keep(
        self, round: int, tensors: Mapping[str, torch.Tensor], digest: bytes | None = None
    ) -> StateSnapshot:
        """A snapshot of ``tensors`` of its own (a file, or a copy), hashed unless
        ``digest`` is given; not served until published. The tensors must not change
        until this returns."""
        if self.directory is not None and not self._disk_failed:
            try:
                return write_state(
                    self.directory,
                    swarm_id=self.swarm_id,
                    round=round,
                    tensors=tensors,
                    digest=digest,
                )
            except OSError as exc:
                self._disk_failed = True
                logger.warning(
                    "cannot write the state of round %d under %s (%s): the states this peer "
                    "serves are kept in memory from now on (8 bytes a parameter each)",
                    round,
                    self.directory,
                    exc,
                )
        copies = {name: tensor.clone() for name, tensor in tensors.items()}
        return StateSnapshot.of(swarm_id=self.swarm_id, round=round, tensors=copies, digest=digest)

    def _replace(self, snapshot: StateSnapshot) -> None:
        if self.current is not None and self.current.round < snapshot.round:
            self.previous = self.current
        elif self.current is not None:  # the same round again, or an older one: a new line
            self.previous = None
        self.current = snapshot

    def hash_later(self, diloco: DilocoState, then: Then) -> None:
        """:meth:`store` on the digest thread; ``then(digest)`` runs in :meth:`finish`.
        The state's lock is taken here, before returning, and let go once it is written:
        nothing changes the state of this round before the file holds it."""
        self.finish(wait=True)
        assert self._pool is not None, "use Snapshots in a with block"
        diloco.lock.acquire()
        try:
            future = self._pool.submit(
                self._keep_then_release, diloco.lock, diloco.round, diloco.committed()
            )
        except BaseException:
            diloco.lock.release()
            raise
        self._hashing = (future, then)

    def _keep_then_release(
        self, lock: threading.Lock, round: int, tensors: Mapping[str, torch.Tensor]
    ) -> StateSnapshot:
        try:
            return self.keep(round, tensors)
        finally:
            lock.release()

    @property
    def pending(self) -> bool:
        return self._hashing is not None

    def finish(self, *, wait: bool = False) -> None:
        """Take the snapshot the digest thread wrote if it is done (or once it is, with
        ``wait``) and run what waited for its digest."""
        if self._hashing is None:
            return
        future, then = self._hashing
        if not wait and not future.done():
            return
        self._hashing = None
        self._replace(future.result())
        assert self.current is not None
        then(self.current.digest)
