"""radixkv: a paged KV-cache manager with radix-tree prefix sharing.

Kept light on purpose: importing `radixkv` (and `radixkv.client`) never imports torch, triton or
grpc. Storage, kernels and the server are imported from their own modules.
"""

from radixkv.errors import (
    InvalidArgument,
    LimitExceeded,
    OutOfBlocks,
    RadixKVError,
    UnknownSequence,
)
from radixkv.kv_cache import AppendResult, KVCache, OpenResult, Stats
from radixkv.layout import PoolLayout

__all__ = [
    "AppendResult",
    "InvalidArgument",
    "KVCache",
    "LimitExceeded",
    "OpenResult",
    "OutOfBlocks",
    "PoolLayout",
    "RadixKVError",
    "Stats",
    "UnknownSequence",
]
