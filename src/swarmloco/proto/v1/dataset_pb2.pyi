from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FileRequest(_message.Message):
    __slots__ = ("dataset_id", "name")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    name: str
    def __init__(self, dataset_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("total_bytes", "data")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
