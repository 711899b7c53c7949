"""radixkv: a paged KV-cache manager with radix-tree prefix sharing.

Kept light on purpose: importing `radixkv` (and `radixkv.client`) never imports torch, triton or
grpc. Storage, kernels and the server are imported from their own modules.
"""

from radixkv.errors import (
    InvalidArgument,
    LimitExceeded,
    NotAdmitted,
    OutOfBlocks,
    RadixKVError,
    SequencePreempted,
    UnknownSequence,
)
from radixkv.kv_cache import KVCache, Limits
from radixkv.memory.layout import PoolLayout
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, AppendResult, OpenResult
from radixkv.stats import Stats

__all__ = [
    "AppendBatch",
    "AppendResult",
    "InvalidArgument",
    "KVCache",
    "Limits",
    "LimitExceeded",
    "NotAdmitted",
    "OpenResult",
    "OutOfBlocks",
    "PoolLayout",
    "PreemptResult",
    "RadixKVError",
    "ResumeResult",
    "SequencePreempted",
    "Stats",
    "UnknownSequence",
]
