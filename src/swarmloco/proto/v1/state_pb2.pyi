from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DownloadRequest(_message.Message):
    __slots__ = ("swarm_id", "nonce", "round", "digest", "public_key", "membership", "timestamp_ms", "signature")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    nonce: bytes
    round: int
    digest: bytes
    public_key: bytes
    membership: bytes
    timestamp_ms: int
    signature: bytes
    def __init__(self, swarm_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., round: _Optional[int] = ..., digest: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., membership: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    numel: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., numel: _Optional[int] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("public_key", "swarm_id", "round", "tensors", "total_bytes", "chunk_bytes", "digest", "timestamp_ms", "nonce", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    swarm_id: str
    round: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    total_bytes: int
    chunk_bytes: int
    digest: bytes
    timestamp_ms: int
    nonce: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., swarm_id: _Optional[str] = ..., round: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., digest: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DownloadResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    chunk: StateChunk
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., chunk: _Optional[_Union[StateChunk, _Mapping]] = ...) -> None: ...
