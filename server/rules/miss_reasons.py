"""Why a Match's cached prefix ends where it does (`MatchRequest.explain`).

Only computed on request: the plain Match path hashes nothing. The first uncached block is hashed
with the vLLM chain (`radixkv.tree.block_hash`, salted by namespace) and looked up in the event hub's
tombstones; failing that, the same tokens are matched in the caller's other namespaces. A tenant
only ever sees its own namespaces and its own tombstones: another tenant's identical prefix is, for
it, NEVER_CACHED.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import cast

import numpy as np

from radixkv.kv_cache import KVCache
from radixkv.server.events.hub import EventHub
from radixkv.server.rules.tenant_config import ANY_NAMESPACE
from radixkv.server.rules.tenants import Tenant
from radixkv.tree.block_hash import chain_hashes, wire_hash
from radixkv.tree.radix_tree import existing_root
from radixkv.v1 import kvcache_pb2 as pb

MAX_OTHER_NAMESPACES = 16  # namespaces fully matched for OTHER_NAMESPACE, so an explain stays cheap


class MissReason(enum.Enum):
    FULLY_CACHED = 1
    NEVER_CACHED = 2
    EVICTED = 3
    PARTIAL_BLOCK = 4
    OTHER_NAMESPACE = 5
    LAST_TOKEN = 6  # open only
    HOST_TIER = 7  # Match only: the prefix continues in the host tier (an open loads it back)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MissExplanation:
    reason: MissReason
    block_index: int  # the first uncached block
    num_missed_tokens: int  # tokens after the cached prefix
    evicted_at_unix_ns: int = 0  # EVICTED
    other_namespace: str = ""  # OTHER_NAMESPACE: the caller's name for it


def wire_reason(why: MissExplanation) -> pb.MissReason:
    """The wire enum of a miss reason; protobuf enum values are ints at run time, the stubs name the enum."""
    return cast(pb.MissReason, pb.MissReason.Value(f"MISS_REASON_{why.reason.name}"))


def _starts_with(cache: KVCache, core_namespace: str, first_block: bytes) -> bool:
    root = cache.tree.roots.get(core_namespace)
    return root is not None and first_block in root.children


def _visible(caller: Tenant, core_namespace: str) -> bool:
    if not caller.owns(core_namespace):
        return False
    return ANY_NAMESPACE in caller.namespaces or caller.unscope(core_namespace) in caller.namespaces


def explain_open(cache: KVCache, events: EventHub, caller: Tenant, key: bytes, core_namespace: str) -> MissExplanation:
    """Before `open`: what its cached prefix will be and why. Call under the pool's lock, then `after_open`.

    An open loads the host tier's continuation back, so its prefix ends past both tiers (never HOST_TIER)."""
    num_device, num_host = cache.match_tiers(key, core_namespace)
    return explain_miss(cache, events, caller, key, core_namespace, num_device + num_host)


def after_open(before: MissExplanation, num_cached_tokens: int, block_size: int) -> MissExplanation:
    """`before` (from `explain_open`), corrected by what open served: a fully cached prompt leaves its
    last token (so at least its last block) to compute."""
    if before.reason is MissReason.FULLY_CACHED and before.num_missed_tokens == 0:
        num_tokens = before.block_index * block_size
        if num_cached_tokens < num_tokens:
            return MissExplanation(
                reason=MissReason.LAST_TOKEN,
                block_index=num_cached_tokens // block_size,
                num_missed_tokens=num_tokens - num_cached_tokens,
            )
    return before


def _last_cached_hash(cache: KVCache, events: EventHub, key: bytes, core_namespace: str) -> bytes | None:
    """The hub's hash of the last cached block of `key`'s prefix (None: nothing cached), so the first
    uncached block is hashed alone instead of re-hashing the whole chain."""
    root = existing_root(cache.tree, core_namespace)
    if root is None:
        return None
    match = cache.tree.match(root, key)
    if match.num_blocks == 0:
        return None
    node = match.node
    if match.num_blocks_in_node:
        block_id = node.block_ids[match.num_blocks_in_node - 1]
    else:  # the match ends where `node` begins: its last block is the parent's (a node, not a root, as blocks matched)
        assert node.parent is not None, "a match of some blocks ends below a namespace's root"
        block_id = node.parent.block_ids[-1]
    return events.hashes[int(block_id)]


def explain_miss(
    cache: KVCache, events: EventHub, caller: Tenant, key: bytes, core_namespace: str, num_cached: int
) -> MissExplanation:
    """Classify the end of the cached prefix of `key` (int32 token bytes). Call under the pool's lock."""
    block_size = cache.block_size
    num_tokens = len(key) // 4
    index, num_missed = num_cached // block_size, num_tokens - num_cached
    if num_missed == 0:
        return MissExplanation(reason=MissReason.FULLY_CACHED, block_index=index, num_missed_tokens=0)
    if num_missed < block_size:
        return MissExplanation(reason=MissReason.PARTIAL_BLOCK, block_index=index, num_missed_tokens=num_missed)
    num_device, num_host = cache.match_tiers(key, core_namespace)
    if num_device <= num_cached < num_device + num_host:  # the next block is host-resident: checked first, since
        return MissExplanation(
            reason=MissReason.HOST_TIER, block_index=index, num_missed_tokens=num_missed
        )  # its device eviction left a tombstone
    block = np.frombuffer(key, dtype="<i4")[index * block_size : (index + 1) * block_size].tolist()
    wire = wire_hash(
        chain_hashes(block, block_size, core_namespace, _last_cached_hash(cache, events, key, core_namespace))[0]
    )
    evicted_at = events.tombstones.evicted_at(wire, core_namespace)
    if evicted_at is not None:
        return MissExplanation(
            reason=MissReason.EVICTED, block_index=index, num_missed_tokens=num_missed, evicted_at_unix_ns=evicted_at
        )
    # Every visible namespace is screened by its first block, O(1) each (the pool's max_namespaces bounds
    # them); only those that start the same way are matched in full.
    first_block = key[: block_size * 4]
    others = [
        ns
        for ns in sorted(events.num_blocks)
        if ns != core_namespace and _visible(caller, ns) and _starts_with(cache, ns, first_block)
    ]
    for other in others[:MAX_OTHER_NAMESPACES]:
        if cache.match(key, other) > num_cached:
            return MissExplanation(
                reason=MissReason.OTHER_NAMESPACE,
                block_index=index,
                num_missed_tokens=num_missed,
                other_namespace=caller.unscope(other),
            )
    return MissExplanation(reason=MissReason.NEVER_CACHED, block_index=index, num_missed_tokens=num_missed)
