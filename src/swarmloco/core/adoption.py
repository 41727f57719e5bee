"""When a peer may replace its global state with another peer's (docs/SECURITY.md, "Many
keys").

A peer that is behind the swarm, or whose state is in the minority of its round, downloads
a state from peers that published its digest. Records are cheap to forge and keys cost
nothing: one stranger can mint a thousand keys, publish one digest under all of them and
serve a state that matches it. So a count of keys is never evidence. A state is adopted
only on evidence that is first-hand (this peer observed it) or costly:

1. **Backing** (:func:`backing`). The digest is held by a *witness*: a peer this one
   averaged with in a completed group of one of its recent rounds (a signed member of a
   group this peer verified, which produced the same bytes; being one costs a member's
   whole share of a round's traffic). Only two kinds of peer have no witness to ask: a
   *fresh* one, which never applied a round and has nothing of its own to keep (it takes
   any state, the one held from the most networks first), and an *orphaned* one, whose
   every recent partner has gone silent; that one takes a state held from ``quorum``
   distinct networks (addresses cost, keys do not).
2. **Never a round it averaged in, on a stranger's word** (:func:`outweighs`). A round this
   peer applied as a member of a group of two or more is replaced only by a digest that its
   witnesses back more than its own: each witness counts the rounds it averaged with this
   peer (work done together, which no key gets for free), and this peer counts as much as
   its most constant partner. Strangers count nothing, so a thousand keys publishing
   another digest of a round just applied change nothing, while a group split in two heals
   towards the side more of its partners are on.
3. **A plausible round** (:func:`round_plausible`). The swarm cannot have applied more
   rounds since this peer's last one than time allows.
4. **A plausible state, whole** (:func:`check_state`), checked after the download: every
   tensor finite; ``theta_g`` at most ``movement_slack`` times the median outer step per
   round behind away from this peer's own; the outer momentum no longer than what the
   updates this peer measured itself can build up (``momentum_slack`` times it); the
   swarm's token count within what its rounds add. A fresh peer, with no history, holds
   the momentum against the distance the state moved from its own (the initial weights):
   honest momentum never steps further than training went.
5. **Probation** (:class:`Probation`, applied by the peer): an adopted state is on
   probation for ``probation_rounds`` rounds averaged with others; if training from it
   turns the loss NaN or ``explode_factor`` times what it was, the peer rolls back to the
   last state it trained and verified itself and distrusts the state's digest and holders.

Pure: the caller passes what it observed; :class:`Evidence` is what it keeps (and
checkpoints) between rounds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from swarmloco.core.config import require_int, require_positive
from swarmloco.core.state import StateSnapshot

_HISTORY = 16  # recent rounds whose movement, update and interval are kept
_LOSSES = 8  # training losses kept as a probation's reference
_SUSTAINED = 5  # losses in a row whose median condemns a state on probation


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdoptionConfig:
    """How much evidence adopting another peer's state takes."""

    quorum: int = 2
    """A stranger's claim of a later round counts only up to the ``quorum``-th highest
    claim of the peers that hold a round (one key alone cannot lead a peer past what the
    others report)."""
    witness_rounds: int = 64
    """A peer stays a witness for this many rounds after it last averaged with this one."""
    max_speedup: float = 4.0
    """Rounds may come at most this many times faster than this peer's own interval (a
    round is joined after a quarter of its steps at the earliest: see pacing)."""
    round_slack: int = 2
    """Rounds always allowed ahead, whatever the time since this peer's last round."""
    movement_slack: float = 4.0
    """A downloaded state may lie this many median outer steps per round away."""
    momentum_slack: float = 4.0
    """A downloaded outer momentum may be this many times as long as the longest the
    updates this peer measured can build up."""
    token_slack: float = 4.0
    """A downloaded token count may differ from this peer's by this many times the most
    tokens a round of its own added, per round ahead."""
    probation_rounds: int = 2
    """Rounds averaged with others after which an adopted state counts as this peer's own."""
    explode_factor: float = 100.0
    """Five training losses in a row whose median is above this multiple of the highest
    loss before an adoption (or one NaN) while on probation roll the adoption back. A
    poisoned outer momentum raises the loss by orders of magnitude (1.38 to 3,134, then
    NaN); a loss near its floor rises many times after an honest round (0.009 to 0.04 for a
    fresh peer, 0.0056 to 0.073 for another: a relative rule cannot tell noise near zero
    from an explosion at 10x)."""

    def __post_init__(self) -> None:
        require_int("quorum", self.quorum, minimum=1)
        require_int("witness_rounds", self.witness_rounds, minimum=1)
        require_positive("max_speedup", self.max_speedup)
        require_int("round_slack", self.round_slack, minimum=0)
        require_positive("movement_slack", self.movement_slack)
        require_positive("momentum_slack", self.momentum_slack)
        require_positive("token_slack", self.token_slack)
        require_int("probation_rounds", self.probation_rounds, minimum=0)
        require_positive("explode_factor", self.explode_factor)
        if self.explode_factor <= 1.0:
            raise ValueError(f"explode_factor must be above 1, got {self.explode_factor}")


