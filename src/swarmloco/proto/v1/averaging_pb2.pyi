from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberDeclaration(_message.Message):
    __slots__ = ("public_key", "endpoint", "weight", "bandwidth", "swarm_id", "round", "numel", "block_size", "timestamp_ms", "signature", "norm", "membership", "ranges")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    endpoint: str
    weight: float
    bandwidth: float
    swarm_id: str
    round: int
    numel: int
    block_size: int
    timestamp_ms: int
    signature: bytes
    norm: float
    membership: bytes
    ranges: _containers.RepeatedCompositeFieldContainer[SequenceRange]
    def __init__(self, public_key: _Optional[bytes] = ..., endpoint: _Optional[str] = ..., weight: _Optional[float] = ..., bandwidth: _Optional[float] = ..., swarm_id: _Optional[str] = ..., round: _Optional[int] = ..., numel: _Optional[int] = ..., block_size: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., signature: _Optional[bytes] = ..., norm: _Optional[float] = ..., membership: _Optional[bytes] = ..., ranges: _Optional[_Iterable[_Union[SequenceRange, _Mapping]]] = ...) -> None: ...

class SequenceRange(_message.Message):
    __slots__ = ("epoch", "shard", "first", "count")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    shard: int
    first: int
    count: int
    def __init__(self, epoch: _Optional[int] = ..., shard: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: MemberDeclaration
    def __init__(self, member: _Optional[_Union[MemberDeclaration, _Mapping]] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("group_id", "round", "members", "part_first_block", "part_blocks", "nonce")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PART_FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PART_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    round: int
    members: _containers.RepeatedCompositeFieldContainer[MemberDeclaration]
    part_first_block: _containers.RepeatedScalarFieldContainer[int]
    part_blocks: _containers.RepeatedScalarFieldContainer[int]
    nonce: bytes
    def __init__(self, group_id: _Optional[bytes] = ..., round: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberDeclaration, _Mapping]]] = ..., part_first_block: _Optional[_Iterable[int]] = ..., part_blocks: _Optional[_Iterable[int]] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("group", "refused", "redirect")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    group: GroupInfo
    refused: Refusal
    redirect: str
    def __init__(self, group: _Optional[_Union[GroupInfo, _Mapping]] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ..., redirect: _Optional[str] = ...) -> None: ...

