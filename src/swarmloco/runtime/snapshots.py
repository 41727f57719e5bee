"""What a peer's state donor serves: the committed global state of its last round, and
the round before it (a peer that decided to download a round as the swarm moved on asks
for that one).

A new round's state is hashed on a thread of its own while training goes on (a large
model's state takes seconds to hash): until its digest is known the donor serves the
previous round's snapshot, then the new one, and whatever waited for the digest (the round
event, the ``digest/<r>`` record) runs on the training thread in :meth:`Snapshots.finish`.
Rounds are hashed one at a time and finish in order.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping

import torch

from swarmloco.core.state import StateSnapshot

Then = Callable[[bytes], None]


class Snapshots:
    """The donor's current snapshot, and the one being hashed. Use with ``with``."""

    def __init__(self, swarm_id: str) -> None:
        self.swarm_id = swarm_id
        self.current: StateSnapshot | None = None
        """What the donor serves (read from the event loop's thread)."""
        self.previous: StateSnapshot | None = None
        """The snapshot ``current`` replaced, served to whoever asks for its round."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._hashing: tuple[concurrent.futures.Future[StateSnapshot], Then] | None = None

    def __enter__(self) -> Snapshots:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "swarmloco-digest")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def publish(
        self, round: int, tensors: Mapping[str, torch.Tensor], digest: bytes | None = None
    ) -> StateSnapshot:
        """Serve ``tensors`` (a copy nobody changes) as the state of ``round`` from now on,
        hashed here unless ``digest`` is given."""
        self.finish(wait=True)
        self._replace(
            StateSnapshot.of(swarm_id=self.swarm_id, round=round, tensors=tensors, digest=digest)
        )
        assert self.current is not None
        return self.current

    def _replace(self, snapshot: StateSnapshot) -> None:
        if self.current is not None and self.current.round < snapshot.round:
            self.previous = self.current
        elif self.current is not None:  # the same round again, or an older one: a new line
            self.previous = None
        self.current = snapshot

    def hash_later(self, round: int, tensors: Mapping[str, torch.Tensor], then: Then) -> None:
        """:meth:`publish` on the digest thread; ``then(digest)`` runs in :meth:`finish`."""
        self.finish(wait=True)
        assert self._pool is not None, "use Snapshots in a with block"
        future = self._pool.submit(
            StateSnapshot.of, swarm_id=self.swarm_id, round=round, tensors=tensors
        )
        self._hashing = (future, then)

    @property
    def pending(self) -> bool:
        return self._hashing is not None

    def finish(self, *, wait: bool = False) -> None:
        """Take the snapshot the digest thread hashed if it is done (or once it is, with
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