def _finite_positive(x: float | None) -> float:
    return float(x) if x is not None and math.isfinite(x) and x > 0 else 0.0


@dataclasses.dataclass
class Evidence:
    """What a peer observed itself, which no remote record can forge."""

    witnesses: dict[str, int] = dataclasses.field(default_factory=dict)
    """Peer id -> the last round it averaged with this peer."""
    together: dict[str, int] = dataclasses.field(default_factory=dict)
    """Peer id -> how many of this peer's rounds it averaged in (witnesses only)."""
    grouped_round: int = 0
    """The last round this peer applied as a member of a group of two or more."""
    movements: list[float] = dataclasses.field(default_factory=list)
    """Norms of this peer's recent outer steps (``|theta_g after - theta_g before|``)."""
    lrs: list[float] = dataclasses.field(default_factory=list)
    """The mean inner learning rate of the steps before each of ``movements`` (0: not
    known)."""
    updates: list[float] = dataclasses.field(default_factory=list)
    """Norms of the group means (the averaged pseudo-gradients) of those rounds (0: not
    known), what the outer momentum is built from."""
    tokens: list[float] = dataclasses.field(default_factory=list)
    """Tokens the swarm's count grew by in each of those rounds (the weights of the
    members its result held whole)."""
    intervals: list[float] = dataclasses.field(default_factory=list)
    """Seconds between this peer's recent consecutive applied rounds."""
    last_round_at: float | None = None
    """Unix time at which this peer's state reached its round (applied, downloaded)."""

    @property
    def fresh(self) -> bool:
        """Whether this peer never applied a round (it has nothing to hold a claim against)."""
        return not self.witnesses and not self.movements

    def partners(self, limit: int) -> list[str]:
        """The witnesses, newest round first (then the most rounds together), at most
        ``limit``: what this peer's ``partners`` record names. Safe to call from another
        thread than the one recording rounds (it reads copies)."""
        witnesses, together = dict(self.witnesses), dict(self.together)
        ranked = sorted(witnesses, key=lambda p: (-witnesses[p], -together.get(p, 0), p))
        return ranked[:limit]

    def grouped(self, round: int, members: Iterable[str], me: str, config: AdoptionConfig) -> None:
        """The members of a group that completed ``round`` with this peer are witnesses:
        those whose contribution its result held whole (a member struck or lost in the
        round averaged nothing with this peer)."""
        others = {peer for peer in members if peer != me}
        for peer in others:
            self.witnesses[peer] = round
            self.together[peer] = self.together.get(peer, 0) + 1
        if others:
            self.grouped_round = max(self.grouped_round, round)
        oldest = round - config.witness_rounds
        for peer in [p for p, r in self.witnesses.items() if r < oldest]:
            del self.witnesses[peer]
            self.together.pop(peer, None)

    def applied(
        self,
        movement: float,
        at: float,
        *,
        alone: bool = False,
        lr: float | None = None,
        update: float | None = None,
        tokens: float | None = None,
    ) -> None:
        """This peer applied an outer step of norm ``movement`` at unix time ``at``, after
        inner steps of mean learning rate ``lr``, with a group mean of norm ``update``
        that added ``tokens`` to the swarm's count; ``alone``: in a group of one. A round
        alone says nothing of the swarm's pace, so it leaves the clock of
        :func:`round_plausible` running from the last round applied with others: a peer
        that averaged alone for a while (the others out of reach or ahead) may still take
        a state that many rounds ahead."""
        if math.isfinite(movement):
            self.movements = [*self.movements, movement][-_HISTORY:]
            self.lrs = [*self.lrs, _finite_positive(lr)][-_HISTORY:]
            self.updates = [*self.updates, _finite_positive(update)][-_HISTORY:]
            self.tokens = [*self.tokens, _finite_positive(tokens)][-_HISTORY:]
        if alone and self.last_round_at is not None:
            return
        if self.last_round_at is not None and at > self.last_round_at:
            self.intervals = [*self.intervals, at - self.last_round_at][-_HISTORY:]
        self.last_round_at = at

    def adopted(self, at: float) -> None:
        """This peer took another state at ``at`` (no interval: it did not train it)."""
        self.last_round_at = at

    def to_state(self) -> dict[str, Any]:
        return {
            "witnesses": dict(self.witnesses),
            "together": dict(self.together),
            "grouped_round": self.grouped_round,
            "movements": list(self.movements),
            "lrs": list(self.lrs),
            "updates": list(self.updates),
            "tokens": list(self.tokens),
            "intervals": list(self.intervals),
            "last_round_at": self.last_round_at,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Evidence:
        last = state.get("last_round_at")
        movements = [float(m) for m in state.get("movements", [])][-_HISTORY:]

        def aligned(name: str) -> list[float]:
            values = [float(x) for x in state.get(name, [])][-_HISTORY:]
            return values if len(values) == len(movements) else [0.0] * len(movements)

        witnesses = {str(p): int(r) for p, r in dict(state.get("witnesses", {})).items()}
        together = {str(p): int(n) for p, n in dict(state.get("together", {})).items()}
        return cls(
            witnesses=witnesses,
            # Checkpoints from before the count: each witness counts one round.
            together={p: max(1, together.get(p, 1)) for p in witnesses},
            grouped_round=int(state.get("grouped_round", 0)),
            movements=movements,
            lrs=aligned("lrs"),
            updates=aligned("updates"),
            tokens=aligned("tokens"),
            intervals=[float(s) for s in state.get("intervals", [])][-_HISTORY:],
            last_round_at=None if last is None else float(last),
        )

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Become what :meth:`to_state` saved (in place: the peer's parts hold this object)."""
        loaded = Evidence.from_state(state)
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(loaded, field.name))

    def support(self, holders: Iterable[str]) -> int:
        """How much this peer's own history backs a digest ``holders`` hold: each witness
        among them counts the rounds it averaged with this peer; strangers count 0."""
        return sum(self.together.get(p, 1) for p in set(holders) if p in self.witnesses)

    @property
    def own_weight(self) -> int:
        """What this peer's own word counts in :func:`outweighs`: as much as its most
        constant partner's."""
        return max(self.together.values(), default=1)


def backing(
    holders: Iterable[str],
    evidence: Evidence,
    config: AdoptionConfig,
    *,
    orphaned: bool = False,
) -> str | None:
    """Why a digest held by ``holders`` is not backed, or None if it is. A witness backs
    a digest. A peer with nobody to ask (fresh, or ``orphaned``: every partner it had is
    silent, or it never had one) has nothing of its own to weigh a claim against: every
    digest backs itself, the caller tries the one held from the most networks first, and
    the whole-state checks and the probation decide."""
    held = set(holders)
    if evidence.fresh or orphaned or held & evidence.witnesses.keys():
        return None
    return (
        f"held by {len(held)} peer(s), none of which averaged with this peer lately "
        "(keys cost nothing: only a recent partner's word counts)"
    )


def outweighs(
    other: Iterable[str],
    own: Iterable[str],
    evidence: Evidence,
    *,
    grouped: bool,
    tie_break: bool = False,
) -> str | None:
    """Why the digest ``other`` holds may not replace this peer's state of the same round,
    held by ``own`` (this peer among them, or not), or None if it may. ``grouped``: this
    peer applied that round as a member of a group of two or more (its own word then
    counts as much as its most constant partner's). ``tie_break``: the other digest sorts
    before this peer's own, so that a split backed evenly on both sides (two partners that
    applied one round apart, say) heals towards one side on both; never towards a digest
    no partner holds."""
    theirs = evidence.support(other)
    ours = evidence.support(own) + (evidence.own_weight if grouped else 0)
    if theirs > ours or (theirs == ours > 0 and tie_break):
        return None
    if theirs == 0:
        return (
            "none of its holders averaged with this peer lately, and this peer's own state "
            "of the round is never replaced on a stranger's word"
        )
    return (
        f"this peer's partners back its own state of the round as much or more "
        f"({ours} rounds together against {theirs})"
    )


def round_plausible(
    ahead: int, now: float, evidence: Evidence, config: AdoptionConfig
) -> str | None:
    """Why the swarm cannot be ``ahead`` rounds past this peer by ``now``, or None."""
    if ahead <= config.round_slack or evidence.last_round_at is None or not evidence.intervals:
        return None
    interval = statistics.median(evidence.intervals)
    if interval <= 0:
        return None
    elapsed = max(0.0, now - evidence.last_round_at)
    allowed = config.round_slack + config.max_speedup * elapsed / interval
    if ahead <= allowed:
        return None
    return (
        f"{ahead} rounds ahead {elapsed:.1f}s after this peer's last round, while rounds "
        f"took {interval:.1f}s here: at most {allowed:.1f} are plausible"
    )


def _per_lr(
    values: list[float], lrs: list[float], lr: float | None, *, zero_unknown: bool = False
) -> float | None:
    """The median of ``values`` scaled to learning rate ``lr`` (each taken per unit of the
    learning rate before it), or their plain median when rates are not known; None when
    there are no values (``zero_unknown``: a 0 means "not measured")."""
    rates_of = [*lrs, *[0.0] * (len(values) - len(lrs))]
    known = [(v, x) for v, x in zip(values, rates_of, strict=False) if v > 0 or not zero_unknown]
    if not known:
        return None
    rates = [v / x for v, x in known if x > 0]
    if lr is not None and math.isfinite(lr) and lr > 0 and rates:
        return statistics.median(rates) * lr
    return statistics.median(v for v, _ in known)


def distance_bound(
    ahead: int, evidence: Evidence, config: AdoptionConfig, *, lr: float | None = None
) -> float | None:
    """How far (L2) a state ``ahead`` rounds past this peer's may lie from its own
    ``theta_g``; None when this peer has not measured its outer steps yet.

    ``lr``: the highest inner learning rate the schedule reaches over those rounds, when
    known; each round missed then moves up to the median movement per unit of learning
    rate times it. Without it (or without the learning rates of the movements), the
    median movement itself."""
    if not evidence.movements:
        return None
    rounds = max(ahead, 0) + 2
    typical = _per_lr(evidence.movements, evidence.lrs, lr)
    assert typical is not None  # movements is not empty
    return config.movement_slack * typical * rounds


def momentum_bound(
    evidence: Evidence,
    config: AdoptionConfig,
    *,
    outer_momentum: float,
    fragments: int = 1,
    lr: float | None = None,
) -> float | None:
    """The longest outer momentum the updates this peer measured can build up, times
    ``momentum_slack``; None without measured updates.

    The buffer is ``b <- mu * b + g``: its length never exceeds ``max |g| / (1 - mu)``,
    per fragment (each fragment's slice sees that fragment's rounds), so ``sqrt(F)`` times
    that over the whole vector. Updates scale with the inner learning rate, so they are
    kept per unit of it and scaled to ``lr`` (the highest rate over the rounds missed)."""
    typical = _per_lr(evidence.updates, evidence.lrs, lr, zero_unknown=True)
    if typical is None:
        return None
    mu = min(max(outer_momentum, 0.0), 0.999)
    return config.momentum_slack * typical * math.sqrt(max(fragments, 1)) / (1.0 - mu)


@dataclasses.dataclass(frozen=True)
class StateCheck:
    """What :func:`check_state` found: ``reason`` is None when the state is plausible."""

    reason: str | None
    distance: float | None = None
    bound: float | None = None
    momentum: float | None = None
    momentum_bound: float | None = None


@dataclasses.dataclass(frozen=True)
class Reference:
    """This peer's own global state, what a downloaded one is held against."""

    theta_g: torch.Tensor
    momentum: torch.Tensor | None
    tokens: int
    outer_lr: float
    outer_momentum: float
    fragments: int = 1
    group_cap: int = 64
    """The most members a group may have (a round adds at most that many weights)."""


def _squares(x: torch.Tensor) -> float:
    """The sum of ``x``'s squares, in float64 (no overflow below 1e154)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


def _walk(
    state: Mapping[str, torch.Tensor] | StateSnapshot,
) -> tuple[list[str], Callable[[str], Iterator[torch.Tensor]]]:
    """The tensors' names, and each tensor a piece at a time (a snapshot in a file is
    never read whole)."""
    if isinstance(state, StateSnapshot):
        return [spec.name for spec in state.specs], state.pieces
    return list(state), lambda name: iter((state[name].reshape(-1),))


def check_state(
    state: Mapping[str, torch.Tensor] | StateSnapshot,
    *,
    ahead: int,
    reference: Reference,
    evidence: Evidence,
    config: AdoptionConfig,
    lr: float | None = None,
    theta_g: str = "theta_g",
    momentum: str = "momentum",
    tokens: str = "tokens",
) -> StateCheck:
    """Whether a downloaded state (named tensors or a snapshot, ``ahead`` rounds past this
    peer's) is a plausible successor of this peer's own (``reference``), whole: every
    tensor finite, the weights within :func:`distance_bound`, the momentum within
    :func:`momentum_bound` (for a fresh peer: an outer step of it goes no further than the
    state moved from this peer's), the token count within what the rounds between add.
    ``lr``: the highest inner learning rate over those rounds, when known. Read a piece
    at a time: nothing of the state's size is allocated."""
    names, pieces = _walk(state)
    squares = {theta_g: 0.0, momentum: 0.0}  # of the distance, and of the momentum's length
    count = None
    for name in names:
        at = 0
        for piece in pieces(name):
            if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
                return StateCheck(f"its {name} holds NaN or Inf")
            if name == theta_g:
                mine = reference.theta_g[at : at + piece.numel()]
                squares[name] += _squares(piece - mine)
            elif name == momentum:
                squares[name] += _squares(piece)
            elif name == tokens:
                count = piece.clone()
            at += piece.numel()
    distance = math.sqrt(squares[theta_g])
    bound = distance_bound(ahead, evidence, config, lr=lr)
    if bound is not None and not distance <= bound:
        return StateCheck(
            f"lies {distance:.4g} away from this peer's state, while {ahead} round(s) of "
            f"outer steps move it at most {bound:.4g}",
            distance,
            bound,
        )
    length = math.sqrt(squares[momentum])
    limit = momentum_bound(
        evidence,
        config,
        outer_momentum=reference.outer_momentum,
        fragments=reference.fragments,
        lr=lr,
    )
    if limit is None and evidence.fresh:
        # Nothing measured: one outer step of the momentum may not reach further than the
        # state moved from this peer's own (for a fresh peer, the initial weights). Honest
        # training gets there by steps of that momentum, so it is never shorter than one.
        own = reference.momentum
        own_length = float(torch.linalg.vector_norm(own)) if own is not None else 0.0
        limit = config.momentum_slack * (distance / reference.outer_lr + own_length)
    if limit is not None and not length <= limit:
        return StateCheck(
            f"its outer momentum is {length:.4g} long, while the updates this peer measured "
            f"build up at most {limit:.4g}",
            distance,
            bound,
            length,
            limit,
        )
    if count is not None:
        value = int(count.reshape(-1)[0]) if count.numel() else -1
        if value < 0:
            return StateCheck(f"its token count {value} is negative", distance, bound)
        per_round = max(evidence.tokens, default=0.0)
        if per_round > 0:
            # This peer's rounds may have been smaller than the swarm's: allow a full group
            # of its own weight per round.
            allowed = config.token_slack * per_round * (abs(ahead) + 2) * reference.group_cap
            if abs(value - reference.tokens) > allowed:
                return StateCheck(
                    f"its token count {value} differs from this peer's {reference.tokens} "
                    f"by more than {ahead} round(s) add ({allowed:.4g})",
                    distance,
                    bound,
                )
    return StateCheck(None, distance, bound, length, limit)


@dataclasses.dataclass
class Probation:
    """An adopted state on trial (the peer keeps its last verified state meanwhile).

    ``rounds`` counts the rounds averaged with others since the adoption. The reference is
    the highest of the training losses before the adoption or, for a peer that logged too
    few, of those before its first round from the adopted state lands (the state's own
    loss, before any outer step of its momentum). A state is condemned by a loss that is
    not finite, or by five losses in a row whose median passes ``explode_factor`` times
    the reference: training noise (a small loss rising several times from one batch or
    one round to the next) is not an explosion, an outer step of a poisoned momentum is."""

    round: int
    """The adopted state's round."""
    digest: bytes
    holders: tuple[str, ...]
    before: list[float] = dataclasses.field(default_factory=list)
    """Training losses before the adoption (the reference, when there are enough)."""
    after: list[float] = dataclasses.field(default_factory=list)
    """Training losses since, until the first round from the adopted state lands."""
    rounds: int = 0
    landed: bool = False
    recent: list[float] = dataclasses.field(default_factory=list)
    """The last losses since that round landed."""

    def to_state(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "digest": self.digest,
            "holders": list(self.holders),
            "before": list(self.before),
            "after": list(self.after),
            "rounds": self.rounds,
            "landed": self.landed,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Probation:
        return cls(
            round=int(state["round"]),
            digest=bytes(state["digest"]),
            holders=tuple(str(h) for h in state["holders"]),
            before=recent_losses(float(x) for x in state.get("before", [])),
            after=recent_losses(float(x) for x in state.get("after", [])),
            rounds=int(state.get("rounds", 0)),
            landed=bool(state.get("landed", False)),
        )

    def reference(self) -> float | None:
        before = [x for x in self.before if math.isfinite(x)]
        after = [x for x in self.after if math.isfinite(x)]
        losses = before if len(before) >= _SUSTAINED else after
        return max(losses) if losses else None

    def loss(self, value: float, config: AdoptionConfig) -> str | None:
        """Why training loss ``value`` condemns the adopted state, or None."""
        if not math.isfinite(value):
            return f"the training loss turned {value} after adopting it"
        if not self.landed:
            self.after = [*self.after, value][-_LOSSES:]
            return None
        self.recent = [*self.recent, value][-_SUSTAINED:]
        reference = self.reference()
        if reference is None or reference <= 0 or len(self.recent) < _SUSTAINED:
            return None
        typical = statistics.median(self.recent)
        if typical > config.explode_factor * reference:
            return (
                f"the training loss rose to {typical:.4g} (the median of its last "
                f"{_SUSTAINED}) from at most {reference:.4g} after adopting it (more than "
                f"{config.explode_factor:g} times)"
            )
        return None

    def round_applied(self, grouped: bool, config: AdoptionConfig) -> bool:
        """A round from the adopted state landed; whether the probation is over."""
        self.landed = True
        if grouped:
            self.rounds += 1
        return self.rounds >= config.probation_rounds


def recent_losses(losses: Iterable[float]) -> list[float]:
    """The finite training losses worth keeping as a probation's reference."""
    return [x for x in losses if math.isfinite(x)][-_LOSSES:]
