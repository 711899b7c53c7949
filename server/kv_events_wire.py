"""vLLM's KV-events payload, encoded as vLLM 0.33/0.34 encode it: msgspec structs of the same shape.

vLLM's publisher (`vllm/distributed/kv_events.py`) encodes `KVEventBatch` with msgspec: the batch
`array_like` (`[ts, [events], data_parallel_rank]`), each event a map tagged "type", its fields in
declaration order, those at their default left out (`omit_defaults`), and the map's header sized for
every field it could hold (a struct of more than 15 fields gets a map16 header even when it writes
fewer). The structs here declare the same fields in the same order, so a batch radixkv sends is the
bytes vLLM's publisher would send for it, not merely something a decoder accepts;
`tests/fleet/vllm_wire.py` holds the upstream definitions and the tests compare the two byte for byte.
radixkv sets what a device-tier, single-group, LoRA-free pool has to say: the hashes (low 64 bits),
parent, tokens, block size, medium "GPU", and the salt as `extra_keys`; the rest stay at their defaults.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from radixkv.server.events import BlockEvent

MEDIUM_GPU = "GPU"  # vLLM's MEDIUM_GPU: the device tier; a host tier would publish "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
ENCODER = msgspec.msgpack.Encoder()


def stored_event(event: BlockEvent, block_size: int) -> BlockStored:
    """A tree event's BlockStored: `extra_keys` only when a block carries a salt (else left out, as vLLM does)."""
    extra = [tuple(k) if k is not None else None for k in event.extra_keys]
    return BlockStored(
        block_hashes=list(event.block_hashes),
        parent_block_hash=event.parent_block_hash,
        token_ids=np.frombuffer(event.token_bytes, dtype="<i4").tolist(),
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=extra if any(k is not None for k in extra) else None,
    )


def tier_event(stored: bool, wire_hashes: list[int], medium: str) -> BlockStored | BlockRemoved:
    """Blocks another tier (the disk's, medium STORAGE) took or dropped, as vLLM's offloading connector reports its
    tiers' blocks it has no token metadata for: hashes only (no parent, no tokens, block_size 0)."""
    if stored:
        return BlockStored(block_hashes=wire_hashes, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                           medium=medium, lora_name=None)  # fmt: skip
    return BlockRemoved(block_hashes=wire_hashes, medium=medium)


def removed_event(event: BlockEvent) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU)


def batch_payload(ts: float, events: list[Event], data_parallel_rank: int) -> bytes:
    """One batch's payload: what goes after the topic and seq frames."""
    return ENCODER.encode(EventBatch(ts, events, data_parallel_rank))


def digest_payload(ts: float, data_parallel_rank: int, proof: dict[str, int]) -> bytes:
    """The digest socket's payload: `[ts, [], data_parallel_rank, {epoch, seq, num_events, digest}]`."""
    return ENCODER.encode([ts, [], data_parallel_rank, proof])