class StreamHello(_message.Message):
    __slots__ = ("group_id", "round", "sender", "reducer", "signature")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    REDUCER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    round: int
    sender: int
    reducer: int
    signature: bytes
    def __init__(self, group_id: _Optional[bytes] = ..., round: _Optional[int] = ..., sender: _Optional[int] = ..., reducer: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PartChunk(_message.Message):
    __slots__ = ("group_id", "round", "part", "epoch", "index", "payload", "scales", "signature", "norms")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NORMS_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    round: int
    part: int
    epoch: int
    index: int
    payload: bytes
    scales: bytes
    signature: bytes
    norms: bytes
    def __init__(self, group_id: _Optional[bytes] = ..., round: _Optional[int] = ..., part: _Optional[int] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., norms: _Optional[bytes] = ...) -> None: ...

class Statement(_message.Message):
    __slots__ = ("sender", "index", "root", "signature", "norms")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NORMS_FIELD_NUMBER: _ClassVar[int]
    sender: int
    index: int
    root: bytes
    signature: bytes
    norms: bytes
    def __init__(self, sender: _Optional[int] = ..., index: _Optional[int] = ..., root: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., norms: _Optional[bytes] = ...) -> None: ...

class Audit(_message.Message):
    __slots__ = ("part", "epoch")
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    part: int
    epoch: int
    def __init__(self, part: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Statements(_message.Message):
    __slots__ = ("part", "epoch", "statements", "signature")
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATEMENTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    part: int
    epoch: int
    statements: _containers.RepeatedCompositeFieldContainer[Statement]
    signature: bytes
    def __init__(self, part: _Optional[int] = ..., epoch: _Optional[int] = ..., statements: _Optional[_Iterable[_Union[Statement, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Proof(_message.Message):
    __slots__ = ("part", "epoch", "reducer", "index", "segment", "statements", "segments", "senders", "result")
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REDUCER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    STATEMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SENDERS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    part: int
    epoch: int
    reducer: int
    index: int
    segment: int
    statements: Statements
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    senders: _containers.RepeatedScalarFieldContainer[int]
    result: bytes
    def __init__(self, part: _Optional[int] = ..., epoch: _Optional[int] = ..., reducer: _Optional[int] = ..., index: _Optional[int] = ..., segment: _Optional[int] = ..., statements: _Optional[_Union[Statements, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., senders: _Optional[_Iterable[int]] = ..., result: _Optional[bytes] = ...) -> None: ...

class Fetch(_message.Message):
    __slots__ = ("reducer", "part", "epoch", "index", "segment")
    REDUCER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    reducer: int
    part: int
    epoch: int
    index: int
    segment: int
    def __init__(self, reducer: _Optional[int] = ..., part: _Optional[int] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., segment: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("reducer", "part", "epoch", "index", "segment", "payload", "scales", "hashes")
    REDUCER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    reducer: int
    part: int
    epoch: int
    index: int
    segment: int
    payload: bytes
    scales: bytes
    hashes: bytes
    def __init__(self, reducer: _Optional[int] = ..., part: _Optional[int] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., segment: _Optional[int] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class MemberDone(_message.Message):
    __slots__ = ("digest", "seq", "signature", "seals")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    seq: int
    signature: bytes
    seals: _containers.RepeatedCompositeFieldContainer[Seal]
    def __init__(self, digest: _Optional[bytes] = ..., seq: _Optional[int] = ..., signature: _Optional[bytes] = ..., seals: _Optional[_Iterable[_Union[Seal, _Mapping]]] = ...) -> None: ...

class Announced(_message.Message):
    __slots__ = ("member", "done")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    member: int
    done: MemberDone
    def __init__(self, member: _Optional[int] = ..., done: _Optional[_Union[MemberDone, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AggregateRequest(_message.Message):
    __slots__ = ("hello", "chunk", "done", "heartbeat", "audit", "segment", "proof")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    hello: StreamHello
    chunk: PartChunk
    done: MemberDone
    heartbeat: Heartbeat
    audit: Audit
    segment: Segment
    proof: Proof
    def __init__(self, hello: _Optional[_Union[StreamHello, _Mapping]] = ..., chunk: _Optional[_Union[PartChunk, _Mapping]] = ..., done: _Optional[_Union[MemberDone, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., audit: _Optional[_Union[Audit, _Mapping]] = ..., segment: _Optional[_Union[Segment, _Mapping]] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("part", "epoch", "index", "payload", "scales", "contributors")
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    part: int
    epoch: int
    index: int
    payload: bytes
    scales: bytes
    contributors: bytes
    def __init__(self, part: _Optional[int] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., contributors: _Optional[bytes] = ...) -> None: ...

class Seal(_message.Message):
    __slots__ = ("part", "epoch", "reducer", "hash", "signature")
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REDUCER_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    part: int
    epoch: int
    reducer: int
    hash: bytes
    signature: bytes
    def __init__(self, part: _Optional[int] = ..., epoch: _Optional[int] = ..., reducer: _Optional[int] = ..., hash: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Rerun(_message.Message):
    __slots__ = ("part", "epoch")
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    part: int
    epoch: int
    def __init__(self, part: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("agreed", "digest", "reason", "evidence")
    AGREED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    agreed: bool
    digest: bytes
    reason: str
    evidence: _containers.RepeatedCompositeFieldContainer[Announced]
    def __init__(self, agreed: _Optional[bool] = ..., digest: _Optional[bytes] = ..., reason: _Optional[str] = ..., evidence: _Optional[_Iterable[_Union[Announced, _Mapping]]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AggregateResponse(_message.Message):
    __slots__ = ("result", "rerun", "verdict", "refusal", "heartbeat", "seal", "statements", "fetch", "proof")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RERUN_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    STATEMENTS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    result: ResultChunk
    rerun: Rerun
    verdict: Verdict
    refusal: Refusal
    heartbeat: Heartbeat
    seal: Seal
    statements: Statements
    fetch: Fetch
    proof: Proof
    def __init__(self, result: _Optional[_Union[ResultChunk, _Mapping]] = ..., rerun: _Optional[_Union[Rerun, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., seal: _Optional[_Union[Seal, _Mapping]] = ..., statements: _Optional[_Union[Statements, _Mapping]] = ..., fetch: _Optional[_Union[Fetch, _Mapping]] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ...) -> None: ...
