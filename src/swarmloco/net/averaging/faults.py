"""The fault-injection seam of averaging: scripted faults per (peer, round, phase).

A :class:`FaultPlan` is handed to the :class:`~swarmloco.net.averaging.allreduce.Averager`
and the :class:`~swarmloco.net.averaging.matchmaking.Matchmaker` of the peer that should
misbehave (the default is no plan: the hooks cost one ``is None`` check). The averaging
transport calls the plan on the real code path, where messages leave the peer and where
its stream handlers process them, so a fault is exactly what a remote peer would see from
a broken or hostile peer:

* ``drop``: the message is not sent (the stream stays open);
* ``delay``: the message is sent ``seconds`` late;
* ``cut``: the stream is torn down once more than ``after_bytes`` went out on it;
* ``corrupt``: the message is altered (``nan`` scales, ``huge`` finite scales whose
  values overflow float32 when decoded, ``amplify``: float32 scales x1000, ``spike``: a
  part's first result chunk alone under float32 scales x20, ``flat``: every
  value +1 under scales of 1e4, ``negate``: every value reversed (the same norm),
  ``truncate``d payload, ``stale-round``, shifted ``index``: of a chunk, a result or an
  audit's ``segment`` (its hashes kept); for ``done`` and ``verdict``
  messages, a ``bloat``ed digest of 1 MiB, or a ``forge``d one: the right length, other
  bytes). A peer signs what it forges, as a liar would: a forged ``done`` is signed anew,
  a chunk it altered carries its statement of the altered bytes, and the seal of a part
  whose results to a member were altered seals what that member was sent (see
  :class:`~.traffic.Traffic`);
* ``replay``: the message this peer sent at the same point of an earlier round goes out
  instead (an old chunk replayed into a new round);
* ``stall``: the sending task, or the serving handler (phase ``handler``), blocks for
  ``seconds`` (0: until the round is cancelled) while the process and its sockets stay up;
* ``spin``: a pure-Python busy loop of ``seconds`` on the event loop's thread, holding the
  GIL: the whole process stops answering (heartbeats and every other stream included)
  while its sockets stay open, as a handler or extension that never yields would make it.

Phases: ``join`` (the matchmaking request), ``hello``, ``chunk``, ``done``, ``heartbeat``,
``audit``, ``segment``, ``proof`` (what a member sends on its streams), ``result``, ``seal``,
``rerun``, ``verdict``, ``statements``, ``fetch`` (what a serving member sends back) and
``handler`` (every message a serving handler reads or writes).
Tests read :attr:`FaultPlan.fired` to assert that the fault they scripted really fired.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
import time
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import torch

from swarmloco.core.config import require, require_int, require_non_negative
from swarmloco.errors import NetworkError
from swarmloco.net.averaging import wire
from swarmloco.proto.v1 import averaging_pb2 as pb

Action = Literal["drop", "delay", "cut", "corrupt", "replay", "stall", "spin"]
Phase = Literal[
    "join",
    "hello",
    "chunk",
    "done",
    "heartbeat",
    "result",
    "seal",
    "rerun",
    "verdict",
    "handler",
    "audit",
    "statements",
    "fetch",
    "segment",
    "proof",
]
Corruption = Literal[
    "nan",
    "huge",
    "amplify",
    "spike",
    "flat",
    "negate",
    "truncate",
    "stale-round",
    "index",
    "bloat",
    "forge",
]
_ACTIONS = get_args(Action)
_PHASES = get_args(Phase)
_CORRUPTIONS = get_args(Corruption)


class FaultCut(NetworkError):
    """Raised by the plan to tear the current call down (a ``cut`` fault)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One scripted fault: what to do to which messages."""

    action: Action
    phase: Phase
    peer: str | None = None
    """Hex peer id of the remote end; for ``join``, the leader's HOST:PORT (None: any)."""
    round: int | None = None
    """Round it applies to (None: every round)."""
    skip: int = 0
    """Let this many matching messages through before the fault fires."""
    times: int | None = None
    """Fire at most this many times (None: on every matching message after ``skip``)."""
    seconds: float = 0.0
    """``delay``, ``spin``: how long; ``stall``: how long (0: until cancelled)."""
    after_bytes: int = 0
    """``cut``: tear the call down once more than this many bytes went out on it."""
    corruption: Corruption = "nan"
    """``corrupt``: what to do to a chunk, result, segment or proof message."""

    def __post_init__(self) -> None:
        require(self.action in _ACTIONS, f"action must be one of {_ACTIONS}, got {self.action!r}")
        require(self.phase in _PHASES, f"phase must be one of {_PHASES}, got {self.phase!r}")
        require(
            self.corruption in _CORRUPTIONS,
            f"corruption must be one of {_CORRUPTIONS}, got {self.corruption!r}",
        )
        require_int("skip", self.skip, minimum=0)
        if self.times is not None:
            require_int("times", self.times, minimum=1)
        require_non_negative("seconds", self.seconds)
        require_int("after_bytes", self.after_bytes, minimum=0)
        if self.action == "corrupt":
            digests = self.corruption in ("bloat", "forge")
            phases: tuple[str, ...] = (
                ("done", "verdict") if digests else ("chunk", "result", "segment", "proof")
            )
            if self.corruption == "spike":
                phases = ("result",)
            require(
                self.phase in phases,
                f"a {self.corruption} corruption applies to {' and '.join(phases)} messages",
            )
        require(self.action != "spin" or self.seconds > 0, "a spin needs seconds > 0")


