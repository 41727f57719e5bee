"""What the dashboard shows, as a pure function of the records it read and the time.

:class:`Reading` holds one poll of a swarm's records (manifest, peers, progress, status and
the digests of the current round), as validated DHT values. :func:`build_view` turns a
reading, the :class:`History` of earlier readings and ``now`` into the JSON-able view that
``/api/v1/state``, ``/metrics``, the page and ``swarmloco status`` all render.

Records are signed and schema-checked by the DHT layer, but their *content* is what a peer
claims: clocks run ahead, rates can be absurd, names can carry terminal escapes. Nothing a
peer publishes can crash the view or poison the swarm's figures: text is cleaned, rates
beyond :data:`MAX_TOKENS_PER_S` are not counted, the current round ignores peers far ahead
of the median, and per-round figures are medians over the peers that reported them.

*Whose* records count is decided on first-hand evidence (:func:`roster`): the peers a
trusted peer averaged with, as their ``partners`` records say on both sides; the rest are
listed apart (docs/SECURITY.md, "What the dashboard counts").

Nothing here reads a clock or the network; no torch.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from swarmloco.core.agreement import majority
from swarmloco.core.manifest import SwarmManifest
from swarmloco.net.endpoints import endpoint_network
from swarmloco.net.swarm import creator_peer_id

VIEW_VERSION = 1
"""Version of the JSON layout of the view (``/api/v1/state``)."""
FRESH_S = 30.0
"""A peer whose status record is older than this is shown offline (peers publish every few
seconds)."""
MAX_TOKENS_PER_S = 1e9
"""No single peer trains faster than this; a claimed rate above it is not counted."""
MAX_ROUND_LEAD = 1000
"""A peer claiming a round this far beyond the median of online peers does not set the
swarm's current round (it is lying or from another run's bug)."""
MAX_ABS_LOSS = 1e9
"""Losses beyond this magnitude are not shown (they would flatten every curve)."""
CLOCK_AHEAD_S = 5.0
"""A record dated this far in our future is reported as coming from a clock that runs ahead."""
MAX_PEERS_SHOWN = 512
"""Rows of the per-peer table (online peers first); the rest are counted, not listed."""
MAX_TIMELINE_ROUNDS = 60
"""Rounds of the timeline in the view (the newest)."""
MAX_HISTORY_ROUNDS = 200
"""Rounds a :class:`History` keeps."""
MAX_TRACKED_PEERS = 64
"""Peers whose loss curve a :class:`History` keeps (the most recently updated)."""
HISTORY_POINTS = 720
"""Points per curve a :class:`History` keeps (24 minutes at one point every 2 s)."""
MAX_WARNINGS = 20
MAX_REMEMBERED = 4096
"""Peers a :class:`History` remembers as vouched for by a trusted peer."""
MAX_SEQUENCES_PER_S = 1e7
"""No stage replica computes more sequences a second than this; a claim above it is not
counted."""
STAGE_RECORDS_PER_NETWORK = 4
"""A stage's replicas counted per source network (a driver draws from as many: its
``replicas_per_network``)."""
MAX_MOVES_SHOWN = 20
"""Moves between stages a :class:`History` keeps (the newest)."""

_SHORT_ID = 12
_TEXT_DROP = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reading:
    """One poll of a swarm's records: DHT values by owner (peer id in hex)."""

    swarm_id: str
    at: float
    """Our clock (unix seconds) when the records were read."""
    manifest: SwarmManifest | None = None
    peers: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """``peers`` record values: endpoint, role, version, public."""
    progress: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """``progress`` record values: round worked towards, tokens since it, rate, at."""
    status: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """``status`` record values (runtime/peer.py publishes them)."""
    digest_round: int | None = None
    """The round whose ``digest/<r>`` records are in ``digests`` (None: none were read)."""
    digests: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    """Peer id -> the digest it published for ``digest_round``."""
    partners: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """``partners`` record values: the peers each averaged with lately."""
    stage_loads: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """A pipelined run's ``stage-load`` record values by owner: each stage peer's stage,
    endpoint (none: moving there), rate, queue and free slots."""
    vouched: frozenset[str] | None = None
    """The owners of those records whose servers vouched for them (a ping answered as the
    record's key: pipeline/load.py ``Vouching``); None: not asked, every record shown."""
    stage_status: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """A pipelined run's stage-0 ``status`` record values (its swarm's: the stage-0 peers
    read a pinned dataset and say its epoch there)."""
    error: str = ""
    """Why the poll failed ("" when it did not); the records are then from an earlier poll."""


# -- small, defensive helpers ------------------------------------------------------------------


