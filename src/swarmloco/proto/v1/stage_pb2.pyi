from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageTensor(_message.Message):
    __slots__ = ("shape", "encoding", "data", "scales", "block_size")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: str
    data: bytes
    scales: bytes
    block_size: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[str] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., block_size: _Optional[int] = ...) -> None: ...

class StageRefusal(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("swarm_id", "stage", "micro_batch", "input", "targets", "seed", "session", "step")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    stage: int
    micro_batch: bytes
    input: StageTensor
    targets: StageTensor
    seed: int
    session: bytes
    step: int
    def __init__(self, swarm_id: _Optional[str] = ..., stage: _Optional[int] = ..., micro_batch: _Optional[bytes] = ..., input: _Optional[_Union[StageTensor, _Mapping]] = ..., targets: _Optional[_Union[StageTensor, _Mapping]] = ..., seed: _Optional[int] = ..., session: _Optional[bytes] = ..., step: _Optional[int] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output", "loss", "refused")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    output: StageTensor
    loss: float
    refused: StageRefusal
    def __init__(self, output: _Optional[_Union[StageTensor, _Mapping]] = ..., loss: _Optional[float] = ..., refused: _Optional[_Union[StageRefusal, _Mapping]] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("swarm_id", "stage", "micro_batch", "grad_output")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    stage: int
    micro_batch: bytes
    grad_output: StageTensor
    def __init__(self, swarm_id: _Optional[str] = ..., stage: _Optional[int] = ..., micro_batch: _Optional[bytes] = ..., grad_output: _Optional[_Union[StageTensor, _Mapping]] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("grad_input", "refused")
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    grad_input: StageTensor
    refused: StageRefusal
    def __init__(self, grad_input: _Optional[_Union[StageTensor, _Mapping]] = ..., refused: _Optional[_Union[StageRefusal, _Mapping]] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("swarm_id", "stage", "micro_batch")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    stage: int
    micro_batch: bytes
    def __init__(self, swarm_id: _Optional[str] = ..., stage: _Optional[int] = ..., micro_batch: _Optional[bytes] = ...) -> None: ...

class AbandonResponse(_message.Message):
    __slots__ = ("dropped", "refused")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    refused: StageRefusal
    def __init__(self, dropped: _Optional[bool] = ..., refused: _Optional[_Union[StageRefusal, _Mapping]] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("swarm_id", "stage", "input", "targets", "seed", "grad_output")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    stage: int
    input: StageTensor
    targets: StageTensor
    seed: int
    grad_output: StageTensor
    def __init__(self, swarm_id: _Optional[str] = ..., stage: _Optional[int] = ..., input: _Optional[_Union[StageTensor, _Mapping]] = ..., targets: _Optional[_Union[StageTensor, _Mapping]] = ..., seed: _Optional[int] = ..., grad_output: _Optional[_Union[StageTensor, _Mapping]] = ...) -> None: ...

class AuditAnswer(_message.Message):
    __slots__ = ("output", "loss", "grad_input")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    output: StageTensor
    loss: float
    grad_input: StageTensor
    def __init__(self, output: _Optional[_Union[StageTensor, _Mapping]] = ..., loss: _Optional[float] = ..., grad_input: _Optional[_Union[StageTensor, _Mapping]] = ...) -> None: ...

class AuditResponse(_message.Message):
    __slots__ = ("answer", "refused")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    answer: AuditAnswer
    refused: StageRefusal
    def __init__(self, answer: _Optional[_Union[AuditAnswer, _Mapping]] = ..., refused: _Optional[_Union[StageRefusal, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("swarm_id", "stage", "session")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    stage: int
    session: bytes
    def __init__(self, swarm_id: _Optional[str] = ..., stage: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("open", "refused", "beat_ms")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    BEAT_MS_FIELD_NUMBER: _ClassVar[int]
    open: bool
    refused: StageRefusal
    beat_ms: int
    def __init__(self, open: _Optional[bool] = ..., refused: _Optional[_Union[StageRefusal, _Mapping]] = ..., beat_ms: _Optional[int] = ...) -> None: ...