OnFire = Callable[[int, Fault, str, int], None]
ForgeDone = Callable[[pb.MemberDone], pb.MemberDone]
"""Another announcement of the same number, signed as the peer the plan runs in."""


class FaultPlan:
    """A script of faults; ``fired[i]`` counts how often fault ``i`` fired."""

    def __init__(self, faults: Sequence[Fault], *, on_fire: OnFire | None = None) -> None:
        self.faults = list(faults)
        self.fired = [0] * len(self.faults)
        self._seen = [0] * len(self.faults)
        self._on_fire = on_fire
        self._records: dict[tuple[str, int], bytes] = {}
        self._record_rounds: dict[str, int] = {}
        self._recording = any(f.action == "replay" for f in self.faults)

    def _matches(self, phase: str, peer: str, round: int) -> list[int]:
        hits = []
        for i, fault in enumerate(self.faults):
            if fault.phase != phase or (fault.peer is not None and fault.peer != peer):
                continue
            if fault.round is not None and fault.round != round:
                continue
            self._seen[i] += 1
            if self._seen[i] <= fault.skip:
                continue
            if fault.times is not None and self.fired[i] >= fault.times:
                continue
            hits.append(i)
        return hits

    def _fire(self, i: int, peer: str, round: int) -> Fault:
        self.fired[i] += 1
        fault = self.faults[i]
        if self._on_fire is not None:
            self._on_fire(i, fault, peer, round)
        return fault

    async def outgoing(
        self,
        phase: Phase,
        *,
        peer: str,
        round: int,
        message: bytes,
        call_bytes: int = 0,
        forge_done: ForgeDone | None = None,
    ) -> bytes | None:
        """The message to send instead of ``message`` (None: drop it); may wait or raise
        :class:`FaultCut`. ``call_bytes``: bytes already sent on this call; ``forge_done``:
        forges an announcement as this peer would sign it (without it, a forged one keeps
        the signature of the true one)."""
        if self._recording and phase == "chunk":
            self._record(peer, round, message)
        for i in self._matches(phase, peer, round):
            fault = self.faults[i]
            if fault.action == "replay":
                old = self._replayed(peer, round)
                if old is None:
                    continue  # nothing from an earlier round to replay yet
                self._fire(i, peer, round)
                message = old
                continue
            if fault.action == "cut" and call_bytes + len(message) <= fault.after_bytes:
                continue
            self._fire(i, peer, round)
            if fault.action == "drop":
                return None
            if fault.action == "delay":
                await asyncio.sleep(fault.seconds)
            elif fault.action == "stall":
                await _stall(fault.seconds)
            elif fault.action == "spin":
                _spin(fault.seconds)
            elif fault.action == "cut":
                raise FaultCut(f"fault plan cut the call to {peer[:12]} ({phase})")
            elif fault.action == "corrupt":
                message = corrupt(phase, message, fault.corruption, forge_done)
        return message

    async def handler(self, *, peer: str, round: int) -> None:
        """The stall point of a serving handler (phase ``handler``)."""
        for i in self._matches("handler", peer, round):
            fault = self._fire(i, peer, round)
            if fault.action == "stall":
                await _stall(fault.seconds)
            elif fault.action == "spin":
                _spin(fault.seconds)
            elif fault.action == "delay":
                await asyncio.sleep(fault.seconds)

    # Replays: keep the first chunk sent to each peer per round (only when a replay fault
    # exists), and serve the one of the latest earlier round.
    def _record(self, peer: str, round: int, message: bytes) -> None:
        if (peer, round) not in self._records:
            self._records[(peer, round)] = message

    def _replayed(self, peer: str, round: int) -> bytes | None:
        earlier = [r for (p, r) in self._records if p == peer and r < round]
        return self._records[(peer, max(earlier))] if earlier else None


async def _stall(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)
    else:
        await asyncio.Event().wait()  # until the round cancels us


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # pure Python: the GIL is held, the event loop blocked
        pass