def clean_text(value: Any, max_chars: int = 240) -> str:
    """``value`` as one line of printable text: control, format (bidi) and line-separator
    characters are dropped, so a peer's name cannot move a terminal's cursor or reorder a
    table."""
    if not isinstance(value, str):
        return ""
    kept = "".join(
        " " if ch in "\t\n\r" else ch
        for ch in value[: 4 * max_chars]
        if ch in "\t\n\r" or unicodedata.category(ch) not in _TEXT_DROP
    )
    return " ".join(kept.split())[:max_chars]


def _number(value: Any, *, low: float = -math.inf, high: float = math.inf) -> float | None:
    """A finite float in [low, high], or None (bools and non-numbers are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        return None
    return number


def _count(value: Any) -> int:
    """A non-negative integer, or 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _rate(value: Any) -> float:
    rate = _number(value, low=0.0, high=MAX_TOKENS_PER_S)
    return 0.0 if rate is None else rate


def _loss(value: Any) -> float | None:
    return _number(value, low=-MAX_ABS_LOSS, high=MAX_ABS_LOSS)


def _at(value: Mapping[str, Any]) -> float:
    return _number(value.get("at"), low=0.0) or 0.0


def age_of(value: Mapping[str, Any], now: float) -> float:
    """Seconds since the record was made; a record dated in the future is 0 s old."""
    return max(0.0, now - _at(value))


def is_fresh(value: Mapping[str, Any], now: float, fresh_s: float = FRESH_S) -> bool:
    """Whether a record was made recently (its peer online, or just gone)."""
    return age_of(value, now) <= fresh_s


def is_online(value: Mapping[str, Any], now: float, fresh_s: float = FRESH_S) -> bool:
    """Whether a status record shows its peer online: recent, and not its farewell (a peer
    that leaves says so, state ``left``)."""
    return value.get("state") != "left" and is_fresh(value, now, fresh_s)


def short_id(peer_id: str) -> str:
    return peer_id[:_SHORT_ID]


def current_round(
    status: Mapping[str, Mapping[str, Any]], *, now: float, fresh_s: float = FRESH_S
) -> int | None:
    """The swarm's round: the highest round of a peer heard from recently (online, or just
    left: the round a run ended at stays on the page), ignoring claims more than
    :data:`MAX_ROUND_LEAD` beyond the median (None when no record is fresh)."""
    rounds = [
        value["round"]
        for value in status.values()
        if is_fresh(value, now, fresh_s) and _is_round(value.get("round"))
    ]
    if not rounds:
        return None
    median = statistics.median_low(rounds)
    return max(r for r in rounds if r <= median + MAX_ROUND_LEAD)


