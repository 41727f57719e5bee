"""Averaging: leader-based matchmaking and the streamed int8 butterfly all-reduce.

Imports torch (the codec), so only the training daemon imports this package; the
bootstrap node and the dashboard never do.

- ``group``: signed member declarations, forming and checking a group (pure);
- ``matchmaking``: :class:`Matchmaker`, the ``round/<r>`` DHT entries and the Join RPC,
  composed of ``announcing`` (this peer's entries and their marks), ``candidates`` (whom
  to follow: pure), ``following`` (the calls to leaders), ``leading`` (a leader's
  gathering) and ``peerlist`` (the swarm's announced peers);
- ``reduction``: :class:`PartReduction`, the reducer of one part (pure);
- ``view``: :class:`RoundView`, one member's view of a round: failover, digest, report
  (pure);
- ``wire``: the bytes of the Aggregate stream (copy-free encoding of the hot messages);
- ``allreduce``: :class:`Averager` (the public API, the protocol in its docstring) and
  :class:`AveragingConfig`;
- ``round``: one member's side of one round, the driver that composes the round's parts:
  ``contribution`` (our update, quantized once: the sender side), ``reducing`` (the parts
  we reduce: the reducer side), ``output`` (results decoded into the mean), ``liveness``
  (per-member deadlines), ``verdicts`` (digests and verdicts: whether to apply),
  ``outgoing`` and ``incoming`` (the streams each way) and ``traffic`` (their bytes);
- ``streams``: the two ends of an Aggregate stream (reader and writer tasks);
- ``report``: :class:`AllReduceResult` and :class:`AllReduceReport`;
- ``limiter``: :class:`BandwidthLimiter`, token buckets for upload and download;
- ``faults``: :class:`FaultPlan`, the fault-injection seam (drop, delay, cut, corrupt,
  replay, stall per peer, round and phase);
- ``service``: :func:`averaging_service`, the gRPC service to register on the server.
"""

from swarmloco.net.averaging.allreduce import Averager, AveragingConfig
from swarmloco.net.averaging.faults import Fault, FaultPlan
from swarmloco.net.averaging.group import Group, Member
from swarmloco.net.averaging.limiter import BandwidthConfig, BandwidthLimiter
from swarmloco.net.averaging.matchmaking import Matchmaker, MatchmakingConfig
from swarmloco.net.averaging.report import AllReduceReport, AllReduceResult, PartReport
from swarmloco.net.averaging.service import averaging_service

__all__ = [
    "AllReduceReport",
    "AllReduceResult",
    "Averager",
    "AveragingConfig",
    "BandwidthConfig",
    "BandwidthLimiter",
    "Fault",
    "FaultPlan",
    "Group",
    "Matchmaker",
    "MatchmakingConfig",
    "Member",
    "PartReport",
    "averaging_service",
]