def corrupt(
    phase: str, message: bytes, how: Corruption, forge_done: ForgeDone | None = None
) -> bytes:
    """``message`` (a chunk request or a result response) altered as ``how`` says; a done
    or verdict message ``bloat``ed (its digest 1 MiB long) or ``forge``d (its bytes
    flipped; a done forged and signed by ``forge_done`` when given)."""
    if how in ("bloat", "forge"):
        if phase == "done":
            done = pb.AggregateRequest.FromString(message).done
            if how == "bloat":
                done.digest = bytes(1 << 20)
            elif forge_done is not None:
                done = forge_done(done)
            else:
                done.digest = bytes(b ^ 0xFF for b in done.digest)
            return wire.request(done=done)
        response = wire.decode_response(message)
        assert not isinstance(response, wire.ResultMessage)
        if response.HasField("verdict"):  # (a refusal goes out in this phase too)
            old = response.verdict.digest
            response.verdict.digest = (
                bytes(1 << 20) if how == "bloat" else bytes(b ^ 0xFF for b in old)
            )
        return response.SerializeToString()
    if phase == "segment":  # an audit's answer: its bytes altered, its hashes kept
        request = pb.AggregateRequest.FromString(message)
        _corrupt_segment(request.segment, how)
        return request.SerializeToString()
    if phase == "proof":  # an audit's proof, either way: its first segment altered
        shown: pb.AggregateRequest | pb.AggregateResponse = pb.AggregateRequest.FromString(message)
        if not shown.HasField("proof"):
            shown = pb.AggregateResponse.FromString(message)
        for segment in shown.proof.segments[:1]:
            _corrupt_segment(segment, how)
        return shown.SerializeToString()
    if phase == "chunk":
        chunk = wire.decode_request(message)
        assert isinstance(chunk, wire.ChunkMessage), "only chunk messages are corrupted"
        payload = wire.tensor_from(chunk.payload, torch.int8)
        scales = wire.tensor_from(chunk.scales, torch.uint8)
        round, index = chunk.round, chunk.index
        if how == "stale-round":
            round = max(0, round - 1)
        elif how == "index":
            index += 1
        payload, scales = _corrupt_tensors(payload, scales, how)
        return wire.encode_chunk(
            group_id=chunk.group_id,
            round=round,
            part=chunk.part,
            epoch=chunk.epoch,
            index=index,
            payload=payload,
            scales=scales,
        )
    result = wire.decode_response(message)
    assert isinstance(result, wire.ResultMessage), "only result messages are corrupted"
    if how == "spike" and result.index != 0:
        return message
    payload = wire.tensor_from(result.payload, torch.int8)
    scales = wire.tensor_from(result.scales, torch.uint8)
    payload, scales = _corrupt_tensors(payload, scales, how)
    return wire.encode_result(
        part=result.part,
        epoch=result.epoch,
        index=result.index + (1 if how == "index" else 0),
        payload=payload,
        scales=scales,
        contributors=result.contributors,
    )


def _corrupt_segment(segment: pb.Segment, how: Corruption) -> None:
    """Alter an audited segment's bytes in place (its hashes kept)."""
    payload = torch.frombuffer(bytearray(segment.payload), dtype=torch.int8)
    scales = torch.frombuffer(bytearray(segment.scales), dtype=torch.uint8)
    payload, scales = _corrupt_tensors(payload, scales, how)
    segment.payload = payload.numpy().tobytes()
    segment.scales = scales.numpy().tobytes()


def _corrupt_tensors(
    payload: torch.Tensor, scales: torch.Tensor, how: Corruption
) -> tuple[torch.Tensor, torch.Tensor]:
    if how in ("nan", "huge"):
        value = math.nan if how == "nan" else 3e38  # 127 * 3e38 is Inf in float32
        word = struct.pack("<f", value) if scales.numel() % 4 == 0 else b"\x00\x7e"
        raw = word * (scales.numel() // len(word))
        return payload, torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if how == "amplify":  # float32 scales: the same values, a thousand times larger
        return payload, (scales.clone().view(torch.float32) * 1000).view(torch.uint8)
    if how == "spike":  # float32 scales: the same values, twenty times larger
        return payload, (scales.clone().view(torch.float32) * 20).view(torch.uint8)
    if how == "flat":  # +1 everywhere under large scales (float32, or float16's 1e4)
        word = struct.pack("<f", 1e4) if scales.numel() % 4 == 0 else struct.pack("<e", 1e4)
        raw = word * (scales.numel() // len(word))
        flat = torch.ones_like(payload)
        return flat, torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if how == "negate":  # every value reversed: the same norm, the other way
        return (-payload.clamp(min=-127)).to(torch.int8), scales
    if how == "truncate":
        return payload[: payload.numel() // 2].clone(), scales
    return payload, scales