def _is_round(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _round_to(value: float | None, digits: int) -> float | None:
    """Fewer digits in the JSON (the page draws pixels, not 17 significant digits)."""
    if value is None:
        return None
    return float(f"{value:.{digits}g}")


# -- whose records count ---------------------------------------------------------------------


def anchors_of(manifest: SwarmManifest | None, trust: Iterable[str] = ()) -> frozenset[str]:
    """The peers the dashboard trusts: ``trust`` (peer ids in hex) and the swarm's creator."""
    creator = creator_peer_id(manifest) if manifest is not None else ""
    return frozenset({*trust, creator} - {""})


@dataclasses.dataclass(frozen=True)
class Roster:
    """Whose records count in one reading (:func:`roster`)."""

    counted: frozenset[str]
    """Peers whose figures count (every peer with a record when not ``anchored``)."""
    vouched: frozenset[str]
    """The peers a trusted peer averaged with (they vouch for their own partners)."""
    anchors: frozenset[str]
    """The trusted peers that publish."""
    anchored: bool
    """Whether any trusted peer, or a peer one vouched for, publishes."""

    def only(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` (by peer id) of the peers that count (all of them when not
        ``anchored``)."""
        if not self.anchored:
            return dict(values)
        return {peer: value for peer, value in values.items() if peer in self.counted}


NOBODY = Roster(frozenset(), frozenset(), frozenset(), anchored=False)


def _named(value: Any) -> frozenset[str]:
    peers = value.get("peers") if isinstance(value, Mapping) else None
    if not isinstance(peers, list):
        return frozenset()
    return frozenset(p for p in peers if isinstance(p, str))


def roster(reading: Reading, *, anchors: frozenset[str], remembered: Iterable[str] = ()) -> Roster:
    """The peers whose records count: the ``anchors`` that publish, the peers an anchor
    names in its ``partners`` record and that name it back (and the ``remembered`` ones an
    anchor vouched for before, while they publish), and the peers those name and that name
    them back. Vouching stops there: one key that got into a real round adds at most
    :data:`~swarmloco.net.records.MAX_PARTNERS` keys of its own, never a chain.

    With no anchor publishing, every peer with a status record counts (``anchored``
    False: the view says so)."""
    names = {peer: _named(value) for peer, value in reading.partners.items()}
    publishing = set(reading.status) | set(reading.partners)

    def partners_of(peer: str) -> set[str]:
        return {other for other in names.get(peer, ()) if peer in names.get(other, ())}

    present = frozenset(anchors & publishing)
    vouched = {p for a in present for p in partners_of(a)} | (set(remembered) & publishing)
    vouched -= present
    if not present and not vouched:
        return dataclasses.replace(NOBODY, counted=frozenset(reading.status))
    second = {p for v in vouched for p in partners_of(v)}
    return Roster(
        counted=frozenset(present | vouched | second),
        vouched=frozenset(vouched),
        anchors=present,
        anchored=True,
    )


# -- history -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Curve:
    name: str
    points: collections.deque[tuple[float, float]]


class History:
    """Bounded memory of earlier readings: loss curves (per peer and for the swarm) and the
    round timeline beyond the last 8 rounds a status record carries.

    Curves are sampled on our clock (the time of the reading), not the peers', so a peer
    whose clock runs ahead cannot draw into the future. Points are added only when a peer
    published a new status record; each curve keeps at most ``points``, and at most
    ``peers`` peers (the most recently updated) keep a curve.
    """

    def __init__(
        self,
        *,
        points: int = HISTORY_POINTS,
        peers: int = MAX_TRACKED_PEERS,
        rounds: int = MAX_HISTORY_ROUNDS,
    ) -> None:
        if points < 1 or peers < 1 or rounds < 1:
            raise ValueError("history limits must be positive")
        self._points = points
        self._max_peers = peers
        self._max_rounds = rounds
        self._last_at: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.peer_loss: collections.OrderedDict[str, _Curve] = collections.OrderedDict()
        self.swarm_loss: collections.deque[tuple[float, float]] = collections.deque(maxlen=points)
        self.swarm_eval_loss: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=points
        )
        self.swarm_tokens_per_s: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=points
        )
        # round -> peer id -> the peer's summary of that round
        self.rounds: dict[int, dict[str, Mapping[str, Any]]] = {}
        # peers a trusted peer vouched for, while they publish (oldest first)
        self.remembered: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.roster = NOBODY
        """Whose records counted in the last reading."""
        # a pipelined run: each stage peer's stage as last read, and the moves seen
        self.stage_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.moves: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_MOVES_SHOWN)
        self.moves_seen = 0
        self.readings = 0
        """Readings taken in (a move is seen between two of them)."""

    def add(self, reading: Reading, *, fresh_s: float = FRESH_S, trust: Iterable[str] = ()) -> None:
        """Take in a reading (a failed poll's reading adds nothing); ``trust``: peer ids
        the dashboard trusts besides the swarm's creator."""
        if reading.error:
            return
        self.readings += 1
        self.roster = roster(
            reading, anchors=anchors_of(reading.manifest, trust), remembered=self.remembered
        )
        self._remember(reading)
        status = self.roster.only(reading.status)
        now = reading.at
        updated = False
        for peer_id, value in status.items():
            at = _at(value)
            if self._last_at.get(peer_id) == at:
                continue
            updated = True
            self._last_at[peer_id] = at
            self._last_at.move_to_end(peer_id)
            loss = _loss(value.get("loss"))
            if loss is not None:
                curve = self.peer_loss.get(peer_id)
                if curve is None:
                    curve = _Curve("", collections.deque(maxlen=self._points))
                    self.peer_loss[peer_id] = curve
                curve.name = clean_text(value.get("name"), 64)
                curve.points.append((now, loss))
                self.peer_loss.move_to_end(peer_id)
        while len(self.peer_loss) > self._max_peers:
            self.peer_loss.popitem(last=False)
        while len(self._last_at) > 4 * self._max_peers + len(status):
            self._last_at.popitem(last=False)
        online = [v for v in status.values() if is_online(v, now, fresh_s)]
        if updated and online:
            losses = [x for v in online if (x := _loss(v.get("loss"))) is not None]
            if losses:
                self.swarm_loss.append((now, statistics.median(losses)))
            evals = [x for v in online if (x := _loss(v.get("eval_loss"))) is not None]
            if evals:
                self.swarm_eval_loss.append((now, statistics.median(evals)))
            self.swarm_tokens_per_s.append(
                (now, math.fsum(_rate(v.get("tokens_per_s")) for v in online))
            )
        self._add_rounds(reading.at, status, fresh_s)
        self._add_stages(reading, fresh_s)

    def _add_stages(self, reading: Reading, fresh_s: float) -> None:
        """A stage peer whose fresh record (vouched for, when the reading asked) names
        another stage than before moved."""
        for peer_id, load in _fresh_loads(reading, fresh_s).items():
            if reading.vouched is not None and peer_id not in reading.vouched:
                continue
            stage = load["stage"]
            before = self.stage_of.get(peer_id)
            if before is not None and before != stage:
                self.moves_seen += 1
                self.moves.append(
                    {"peer": short_id(peer_id), "from": before, "to": stage, "at": reading.at}
                )
            self.stage_of[peer_id] = stage
            self.stage_of.move_to_end(peer_id)
        while len(self.stage_of) > MAX_REMEMBERED:
            self.stage_of.popitem(last=False)

    def _remember(self, reading: Reading) -> None:
        """Peers a trusted peer vouched for stay counted while they publish (groups
        change every round, and a trusted peer meets everyone in time)."""
        publishing = set(reading.status) | set(reading.partners)
        for peer in [p for p in self.remembered if p not in publishing]:
            del self.remembered[peer]
        for peer in self.roster.vouched:
            self.remembered[peer] = None
            self.remembered.move_to_end(peer)
        while len(self.remembered) > MAX_REMEMBERED:
            self.remembered.popitem(last=False)

    def _add_rounds(
        self, at: float, status: Mapping[str, Mapping[str, Any]], fresh_s: float
    ) -> None:
        latest = current_round(status, now=at, fresh_s=fresh_s)
        for peer_id, value in status.items():
            rounds = value.get("rounds")
            if not isinstance(rounds, list):
                continue
            for summary in rounds:
                if not isinstance(summary, Mapping) or not _is_round(summary.get("round")):
                    continue
                number = summary["round"]
                # A peer inventing far-future rounds must not push the real ones out.
                if latest is not None and number > latest + 1:
                    continue
                self.rounds.setdefault(number, {})[peer_id] = summary
        if len(self.rounds) > self._max_rounds:
            for number in sorted(self.rounds)[: len(self.rounds) - self._max_rounds]:
                del self.rounds[number]


# -- the view ----------------------------------------------------------------------------------


def build_view(
    reading: Reading,
    *,
    now: float,
    history: History | None = None,
    fresh_s: float = FRESH_S,
    trust: Iterable[str] = (),
) -> dict[str, Any]:
    """The dashboard's view of ``reading`` at ``now`` (JSON-able: no NaN, no infinities).

    ``history`` is what earlier readings left (it must already have taken ``reading``,
    and says whose records count); without one, the view holds only what this reading
    says, and ``trust`` names the peers trusted besides the swarm's creator.
    """
    if history is None:
        history = History()
        history.add(reading, fresh_s=fresh_s, trust=trust)
    warnings: list[str] = []
    counted = history.roster
    peers, apart = _counted_and_apart(reading, counted, now=now, fresh_s=fresh_s, warnings=warnings)
    round_now = current_round(counted.only(reading.status), now=now, fresh_s=fresh_s)
    warnings += _ahead_warnings(peers, round_now)
    online = [row for row in peers if row["online"]]
    swarm = _swarm(reading)
    timeline = _timeline(history)
    return {
        "version": VIEW_VERSION,
        "swarm": swarm,
        "now": now,
        "read_at": reading.at,
        "read_age_s": _round_to(max(0.0, now - reading.at), 3),
        "error": clean_text(reading.error, 500) or None,
        "fresh_s": fresh_s,
        "peers_online": len(online),
        "peers_known": len(peers),
        "peers_uncounted": len(apart),
        "trust": {
            "anchored": counted.anchored,
            "trusted_online": sorted(short_id(p) for p in counted.anchors),
            "vouched": len(counted.vouched),
        },
        "peers_listed": _roles(reading),
        **_swarm_figures(reading, counted, peers, round_now, now=now, fresh_s=fresh_s),
        "peers": peers[:MAX_PEERS_SHOWN],
        "peers_not_shown": max(0, len(peers) - MAX_PEERS_SHOWN),
        "uncounted": apart[:MAX_PEERS_SHOWN],
        "rounds": timeline,
        "progress": _progress(
            round_now, swarm["rounds_total"] if swarm["known"] else None, timeline
        ),
        "history": _curves(history),
        "pipeline": _pipeline(reading, history, fresh_s=fresh_s, warnings=warnings),
        "dataset": _dataset(
            {**counted.only(reading.status), **_stage_readers(reading)}, now=now, fresh_s=fresh_s
        ),
        "warnings": warnings[:MAX_WARNINGS],
    }


def _stage_readers(reading: Reading) -> dict[str, Mapping[str, Any]]:
    """A pipelined run's stage-0 status records that count: those of peers whose
    ``stage-load`` servers vouched for them (all, when vouching was not asked)."""
    if reading.vouched is None:
        return dict(reading.stage_status)
    return {p: v for p, v in reading.stage_status.items() if p in reading.vouched}


def _dataset(
    status: Mapping[str, Mapping[str, Any]], *, now: float, fresh_s: float
) -> dict[str, Any] | None:
    """A pinned dataset's epoch as the counted online peers know it: the newest epoch any
    reads, the most sequences and shards any knows landed in it (each knows a part: the
    best-informed is the closest), the shards they lease together. None: no dataset."""
    reports = [
        value["data"]
        for value in status.values()
        if isinstance(value.get("data"), Mapping) and is_online(value, now, fresh_s)
    ]
    if not reports:
        return None
    epoch = max(_count(r.get("epoch")) for r in reports)
    newest = [r for r in reports if _count(r.get("epoch")) == epoch]
    return {
        "epoch": epoch,
        "sequences": max(_count(r.get("sequences")) for r in newest),
        "landed": max(_count(r.get("landed")) for r in newest),
        "shards": max(_count(r.get("shards")) for r in newest),
        "done": max(_count(r.get("done")) for r in newest),
        "leased": sum(_count(r.get("leased")) for r in reports),
        "readers": len(reports),
    }


def _counted_and_apart(
    reading: Reading, counted: Roster, *, now: float, fresh_s: float, warnings: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The peer rows split into the counted peers, each with its share of their tokens,
    and the rest; ``warnings`` says when no trusted peer publishes and who is apart."""
    if not counted.anchored and reading.status:
        warnings.append(
            "no trusted peer publishes (the swarm's creator, --trust PEER_ID): the figures "
            "count every key's claims"
        )
    rows = _peer_rows(reading, now=now, fresh_s=fresh_s, warnings=warnings)
    peers = [row for row in rows if row["id"] in counted.counted]
    apart = [row for row in rows if row["id"] not in counted.counted]
    if apart:
        warnings.append(
            f"{len(apart)} peer(s) not counted: no trusted peer averaged with them (listed apart)"
        )
    total_tokens = sum(row["tokens"] for row in peers)
    for row in peers:
        row["share"] = _round_to(row["tokens"] / total_tokens, 4) if total_tokens else 0.0
    return peers, apart


def _ahead_warnings(peers: list[dict[str, Any]], round_now: int | None) -> list[str]:
    """A warning for each online peer that claims a round beyond the swarm's."""
    if round_now is None:
        return []
    return [
        f"peer {row['id'][:_SHORT_ID]} claims round {row['round']}, far ahead of the "
        "others: not counted as the swarm's round"
        for row in peers
        if row["online"] and row["round"] > round_now
    ]


def _roles(reading: Reading) -> dict[str, int]:
    """How many listed peers play each role (trainer, dashboard, ...)."""
    roles = collections.Counter(
        clean_text(value.get("role"), 16) or "unknown" for value in reading.peers.values()
    )
    return dict(sorted(roles.items()))


def _swarm_figures(
    reading: Reading,
    counted: Roster,
    peers: list[dict[str, Any]],
    round_now: int | None,
    *,
    now: float,
    fresh_s: float,
) -> dict[str, Any]:
    """The swarm's rate, tokens, round, next round, agreement and median losses, from the
    counted peers (rates and losses from the online ones)."""
    online = [row for row in peers if row["online"]]
    losses = [row["loss"] for row in online if row["loss"] is not None]
    evals = [row["eval_loss"] for row in online if row["eval_loss"] is not None]
    return {
        "tokens_per_s": _round_to(math.fsum(row["tokens_per_s"] for row in online), 6),
        "tokens": sum(row["tokens"] for row in peers),
        "round": round_now,
        "next_round": _next_round(
            counted.only(reading.progress), round_now, now=now, fresh_s=fresh_s
        ),
        "agreement": _agreement(reading.digest_round, counted.only(reading.digests), round_now),
        "loss": _round_to(_median(losses), 5),
        "eval_loss": _round_to(_median(evals), 5),
    }


def _swarm(reading: Reading) -> dict[str, Any]:
    manifest = reading.manifest
    if manifest is None:
        return {"id": reading.swarm_id, "known": False}
    model = manifest.model
    params = next(
        (
            int(model[key])
            for key in ("params", "parameters", "num_params", "n_params")
            if _count(model.get(key)) > 0
        ),
        None,
    )
    return {
        "id": reading.swarm_id,
        "known": True,
        "name": clean_text(manifest.name, 120),
        "task": clean_text(manifest.task, 64),
        "preset": clean_text(model.get("preset"), 32) or None,
        "params": params,
        "created_at": clean_text(manifest.created_at, 40),
        "rounds_total": _rounds_total(manifest.hparams),
    }


def stage_count(manifest: SwarmManifest | None) -> int | None:
    """The stages a pipelined run's manifest declares (None: not a pipelined run)."""
    declared = manifest.model.get("pipeline") if manifest is not None else None
    stages = declared.get("stages") if isinstance(declared, Mapping) else None
    return len(stages) if isinstance(stages, list) and len(stages) >= 2 else None


def _fresh_loads(reading: Reading, fresh_s: float) -> dict[str, dict[str, Any]]:
    """The ``stage-load`` records said within ``fresh_s`` of the reading, of stages the
    run has, their figures made safe to show (claims: rates beyond
    :data:`MAX_SEQUENCES_PER_S` count as 0)."""
    stages = stage_count(reading.manifest)
    if stages is None:
        return {}
    loads = {}
    for peer_id, value in reading.stage_loads.items():
        stage = _count(value.get("stage"))
        if not 0 <= stage < stages or not is_fresh(value, reading.at, fresh_s):
            continue
        endpoint = clean_text(value.get("endpoint"), 262)
        loads[peer_id] = {
            "stage": stage,
            "serving": bool(endpoint),
            "network": endpoint_network(endpoint) if endpoint else None,
            "rate": _number(value.get("rate"), low=0.0, high=MAX_SEQUENCES_PER_S) or 0.0,
            "queue": _count(value.get("queue")),
            "free": _count(value.get("free")),
            "round": _count(value["round"]) if "round" in value else None,
            "skipped": _count(value.get("skipped")),
            "refused": _count(value.get("refused")),
            "distrusted": _count(value.get("distrusted")),
            "drivers": _count(value.get("drivers")),
            "orphaned": _count(value.get("orphaned")),
        }
    return loads


def _counted_per_network(serving: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most :data:`STAGE_RECORDS_PER_NETWORK` of a stage's serving records per source
    network (as a driver draws from them), the first by peer id: many keys on one machine
    do not fill a pool."""
    taken: collections.Counter[str] = collections.Counter()
    kept = []
    for load in serving:
        if taken[load["network"]] < STAGE_RECORDS_PER_NETWORK:
            taken[load["network"]] += 1
            kept.append(load)
    return kept


def _pipeline(
    reading: Reading, history: History, *, fresh_s: float, warnings: list[str]
) -> dict[str, Any] | None:
    """A pipelined run's stages as a row of pools (None: not a pipelined run): each
    stage's peers (serving, and moving in), throughput (sequences per second, the sum of
    its replicas' rates), queue and free slots, its round, the calls its replicas refused
    and the steps they skipped, the replicas its drivers' audits distrust (stage 0), the
    drivers' sessions and the micro-batches of drivers gone (later stages), which
    stage limits the pipeline, and the moves seen (None before a second reading: one
    reading, as `swarmloco status` takes, sees no move). All
    of it is what the stage peers' records claim, of the records whose servers vouched for
    them when the reading asked (``Reading.vouched``)."""
    stages = stage_count(reading.manifest)
    if stages is None:
        return None
    pools: list[list[dict[str, Any]]] = [[] for _ in range(stages)]
    unvouched = 0
    for peer_id, load in sorted(_fresh_loads(reading, fresh_s).items()):
        if reading.vouched is not None and peer_id not in reading.vouched:
            unvouched += 1
            continue
        pools[load["stage"]].append(load)
    if unvouched:
        warnings.append(
            f"{unvouched} stage-load record(s) not counted: no server at their address "
            "answered as their key (yet)"
        )
    rows = []
    uncounted = 0
    for k, pool in enumerate(pools):
        said = [x for x in pool if x["serving"]]
        serving = _counted_per_network(said)
        uncounted += len(said) - len(serving)
        rows.append(
            {
                "stage": k,
                "peers": len(serving),
                "moving_in": len(pool) - len(said),  # (those not counted are not moving)
                "throughput": _round_to(math.fsum(x["rate"] for x in serving), 3),
                "queue": sum(x["queue"] for x in serving),
                "free": sum(x["free"] for x in serving),
                # Each stage averages in rounds of its own: the latest its peers say.
                "round": max((x["round"] for x in pool if x["round"] is not None), default=None),
                # Bad input its replicas refused, steps they skipped (NaN): since each began.
                "refused": sum(x["refused"] for x in serving),
                "skipped": sum(x["skipped"] for x in serving),
                # (Stage 0.) The most replicas any of its drivers' audits distrust now.
                "distrusted": max((x["distrusted"] for x in serving), default=0),
                # (Later stages.) Drivers' sessions open with its replicas now (a driver
                # counts at each replica it uses), and the micro-batches of drivers gone
                # (died or left) its replicas dropped or did not take, since each began.
                "drivers": sum(x["drivers"] for x in serving),
                "orphaned": sum(x["orphaned"] for x in serving),
            }
        )
    if uncounted:
        warnings.append(
            f"{uncounted} stage-load record(s) not counted: more than "
            f"{STAGE_RECORDS_PER_NETWORK} of one network at one stage"
        )
    empty = [row["stage"] for row in rows if not row["peers"]]
    for k in empty:
        warnings.append(f"stage {k} has no peer: the pipeline stalls until one joins or moves in")
    served = [row for row in rows if row["peers"]]
    limiting = None if empty or not served else min(served, key=lambda r: r["throughput"])["stage"]
    return {
        "stages": rows,
        # The run's peers are its stages' (the run's own swarm has none: each stage
        # averages in a swarm of its own).
        "peers": sum(row["peers"] for row in rows),
        "limiting": empty[0] if empty else limiting,
        "throughput": None if empty else min(row["throughput"] for row in rows),
        "moves": history.moves_seen if history.readings > 1 else None,
        "recent_moves": list(history.moves)[-5:],
    }


def _rounds_total(hparams: Mapping[str, Any]) -> int | None:
    """The run's last round: its total inner steps over the steps per round (H / F), from
    the manifest's run spec as plain data (the dashboard loads no torch); None: no end."""
    run = hparams.get("run")
    if not isinstance(run, Mapping):
        return None
    total, h = _count(run.get("total_steps")), _count(run.get("sync_every"))
    fragments = _count(run.get("fragments")) or 1
    if not total or not h:
        return None
    return math.ceil(total * fragments / h)


def _progress(
    round_now: int | None, rounds_total: int | None, timeline: list[dict[str, Any]]
) -> dict[str, Any]:
    """Where the run is: round r of R, the time between rounds (the medians of the last
    ten intervals) beside the averaging time of a round, and the time to the run's end."""
    recent = timeline[-11:]
    ats = [r["at"] for r in recent if r.get("at")]
    intervals = [b - a for a, b in itertools.pairwise(ats) if b > a]
    every = _median(intervals)
    averaging = _median([r["seconds"] for r in recent if r.get("seconds") is not None])
    left = None
    if round_now is not None and rounds_total is not None and every is not None:
        left = max(0, rounds_total - round_now) * every
    return {
        "round": round_now,
        "of": rounds_total,
        "round_every_s": _round_to(every, 4),
        "averaging_s": _round_to(averaging, 4),
        "eta_s": round(left) if left is not None else None,
    }


def _peer_rows(
    reading: Reading, *, now: float, fresh_s: float, warnings: list[str]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for peer_id, value in reading.status.items():
        at = _at(value)
        if at > now + CLOCK_AHEAD_S:
            warnings.append(
                f"peer {short_id(peer_id)}: its clock runs {at - now:.0f} s ahead of ours"
            )
        claimed = _number(value.get("tokens_per_s"), low=0.0)
        if claimed is not None and claimed > MAX_TOKENS_PER_S:
            warnings.append(f"peer {short_id(peer_id)} claims {claimed:.3g} tokens/s: not counted")
        started = _number(value.get("started_at"), low=0.0)
        listing = reading.peers.get(peer_id, {})
        progress = reading.progress.get(peer_id)
        fresh = is_online(value, now, fresh_s)
        rows.append(
            {
                "id": peer_id,
                "short_id": short_id(peer_id),
                "name": clean_text(value.get("name"), 64),
                "state": clean_text(value.get("state"), 16) or "unknown",
                "online": fresh,
                "age_s": _round_to(age_of(value, now), 3),
                "round": _count(value.get("round")),
                "step": _count(value.get("step")),
                "tokens": _count(value.get("tokens")),
                "tokens_per_s": _round_to(_rate(value.get("tokens_per_s")), 6) if fresh else 0.0,
                "share": 0.0,  # of the counted peers' tokens: build_view sets it
                "device": clean_text(value.get("device"), 64),
                "fit": clean_text(value.get("fit"), 64),
                "mfu": _round_to(_number(value.get("mfu"), low=0.0, high=1.0), 4)
                if fresh
                else None,
                "uptime_s": _round_to(max(0.0, now - started), 6) if started is not None else None,
                "last_error": clean_text(value.get("last_error"), 240),
                "version": clean_text(value.get("version"), 32),
                "loss": _round_to(_loss(value.get("loss")), 5),
                "eval_loss": _round_to(_loss(value.get("eval_loss")), 5),
                "rounds_applied": _count(value.get("rounds_applied")),
                "rounds_aborted": _count(value.get("rounds_aborted")),
                "downloads": _count(value.get("downloads")),
                "tokens_since_round": _count(progress.get("tokens"))
                if isinstance(progress, Mapping)
                else None,
                "endpoint": clean_text(listing.get("endpoint"), 262),
                "public": listing.get("public") is True,
            }
        )
    rows.sort(key=lambda row: (not row["online"], row["name"].lower(), row["id"]))
    return rows


def _next_round(
    progress: Mapping[str, Mapping[str, Any]],
    round_now: int | None,
    *,
    now: float,
    fresh_s: float,
) -> dict[str, Any] | None:
    """The online peers' work towards the next round, from their progress records."""
    if round_now is None:
        return None
    target = round_now + 1
    working = [
        value
        for value in progress.values()
        if value.get("round") == target and is_fresh(value, now, fresh_s)
    ]
    return {
        "round": target,
        "peers": len(working),
        "tokens": sum(_count(value.get("tokens")) for value in working),
        "tokens_per_s": _round_to(math.fsum(_rate(v.get("tokens_per_s")) for v in working), 6),
    }


def _agreement(
    digest_round: int | None, digests: Mapping[str, bytes], round_now: int | None
) -> dict[str, Any] | None:
    """How many of the peers that published a digest for the round agree on the majority."""
    if digest_round is None:
        return None
    found = majority(digests)
    return {
        "round": digest_round,
        "current": digest_round == round_now,
        "published": found.published,
        "holders": len(found.holders),
        "share": _round_to(found.share, 4),
        "digest": found.digest.hex()[:16] if found.digest is not None else None,
    }


def _timeline(history: History) -> list[dict[str, Any]]:
    """Per round, the figures of the peers that reported it (medians, so one peer's absurd
    figures do not move them)."""
    timeline = []
    for number in sorted(history.rounds)[-MAX_TIMELINE_ROUNDS:]:
        summaries = list(history.rounds[number].values())
        ok = [s for s in summaries if s.get("ok") is True]
        basis = ok or summaries
        groups = [_count(s.get("group")) for s in ok]
        seconds = [x for s in basis if (x := _number(s.get("seconds"), low=0.0)) is not None]
        matchmaking = [x for s in ok if (x := _number(s.get("matchmaking_s"), low=0.0)) is not None]
        sent = [_count(s.get("bytes_sent")) for s in basis]
        received = [_count(s.get("bytes_received")) for s in basis]
        payload = [_count(s.get("payload_bytes")) for s in basis]
        ats = [_at(s) for s in basis]
        median_sent = statistics.median_low(sent) if sent else 0
        median_payload = statistics.median_low(payload) if payload else 0
        timeline.append(
            {
                "round": number,
                "reported": len(summaries),
                "ok": len(ok),
                "failures": len(summaries) - len(ok),
                "group": statistics.median_high(groups) if groups else 0,
                "seconds": _round_to(_median(seconds), 4),
                "matchmaking_s": _round_to(_median(matchmaking), 4) if matchmaking else None,
                "bytes_sent": median_sent,
                "bytes_received": statistics.median_low(received) if received else 0,
                "bytes_sent_total": sum(sent) if ok else 0,
                "payload_bytes": median_payload,
                "compression": _round_to(median_payload / median_sent, 4) if median_sent else None,
                "at": statistics.median_low(ats) if ats else None,
            }
        )
    return timeline


def _points(points: Iterable[tuple[float, float]]) -> list[list[float]]:
    return [[round(t, 1), _round_to(v, 5) or 0.0] for t, v in points]


def _curves(history: History) -> dict[str, Any]:
    return {
        "swarm_loss": _points(history.swarm_loss),
        "swarm_eval_loss": _points(history.swarm_eval_loss),
        "swarm_tokens_per_s": _points(history.swarm_tokens_per_s),
        "peer_loss": [
            {"id": peer_id, "name": curve.name, "points": _points(curve.points)}
            for peer_id, curve in history.peer_loss.items()
        ],
    }
