"""Which global state is the swarm's: the majority digest of a round (DESIGN section 3).

Every peer that applies round r publishes the digest of its global state under
``digest/<r>``. Members of one group end a round with identical bytes, so honest peers of
a round agree; a peer whose digest differs from the majority (a bug, a lost chunk, a
hostile group) re-downloads the state from a holder of the majority digest. Pure: the
caller passes the published digests.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping

DIGEST_BYTES = 32
"""Length of a state digest (BLAKE2b-256, core/state.py)."""


@dataclasses.dataclass(frozen=True)
class Majority:
    digest: bytes | None
    """The digest most peers published (None when nobody published one)."""
    holders: tuple[str, ...]
    """Peers that published it, sorted: the donors to download the state from."""
    published: int
    """Peers that published any digest for the round."""

    @property
    def share(self) -> float:
        return len(self.holders) / self.published if self.published else 0.0

    def agrees(self, digest: bytes) -> bool:
        """Whether a peer holding ``digest`` holds the swarm's state."""
        return self.digest is not None and digest == self.digest


def ranking(published: Mapping[str, bytes]) -> list[Majority]:
    """Every digest published for a round with its holders, most held first.

    ``published``: peer id -> digest; malformed digests are ignored. Ties are broken by the
    smaller digest, so that every peer reading the same records ranks them the same way.
    A peer tries the first; if none of its holders can hand the state over, the next.
    """
    valid = {
        peer: d for peer, d in published.items() if isinstance(d, bytes) and len(d) == DIGEST_BYTES
    }
    counts = Counter(valid.values())
    order = sorted(counts, key=lambda d: (-counts[d], d))
    return [
        Majority(d, tuple(sorted(peer for peer, x in valid.items() if x == d)), len(valid))
        for d in order
    ]


def majority(published: Mapping[str, bytes]) -> Majority:
    """The digest published by the most peers (``published``: peer id -> digest).

    Malformed digests are ignored. A tie is broken by the smaller digest, so that every
    peer reading the same records picks the same one.
    """
    ranked = ranking(published)
    return ranked[0] if ranked else Majority(None, (), 0)
