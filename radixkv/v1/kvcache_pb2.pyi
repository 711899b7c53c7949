from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_FULLY_CACHED: _ClassVar[MissReason]
    MISS_REASON_NEVER_CACHED: _ClassVar[MissReason]
    MISS_REASON_EVICTED: _ClassVar[MissReason]
    MISS_REASON_PARTIAL_BLOCK: _ClassVar[MissReason]
    MISS_REASON_OTHER_NAMESPACE: _ClassVar[MissReason]
    MISS_REASON_LAST_TOKEN: _ClassVar[MissReason]
    MISS_REASON_HOST_TIER: _ClassVar[MissReason]

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_BLOCKS_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_BLOCKS_REMOVED: _ClassVar[KVEventKind]

class PreemptMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPT_MODE_UNSPECIFIED: _ClassVar[PreemptMode]
    PREEMPT_MODE_SWAP: _ClassVar[PreemptMode]
    PREEMPT_MODE_RECOMPUTE: _ClassVar[PreemptMode]
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_FULLY_CACHED: MissReason
MISS_REASON_NEVER_CACHED: MissReason
MISS_REASON_EVICTED: MissReason
MISS_REASON_PARTIAL_BLOCK: MissReason
MISS_REASON_OTHER_NAMESPACE: MissReason
MISS_REASON_LAST_TOKEN: MissReason
MISS_REASON_HOST_TIER: MissReason
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_KIND_BLOCKS_STORED: KVEventKind
KV_EVENT_KIND_BLOCKS_REMOVED: KVEventKind
PREEMPT_MODE_UNSPECIFIED: PreemptMode
PREEMPT_MODE_SWAP: PreemptMode
PREEMPT_MODE_RECOMPUTE: PreemptMode

class OpenSessionRequest(_message.Message):
    __slots__ = ("ttl_seconds", "pool")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    pool: str
    def __init__(self, ttl_seconds: _Optional[float] = ..., pool: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_released_sequences",)
    NUM_RELEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    num_released_sequences: int
    def __init__(self, num_released_sequences: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids", "namespace", "max_new_tokens", "priority")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    max_new_tokens: int
    priority: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class OpenSequencesRequest(_message.Message):
    __slots__ = ("pool", "session_id", "prompts", "request_id", "explain")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    request_id: int
    explain: bool
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., request_id: _Optional[int] = ..., explain: _Optional[bool] = ...) -> None: ...

class OpenedSequence(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens", "block_ids", "slots", "miss_reason", "miss_block_index", "evicted_at_unix_ns", "other_namespace", "num_host_hit_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    EVICTED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    OTHER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_cached_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    miss_reason: MissReason
    miss_block_index: int
    evicted_at_unix_ns: int
    other_namespace: str
    num_host_hit_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., miss_block_index: _Optional[int] = ..., evicted_at_unix_ns: _Optional[int] = ..., other_namespace: _Optional[str] = ..., num_host_hit_tokens: _Optional[int] = ...) -> None: ...

class OpenSequencesResponse(_message.Message):
    __slots__ = ("sequences", "offloads", "loads")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[OpenedSequence]
    offloads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    loads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    def __init__(self, sequences: _Optional[_Iterable[_Union[OpenedSequence, _Mapping]]] = ..., offloads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ...) -> None: ...

class BlockTransfer(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class AppendTokensRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids", "num_token_ids", "token_ids", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id", "sequence_index")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    sequence_index: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ..., sequence_index: _Optional[int] = ...) -> None: ...

class AppendTokensResponse(_message.Message):
    __slots__ = ("num_tokens", "table_offsets", "num_block_ids", "block_ids", "slots", "copies", "offloads")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TABLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    table_offsets: _containers.RepeatedScalarFieldContainer[int]
    num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    offloads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    def __init__(self, num_tokens: _Optional[_Iterable[int]] = ..., table_offsets: _Optional[_Iterable[int]] = ..., num_block_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., offloads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ...) -> None: ...

class ForkSequenceRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_id", "num_children", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_id: int
    num_children: int
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., num_children: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class ForkSequenceResponse(_message.Message):
    __slots__ = ("child_seq_ids",)
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, child_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheSequenceRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_id", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_id: int
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class CacheSequenceResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseSequencesRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids", "cache", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    cache: bool
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., cache: _Optional[bool] = ..., request_id: _Optional[int] = ...) -> None: ...

