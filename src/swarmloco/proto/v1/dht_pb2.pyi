from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerInfo(_message.Message):
    __slots__ = ("public_key", "endpoint", "started_at_ms", "signature", "tls_fingerprint")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TLS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    endpoint: str
    started_at_ms: int
    signature: bytes
    tls_fingerprint: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., endpoint: _Optional[str] = ..., started_at_ms: _Optional[int] = ..., signature: _Optional[bytes] = ..., tls_fingerprint: _Optional[bytes] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("key", "subkey", "value", "expiration", "owner_public_key", "signature")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SUBKEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_FIELD_NUMBER: _ClassVar[int]
    OWNER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    key: str
    subkey: str
    value: bytes
    expiration: float
    owner_public_key: bytes
    signature: bytes
    def __init__(self, key: _Optional[str] = ..., subkey: _Optional[str] = ..., value: _Optional[bytes] = ..., expiration: _Optional[float] = ..., owner_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("sender",)
    SENDER_FIELD_NUMBER: _ClassVar[int]
    sender: PeerInfo
    def __init__(self, sender: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("peer", "observed_host", "time_ms")
    PEER_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    observed_host: str
    time_ms: int
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., observed_host: _Optional[str] = ..., time_ms: _Optional[int] = ...) -> None: ...

class FindNodeRequest(_message.Message):
    __slots__ = ("sender", "target")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    sender: PeerInfo
    target: bytes
    def __init__(self, sender: _Optional[_Union[PeerInfo, _Mapping]] = ..., target: _Optional[bytes] = ...) -> None: ...

class FindNodeResponse(_message.Message):
    __slots__ = ("peer", "closest")
    PEER_FIELD_NUMBER: _ClassVar[int]
    CLOSEST_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    closest: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., closest: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("sender", "records", "timestamp_ms", "signature")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    sender: PeerInfo
    records: _containers.RepeatedCompositeFieldContainer[Record]
    timestamp_ms: int
    signature: bytes
    def __init__(self, sender: _Optional[_Union[PeerInfo, _Mapping]] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., timestamp_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StoreResult(_message.Message):
    __slots__ = ("stored", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: str
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("peer", "results")
    PEER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    results: _containers.RepeatedCompositeFieldContainer[StoreResult]
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., results: _Optional[_Iterable[_Union[StoreResult, _Mapping]]] = ...) -> None: ...

class FindValueRequest(_message.Message):
    __slots__ = ("sender", "key")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    sender: PeerInfo
    key: str
    def __init__(self, sender: _Optional[_Union[PeerInfo, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class FindValueResponse(_message.Message):
    __slots__ = ("peer", "records", "closest")
    PEER_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    CLOSEST_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    records: _containers.RepeatedCompositeFieldContainer[Record]
    closest: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., closest: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...
