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

from radixkv.server.events.hub import BlockEvent

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
        return BlockStored(
            block_hashes=wire_hashes,
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
    return BlockRemoved(block_hashes=wire_hashes, medium=medium)


def removed_event(event: BlockEvent) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU)


def batch_payload(ts: float, events: list[Event], data_parallel_rank: int) -> bytes:
    """One batch's payload: what goes after the topic and seq frames."""
    return ENCODER.encode(EventBatch(ts, events, data_parallel_rank))


def digest_payload(ts: float, data_parallel_rank: int, proof: dict[str, int]) -> bytes:
    """The digest socket's payload: `[ts, [], data_parallel_rank, {epoch, seq, num_events, digest}]`."""
    return ENCODER.encode([ts, [], data_parallel_rank, proof])


# -- sizes: every batch within kv_events_max_batch_bytes ---------------------------------------------------------

_MAX_U64, _MAX_I32 = 2**64 - 1, 2**31 - 1
_ARRAY_GROWTH = 4  # a fixarray header (1 byte) may become an array32 one (5 bytes)
_LARGEST_EMPTY_STORED = BlockStored([], _MAX_U64, [], _MAX_I32, None, MEDIUM_GPU, None, [])
STORED_OVERHEAD = len(ENCODER.encode(_LARGEST_EMPTY_STORED)) + 3 * _ARRAY_GROWTH
REMOVED_OVERHEAD = len(ENCODER.encode(BlockRemoved([], MEDIUM_GPU))) + _ARRAY_GROWTH
BATCH_OVERHEAD = len(ENCODER.encode(EventBatch(0.0, [], _MAX_I32))) + _ARRAY_GROWTH
_HASH_BYTES, _TOKEN_BYTES = 9, 5  # msgpack's largest encodings of a u64 and of an int32


def event_bytes(event: Event) -> int:
    """At most the bytes `event` takes in a batch (msgpack's largest encodings of its numbers)."""
    if isinstance(event, BlockStored):
        extra = 0 if event.extra_keys is None else sum(len(ENCODER.encode(k)) for k in event.extra_keys)
        return STORED_OVERHEAD + _HASH_BYTES * len(event.block_hashes) + _TOKEN_BYTES * len(event.token_ids) + extra
    if isinstance(event, BlockRemoved):
        return REMOVED_OVERHEAD + _HASH_BYTES * len(event.block_hashes)
    return len(ENCODER.encode(event))


def min_batch_bytes(block_size: int) -> int:
    """The smallest batch bound that holds one unsalted block of `block_size` tokens."""
    return BATCH_OVERHEAD + STORED_OVERHEAD + _HASH_BYTES + _TOKEN_BYTES * block_size + 1


def split(event: Event, max_bytes: int) -> list[Event]:
    """`event` as events of at most `max_bytes` each, announcing the same blocks in the same order: a BlockStored
    as a chain (each piece's parent the previous piece's last block), a BlockRemoved by its hashes. Empty when one
    block alone is larger (a salt longer than the bound allows): the caller refuses it."""
    if event_bytes(event) <= max_bytes:
        return [event]
    if isinstance(event, BlockRemoved):
        per = (max_bytes - REMOVED_OVERHEAD) // _HASH_BYTES
        hashes = event.block_hashes
        return [BlockRemoved(hashes[i : i + per], MEDIUM_GPU) for i in range(0, len(hashes), per)]
    if not isinstance(event, BlockStored):
        return []
    pieces: list[Event] = []
    n, size = len(event.block_hashes), len(event.token_ids) // max(1, len(event.block_hashes))
    extra = event.extra_keys or [None] * n
    first, parent = 0, event.parent_block_hash
    while first < n:
        room = max_bytes - STORED_OVERHEAD
        last = first
        while last < n:
            cost = _HASH_BYTES + _TOKEN_BYTES * size + len(ENCODER.encode(extra[last]))
            if cost > room:
                break
            room -= cost
            last += 1
        if last == first:
            return []
        keys = extra[first:last]
        pieces.append(
            BlockStored(
                block_hashes=event.block_hashes[first:last],
                parent_block_hash=parent,
                token_ids=event.token_ids[first * size : last * size],
                block_size=event.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=keys if any(k is not None for k in keys) else None,
            )
        )
        first, parent = last, event.block_hashes[last - 1]
    return pieces


# -- coalescing: what one call stored and removed again is published by neither ------------------------------------


def coalesce(events: list[Event]) -> list[Event]:
    """`events` (one hold of the pool's lock, in order) less every block both stored and removed in it: a stored
    run loses those blocks from its tail (or goes), the removal loses those hashes (or goes). Anything else, such as
    a removal from the middle of a run, is left as it is: correct, only not shortened."""
    stored_in: dict[int, int] = {}  # hash -> index of the BlockStored in `out` that announced it
    out: list[Event | None] = list(events)
    cancelled: set[int] = set()
    for i, event in enumerate(events):
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                stored_in[h] = i
            cancelled.difference_update(event.block_hashes)  # stored again: a block of its own from here
        elif isinstance(event, BlockRemoved) and stored_in:
            by_run: dict[int, set[int]] = {}
            for h in event.block_hashes:
                j = stored_in.get(h)
                if j is not None and h not in cancelled:
                    by_run.setdefault(j, set()).add(h)
            gone: set[int] = set()
            for j, hashes in by_run.items():
                run = out[j]
                assert isinstance(run, BlockStored), "a run is trimmed, never replaced by another kind"
                keep = len(run.block_hashes) - len(hashes)
                if set(run.block_hashes[keep:]) != hashes:
                    continue  # not its tail: leave both
                out[j] = _trimmed(run, keep)
                gone |= hashes
            if gone:
                cancelled |= gone
                left = [h for h in event.block_hashes if h not in gone]
                out[i] = BlockRemoved(left, MEDIUM_GPU) if left else None
    if not cancelled:
        return events
    kept = [e for e in out if e is not None]
    if any(isinstance(e, BlockStored) and e.parent_block_hash in cancelled for e in kept):
        return events  # a child outlived a cancelled parent: never so in a tree (leaves go first); publish as is
    return kept


def _trimmed(run: BlockStored, keep: int) -> BlockStored | None:
    if keep == 0:
        return None
    size = len(run.token_ids) // len(run.block_hashes)
    keys = run.extra_keys[:keep] if run.extra_keys is not None else None
    return BlockStored(
        block_hashes=run.block_hashes[:keep],
        parent_block_hash=run.parent_block_hash,
        token_ids=run.token_ids[: keep * size],
        block_size=run.block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=keys if keys is not None and any(k is not None for k in keys) else None,
    )
