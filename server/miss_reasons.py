"""Why a Match's cached prefix ends where it does (`MatchRequest.explain`).

Only computed on request: the plain Match path hashes nothing. The first uncached block is hashed
with the vLLM chain (`radixkv.block_hash`, salted by namespace) and looked up in the event hub's
tombstones; failing that, the same tokens are matched in the caller's other namespaces. A tenant
only ever sees its own namespaces and its own tombstones: another tenant's identical prefix is, for
it, NEVER_CACHED.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from radixkv.block_hash import chain_hashes, wire_hash
from radixkv.server.config import ANY_NAMESPACE
from radixkv.server.pools import Pool
from radixkv.server.tenants import Tenant

MAX_OTHER_NAMESPACES = 16  # namespaces matched for OTHER_NAMESPACE, so an explain stays cheap


class MissReason(enum.Enum):
    FULLY_CACHED = 1
    NEVER_CACHED = 2
    EVICTED = 3
    PARTIAL_BLOCK = 4
    OTHER_NAMESPACE = 5


@dataclasses.dataclass(frozen=True, slots=True)
class MissExplanation:
    reason: MissReason
    block_index: int  # the first uncached block
    num_missed_tokens: int  # tokens after the cached prefix
    evicted_at_unix_ns: int = 0  # EVICTED
    other_namespace: str = ""  # OTHER_NAMESPACE: the caller's name for it


def _visible(caller: Tenant, core_namespace: str) -> bool:
    if not caller.owns(core_namespace):
        return False
    return ANY_NAMESPACE in caller.namespaces or caller.unscope(core_namespace) in caller.namespaces


def explain_miss(pool: Pool, caller: Tenant, key: bytes, core_namespace: str, num_cached: int) -> MissExplanation:
    """Classify the end of the cached prefix of `key` (int32 token bytes). Call under the pool's lock."""
    block_size = pool.layout.block_size
    num_tokens = len(key) // 4
    index, num_missed = num_cached // block_size, num_tokens - num_cached
    if num_missed == 0:
        return MissExplanation(MissReason.FULLY_CACHED, index, 0)
    if num_missed < block_size:
        return MissExplanation(MissReason.PARTIAL_BLOCK, index, num_missed)
    tokens = np.frombuffer(key, dtype="<i4")[: (index + 1) * block_size].tolist()
    wire = wire_hash(chain_hashes(tokens, block_size, core_namespace)[index])
    evicted_at = pool.events.tombstones.evicted_at(wire, core_namespace)
    if evicted_at is not None:
        return MissExplanation(MissReason.EVICTED, index, num_missed, evicted_at_unix_ns=evicted_at)
    others = [ns for ns in sorted(pool.events.num_blocks) if ns != core_namespace and _visible(caller, ns)]
    for other in others[:MAX_OTHER_NAMESPACES]:
        if pool.cache.match(key, other) > num_cached:
            return MissExplanation(MissReason.OTHER_NAMESPACE, index, num_missed, other_namespace=caller.unscope(other))
    return MissExplanation(MissReason.NEVER_CACHED, index, num_missed)
