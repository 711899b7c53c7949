from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CheckInvariantsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("violation", "num_live_sequences", "num_sessions", "num_watch_streams")
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_WATCH_STREAMS_FIELD_NUMBER: _ClassVar[int]
    violation: str
    num_live_sequences: int
    num_sessions: int
    num_watch_streams: int
    def __init__(self, violation: _Optional[str] = ..., num_live_sequences: _Optional[int] = ..., num_sessions: _Optional[int] = ..., num_watch_streams: _Optional[int] = ...) -> None: ...

class ChecksumBlocksRequest(_message.Message):
    __slots__ = ("pool", "block_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChecksumBlocksResponse(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class CorruptRefCountRequest(_message.Message):
    __slots__ = ("pool", "block_id", "delta")
    POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    pool: str
    block_id: int
    delta: int
    def __init__(self, pool: _Optional[str] = ..., block_id: _Optional[int] = ..., delta: _Optional[int] = ...) -> None: ...

class CorruptRefCountResponse(_message.Message):
    __slots__ = ("ref_count",)
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    ref_count: int
    def __init__(self, ref_count: _Optional[int] = ...) -> None: ...

class StallStepsRequest(_message.Message):
    __slots__ = ("pool", "max_seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    max_seconds: float
    def __init__(self, pool: _Optional[str] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class StallStepsResponse(_message.Message):
    __slots__ = ("stalled",)
    STALLED_FIELD_NUMBER: _ClassVar[int]
    stalled: bool
    def __init__(self, stalled: _Optional[bool] = ...) -> None: ...