class ReleaseSequencesResponse(_message.Message):
    __slots__ = ("num_released_sequences",)
    NUM_RELEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    num_released_sequences: int
    def __init__(self, num_released_sequences: _Optional[int] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("pool", "session_id", "token_ids", "namespace", "explain")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    explain: bool
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., explain: _Optional[bool] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "miss_reason", "miss_block_index", "evicted_at_unix_ns", "other_namespace", "num_host_cached_tokens", "num_disk_cached_tokens")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    EVICTED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    OTHER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    miss_reason: MissReason
    miss_block_index: int
    evicted_at_unix_ns: int
    other_namespace: str
    num_host_cached_tokens: int
    num_disk_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., miss_block_index: _Optional[int] = ..., evicted_at_unix_ns: _Optional[int] = ..., other_namespace: _Optional[str] = ..., num_host_cached_tokens: _Optional[int] = ..., num_disk_cached_tokens: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("pool", "session_id", "token_ids", "namespace", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_pinned_tokens",)
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_pinned_tokens: int
    def __init__(self, num_pinned_tokens: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pool", "session_id", "token_ids", "namespace", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pool", "session_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("num_blocks_total", "num_blocks_free", "num_blocks_cached", "num_blocks_evictable", "num_blocks_pinned", "num_blocks_in_use", "num_live_sequences", "num_namespaces", "num_requested_tokens", "num_hit_tokens", "num_evicted_blocks", "num_allocation_failures", "num_cow_copies", "num_opened_sequences", "num_forked_sequences", "num_released_sequences", "num_host_blocks_total", "num_host_blocks_free", "num_host_blocks_cached", "num_host_blocks_swapped", "num_offloaded_blocks", "num_loaded_blocks", "num_host_evicted_blocks", "num_host_hit_tokens", "num_swapped_sequences", "num_blocks_reserved", "num_preempted_sequences", "num_admission_refusals", "num_preemptions_swap", "num_preemptions_recompute", "num_resumed_sequences", "num_recomputed_tokens", "memory_pressure", "pressure_band")
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_COW_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_OPENED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMISSION_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_BAND_FIELD_NUMBER: _ClassVar[int]
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int
    num_blocks_evictable: int
    num_blocks_pinned: int
    num_blocks_in_use: int
    num_live_sequences: int
    num_namespaces: int
    num_requested_tokens: int
    num_hit_tokens: int
    num_evicted_blocks: int
    num_allocation_failures: int
    num_cow_copies: int
    num_opened_sequences: int
    num_forked_sequences: int
    num_released_sequences: int
    num_host_blocks_total: int
    num_host_blocks_free: int
    num_host_blocks_cached: int
    num_host_blocks_swapped: int
    num_offloaded_blocks: int
    num_loaded_blocks: int
    num_host_evicted_blocks: int
    num_host_hit_tokens: int
    num_swapped_sequences: int
    num_blocks_reserved: int
    num_preempted_sequences: int
    num_admission_refusals: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_resumed_sequences: int
    num_recomputed_tokens: int
    memory_pressure: float
    pressure_band: str
    def __init__(self, num_blocks_total: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., num_blocks_cached: _Optional[int] = ..., num_blocks_evictable: _Optional[int] = ..., num_blocks_pinned: _Optional[int] = ..., num_blocks_in_use: _Optional[int] = ..., num_live_sequences: _Optional[int] = ..., num_namespaces: _Optional[int] = ..., num_requested_tokens: _Optional[int] = ..., num_hit_tokens: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ..., num_allocation_failures: _Optional[int] = ..., num_cow_copies: _Optional[int] = ..., num_opened_sequences: _Optional[int] = ..., num_forked_sequences: _Optional[int] = ..., num_released_sequences: _Optional[int] = ..., num_host_blocks_total: _Optional[int] = ..., num_host_blocks_free: _Optional[int] = ..., num_host_blocks_cached: _Optional[int] = ..., num_host_blocks_swapped: _Optional[int] = ..., num_offloaded_blocks: _Optional[int] = ..., num_loaded_blocks: _Optional[int] = ..., num_host_evicted_blocks: _Optional[int] = ..., num_host_hit_tokens: _Optional[int] = ..., num_swapped_sequences: _Optional[int] = ..., num_blocks_reserved: _Optional[int] = ..., num_preempted_sequences: _Optional[int] = ..., num_admission_refusals: _Optional[int] = ..., num_preemptions_swap: _Optional[int] = ..., num_preemptions_recompute: _Optional[int] = ..., num_resumed_sequences: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ..., memory_pressure: _Optional[float] = ..., pressure_band: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stats", "num_sessions", "num_available_blocks", "num_tombstones", "tombstone_bytes")
    STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    stats: PoolStats
    num_sessions: int
    num_available_blocks: int
    num_tombstones: int
    tombstone_bytes: int
    def __init__(self, stats: _Optional[_Union[PoolStats, _Mapping]] = ..., num_sessions: _Optional[int] = ..., num_available_blocks: _Optional[int] = ..., num_tombstones: _Optional[int] = ..., tombstone_bytes: _Optional[int] = ...) -> None: ...

class CommitTokensRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids", "num_tokens")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitTokensResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeSequencesRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeSequencesResponse(_message.Message):
    __slots__ = ("num_tokens", "num_computed_tokens")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class CanAppendRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids", "num_token_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CanAppendResponse(_message.Message):
    __slots__ = ("can_append", "num_available_blocks")
    CAN_APPEND_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    can_append: bool
    num_available_blocks: int
    def __init__(self, can_append: _Optional[bool] = ..., num_available_blocks: _Optional[int] = ...) -> None: ...

class FreeableBlocksRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeableBlocksResponse(_message.Message):
    __slots__ = ("num_freeable_blocks",)
    NUM_FREEABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_freeable_blocks: int
    def __init__(self, num_freeable_blocks: _Optional[int] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("pool", "session_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class GetPoolResponse(_message.Message):
    __slots__ = ("pool", "layout", "device", "handle_json", "handle", "hash_contract", "host_layout", "host_handle")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_JSON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    HASH_CONTRACT_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_HANDLE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    layout: PoolLayout
    device: str
    handle_json: str
    handle: PoolHandle
    hash_contract: HashContract
    host_layout: PoolLayout
    host_handle: PoolHandle
    def __init__(self, pool: _Optional[str] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., device: _Optional[str] = ..., handle_json: _Optional[str] = ..., handle: _Optional[_Union[PoolHandle, _Mapping]] = ..., hash_contract: _Optional[_Union[HashContract, _Mapping]] = ..., host_layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., host_handle: _Optional[_Union[PoolHandle, _Mapping]] = ...) -> None: ...

class HashContract(_message.Message):
    __slots__ = ("algorithm", "root_seed", "block_size", "salt_rule", "tenant_scope_rule", "wire_form", "format_version")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    ROOT_SEED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SALT_RULE_FIELD_NUMBER: _ClassVar[int]
    TENANT_SCOPE_RULE_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORM_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    root_seed: str
    block_size: int
    salt_rule: str
    tenant_scope_rule: str
    wire_form: str
    format_version: int
    def __init__(self, algorithm: _Optional[str] = ..., root_seed: _Optional[str] = ..., block_size: _Optional[int] = ..., salt_rule: _Optional[str] = ..., tenant_scope_rule: _Optional[str] = ..., wire_form: _Optional[str] = ..., format_version: _Optional[int] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("shared_memory", "cuda_ipc")
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shared_memory: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    def __init__(self, shared_memory: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_index: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool", "session_id", "namespaces", "include_snapshot")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    include_snapshot: bool
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., namespaces: _Optional[_Iterable[str]] = ..., include_snapshot: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence_number", "namespace", "kind", "block_ids", "token_ids", "parent_block_id", "block_hashes", "parent_block_hash", "namespace_digest")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    namespace: str
    kind: KVEventKind
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_block_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    namespace_digest: int
    def __init__(self, sequence_number: _Optional[int] = ..., namespace: _Optional[str] = ..., kind: _Optional[_Union[KVEventKind, str]] = ..., block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., parent_block_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., namespace_digest: _Optional[int] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("events", "snapshot", "epoch", "seq", "digest")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    snapshot: bool
    epoch: int
    seq: int
    digest: int
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., digest: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("pool", "session_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class NamespaceDigest(_message.Message):
    __slots__ = ("namespace", "digest", "num_blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    digest: int
    num_blocks: int
    def __init__(self, namespace: _Optional[str] = ..., digest: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("namespaces", "digest", "epoch", "seq", "hash_contract")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HASH_CONTRACT_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceDigest]
    digest: int
    epoch: int
    seq: int
    hash_contract: HashContract
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceDigest, _Mapping]]] = ..., digest: _Optional[int] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., hash_contract: _Optional[_Union[HashContract, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id", "pool", "request_id", "opens", "append", "forks", "cache_seq_ids", "releases", "commit", "steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool: str
    request_id: int
    opens: _containers.RepeatedCompositeFieldContainer[StepOpen]
    append: StepAppend
    forks: _containers.RepeatedCompositeFieldContainer[StepFork]
    cache_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    releases: _containers.RepeatedCompositeFieldContainer[StepRelease]
    commit: StepCommit
    steps: _containers.RepeatedCompositeFieldContainer[SessionRequest]
    def __init__(self, session_id: _Optional[str] = ..., pool: _Optional[str] = ..., request_id: _Optional[int] = ..., opens: _Optional[_Iterable[_Union[StepOpen, _Mapping]]] = ..., append: _Optional[_Union[StepAppend, _Mapping]] = ..., forks: _Optional[_Iterable[_Union[StepFork, _Mapping]]] = ..., cache_seq_ids: _Optional[_Iterable[int]] = ..., releases: _Optional[_Iterable[_Union[StepRelease, _Mapping]]] = ..., commit: _Optional[_Union[StepCommit, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[SessionRequest, _Mapping]]] = ...) -> None: ...

class StepCommit(_message.Message):
    __slots__ = ("seq_ids", "num_tokens")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class StepOpen(_message.Message):
    __slots__ = ("token_ids", "namespace", "max_new_tokens", "priority", "explain")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    namespace: str
    max_new_tokens: int
    priority: int
    explain: bool
    def __init__(self, token_ids: _Optional[bytes] = ..., namespace: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., explain: _Optional[bool] = ...) -> None: ...

class StepAppend(_message.Message):
    __slots__ = ("seq_ids", "num_token_ids", "token_ids", "packed_seq_ids", "packed_num_token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: bytes
    packed_seq_ids: bytes
    packed_num_token_ids: bytes
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[bytes] = ..., packed_seq_ids: _Optional[bytes] = ..., packed_num_token_ids: _Optional[bytes] = ...) -> None: ...

class StepFork(_message.Message):
    __slots__ = ("seq_id", "num_children")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_children: int
    def __init__(self, seq_id: _Optional[int] = ..., num_children: _Optional[int] = ...) -> None: ...

class StepRelease(_message.Message):
    __slots__ = ("seq_ids", "cache")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    cache: bool
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., cache: _Optional[bool] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "reason", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("request_id", "error", "opened", "appended", "forked", "num_cached_tokens", "num_released_sequences", "session_id", "steps", "offloads", "loads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    FORKED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: StepError
    opened: _containers.RepeatedCompositeFieldContainer[StepOpened]
    appended: StepAppended
    forked: _containers.RepeatedCompositeFieldContainer[StepForked]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_released_sequences: int
    session_id: str
    steps: _containers.RepeatedCompositeFieldContainer[SessionResponse]
    offloads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    loads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., opened: _Optional[_Iterable[_Union[StepOpened, _Mapping]]] = ..., appended: _Optional[_Union[StepAppended, _Mapping]] = ..., forked: _Optional[_Iterable[_Union[StepForked, _Mapping]]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., num_released_sequences: _Optional[int] = ..., session_id: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[SessionResponse, _Mapping]]] = ..., offloads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ...) -> None: ...

class StepOpened(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens", "block_ids", "slots", "miss_reason", "miss_block_index", "evicted_at_unix_ns", "other_namespace", "num_host_hit_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    EVICTED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    OTHER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_cached_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: bytes
    miss_reason: MissReason
    miss_block_index: int
    evicted_at_unix_ns: int
    other_namespace: str
    num_host_hit_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[bytes] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., miss_block_index: _Optional[int] = ..., evicted_at_unix_ns: _Optional[int] = ..., other_namespace: _Optional[str] = ..., num_host_hit_tokens: _Optional[int] = ...) -> None: ...

class StepAppended(_message.Message):
    __slots__ = ("num_tokens", "table_offsets", "num_block_ids", "block_ids", "slots", "copies", "packed_num_tokens", "packed_table_offsets", "packed_num_block_ids", "packed_block_ids")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TABLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TABLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    table_offsets: _containers.RepeatedScalarFieldContainer[int]
    num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: bytes
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    packed_num_tokens: bytes
    packed_table_offsets: bytes
    packed_num_block_ids: bytes
    packed_block_ids: bytes
    def __init__(self, num_tokens: _Optional[_Iterable[int]] = ..., table_offsets: _Optional[_Iterable[int]] = ..., num_block_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[bytes] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., packed_num_tokens: _Optional[bytes] = ..., packed_table_offsets: _Optional[bytes] = ..., packed_num_block_ids: _Optional[bytes] = ..., packed_block_ids: _Optional[bytes] = ...) -> None: ...

class StepForked(_message.Message):
    __slots__ = ("child_seq_ids",)
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, child_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PreemptRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_ids", "mode", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    mode: PreemptMode
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., mode: _Optional[_Union[PreemptMode, str]] = ..., request_id: _Optional[int] = ...) -> None: ...

class PreemptResponse(_message.Message):
    __slots__ = ("offloads", "num_freed_blocks", "num_unreserved_blocks")
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNRESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    offloads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    num_freed_blocks: int
    num_unreserved_blocks: int
    def __init__(self, offloads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ..., num_freed_blocks: _Optional[int] = ..., num_unreserved_blocks: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_id", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_id: int
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens", "block_ids", "slots", "loads", "offloads", "num_host_hit_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_cached_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    loads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    offloads: _containers.RepeatedCompositeFieldContainer[BlockTransfer]
    num_host_hit_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., loads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ..., offloads: _Optional[_Iterable[_Union[BlockTransfer, _Mapping]]] = ..., num_host_hit_tokens: _Optional[int] = ...) -> None: ...

class VictimsRequest(_message.Message):
    __slots__ = ("pool", "session_id", "num_blocks")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    num_blocks: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class VictimsResponse(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UpgradeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolSnapshot(_message.Message):
    __slots__ = ("pool", "path", "num_bytes", "num_cached_blocks", "num_live_sequences", "seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    path: str
    num_bytes: int
    num_cached_blocks: int
    num_live_sequences: int
    seconds: float
    def __init__(self, pool: _Optional[str] = ..., path: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_live_sequences: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class UpgradeResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[PoolSnapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[PoolSnapshot, _Mapping]]] = ...) -> None: ...

class RecordBlockChecksumsRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_id", "first_block", "checksums", "digests")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_id: int
    first_block: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., first_block: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RecordBlockChecksumsResponse(_message.Message):
    __slots__ = ("num_recorded",)
    NUM_RECORDED_FIELD_NUMBER: _ClassVar[int]
    num_recorded: int
    def __init__(self, num_recorded: _Optional[int] = ...) -> None: ...

class GetBlockChecksumsRequest(_message.Message):
    __slots__ = ("pool", "session_id", "seq_id", "first_block", "num_blocks")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    seq_id: int
    first_block: int
    num_blocks: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class GetBlockChecksumsResponse(_message.Message):
    __slots__ = ("checksums", "digests")
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, checksums: _Optional[_Iterable[int]] = ..., digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("ttl_seconds", "priority", "refresh", "end_session")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    END_SESSION_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    priority: int
    refresh: bool
    end_session: bool
    def __init__(self, ttl_seconds: _Optional[float] = ..., priority: _Optional[int] = ..., refresh: _Optional[bool] = ..., end_session: _Optional[bool] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("pool", "session_id", "token_ids", "namespace", "retention", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    retention: Retention
    request_id: int
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("num_retained_tokens",)
    NUM_RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_retained_tokens: int
    def __init__(self, num_retained_tokens: _Optional[int] = ...) -> None: ...
