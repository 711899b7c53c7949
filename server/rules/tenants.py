"""Tenants: whose namespaces a caller may use, how they are scoped in the core, and its block quota.

With auth on, a tenant's namespace `chat` is `<tenant>/chat` in the core: each tenant's prefixes
live under their own roots, so tenant A's prompt never hits (or times) tenant B's cache, whatever
namespace names the two choose. Without auth every caller is `ANONYMOUS`, whose names pass through.
Each tenant's share of the server-wide limits (`Shares`) and its token budget (`TokenBuckets`) are here too.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from radixkv.errors import PermissionDenied, TokenBudget
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.server.rules.tenant_config import ANY_NAMESPACE, TenantConfig
from radixkv.tree.radix_node import OWNER_SEPARATOR

SCOPE_SEPARATOR = OWNER_SEPARATOR  # a tenant's scoped namespaces are the core's owner's (per-owner eviction)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
    name: str
    namespaces: frozenset[str]
    max_blocks: int | None  # per pool, over the block tables of the tenant's live sequences
    map_pools: bool  # may receive pool handles: mapped memory holds every tenant's K/V
    admin: bool = False  # may call the Debug service
    max_cached_blocks: int | None = None  # per pool, over the tree's blocks in the tenant's namespaces
    max_tokens_per_second: float | None = None  # token bucket over opens' prompt + max_new_tokens, all pools

    @classmethod
    def from_config(cls, config: TenantConfig) -> Tenant:
        return cls(
            name=config.name,
            namespaces=frozenset(config.namespaces),
            max_blocks=config.max_blocks,
            map_pools=config.map_pools,
            admin=config.admin,
            max_cached_blocks=config.max_cached_blocks,
            max_tokens_per_second=config.max_tokens_per_second,
        )

    @property
    def prefix(self) -> str:
        return f"{self.name}{SCOPE_SEPARATOR}" if self.name else ""

    def scope(self, namespace: str, field: str = "namespace") -> str:
        """The core's name for the caller's `namespace` ("" means default).

        Raises:
            PermissionDenied: the tenant may not use this namespace.
        """
        namespace = namespace or DEFAULT_NAMESPACE
        if not self.name:
            return namespace
        if ANY_NAMESPACE not in self.namespaces and namespace not in self.namespaces:
            raise PermissionDenied(
                f"tenant {self.name!r} may not use namespace {namespace!r}",
                field=field,
                namespace=namespace,
                tenant=self.name,
            )
        return self.prefix + namespace

    def unscope(self, core_namespace: str) -> str:
        return core_namespace[len(self.prefix) :]

    def owns(self, core_namespace: str) -> bool:
        return core_namespace.startswith(self.prefix)


ANONYMOUS = Tenant(
    name="", namespaces=frozenset({ANY_NAMESPACE}), max_blocks=None, map_pools=True, admin=True
)  # auth off: every caller is trusted


# -- from rules/shares.py (merged, issue 41: one concept, one module):
# Tenant shares: every server-wide limit split evenly between the configured tenants.
#
# A server-wide limit alone lets one tenant take all of it (every session, every namespace, every
# stream slot) and lock the others out. So each tenant may hold at most its share, `limit //
# num_tenants` (at least 1), and however the others behave, it can always get that much. Without
# auth there is one caller and its share is the whole limit.


@dataclasses.dataclass(frozen=True, slots=True)
class Shares:
    num_tenants: int  # 0 or 1: auth off, or one tenant: no split

    def of(self, limit: int) -> int:
        """One tenant's share of `limit`."""
        if self.num_tenants <= 1:
            return limit
        return max(1, limit // self.num_tenants)


# -- from rules/token_budget.py (merged, issue 41: one concept, one module):
# Per-tenant token budgets: a token bucket every call that adds tokens pays from.
#
# Admission by blocks (the core's NOT_ADMITTED) bounds what fits now; the token budget bounds how
# fast one tenant may ask, as serving guides budget by tokens rather than requests per second. A
# tenant with `max_tokens_per_second` R has a bucket of R tokens (one second's worth) refilled at R
# per second. A call of n tokens needs min(n, R) in the bucket and takes n: a call larger than
# one second's worth is admitted from a full bucket and leaves it in debt, so it is possible but
# the tenant then waits. A refusal says when the bucket will hold enough (`TokenBudget.retry_after_ms`,
# sent as a google.rpc.RetryInfo).
#
# What pays, unary call or Session step alike: an open, `prompt + max_new_tokens`; an append, its
# tokens past those its sequence's open prepaid (`Prepaid`), so a fork's children pay for every token
# they append; a resume, the tokens it hands back to compute (it needs what an open of all its tokens
# would need, min(num_tokens, R), and takes `num_tokens - num_cached_tokens`). Forks, caches, commits,
# releases and preemptions add no token and are free.
#
# `take` and `refund` are atomic under the buckets' own lock, a leaf: the pools' calls take them under
# their pool's lock, and one tenant's bucket serves every pool.


class TokenBuckets:
    """Every tenant's bucket: (tokens, when last refilled), created full on first use."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, tenant: Tenant, num_tokens: int) -> None:
        """Charge `num_tokens` to the tenant's bucket (it needs min(num_tokens, R) there), or raise TokenBudget and
        charge nothing."""
        rate = tenant.max_tokens_per_second
        if rate is None or num_tokens <= 0:
            return
        with self._lock:
            level = self._level(tenant.name, rate)
            needed = min(num_tokens, rate)
            if level < needed:
                retry_after_ms = max(1, math.ceil((needed - level) / rate * 1000))
                raise TokenBudget(tenant.name, num_tokens, retry_after_ms)
            self._buckets[tenant.name] = (level - num_tokens, self._clock())

    def refund(self, tenant: Tenant, num_tokens: int) -> None:
        """Give back what `take` charged for a call refused after it (nothing applied), or charged past its cost."""
        rate = tenant.max_tokens_per_second
        if rate is None or num_tokens <= 0:
            return
        with self._lock:
            self._buckets[tenant.name] = (min(rate, self._level(tenant.name, rate) + num_tokens), self._clock())

    def level(self, tenant: Tenant) -> float | None:
        """Tokens in the tenant's bucket now (None: no budget); for tests and operators."""
        rate = tenant.max_tokens_per_second
        if rate is None:
            return None
        with self._lock:
            return self._level(tenant.name, rate)

    def _level(self, name: str, rate: float) -> float:
        level, since = self._buckets.get(name, (rate, self._clock()))
        return min(rate, level + (self._clock() - since) * rate)


class Prepaid:
    """Tokens each sequence's open paid for ahead (its `max_new_tokens`) and has not appended yet, in one pool.

    An open pays `prompt + max_new_tokens`; the appends that bring those new tokens are then not charged
    again, and every token appended past them is (`cost`). A fork's children start with none (their
    tokens were never stated, so parallel samples pay for each sample), and so does a sequence adopted
    from a previous server's snapshot. Read and changed under the pool's lock, as the ledger that holds it.
    """

    def __init__(self) -> None:
        self._left: dict[int, int] = {}  # seq_id -> tokens still prepaid (> 0)

    def grant(self, seq_id: int, num_tokens: int) -> None:
        if num_tokens > 0:
            self._left[seq_id] = int(num_tokens)

    def cost(self, seq_ids: Sequence[int], counts: Sequence[int]) -> int:
        """Tokens an append of `counts[i]` tokens to each `seq_ids[i]` is charged: those past what each prepaid."""
        total = int(sum(counts))
        left = self._left
        if left:
            for seq_id, count in zip(seq_ids, counts, strict=False):
                prepaid = left.get(seq_id)
                if prepaid:
                    total -= min(prepaid, max(0, int(count)))
        return total

    def draw(self, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
        """After an append applied: what it took of each sequence's prepaid tokens is spent."""
        left = self._left
        if not left:
            return
        for seq_id, count in zip(seq_ids, counts, strict=True):
            prepaid = left.get(seq_id)
            if prepaid:
                if prepaid > count:
                    left[seq_id] = prepaid - count
                else:
                    del left[seq_id]

    def forget(self, seq_id: int) -> None:
        self._left.pop(seq_id, None)

    def left(self, seq_id: int) -> int:
        return self._left.get(seq_id, 0)


# -- from rules/pool_access.py (merged, issue 41: one concept, one module):
# Which tenants may use a pool, and who may map its memory: no tenant gets a writable mapping of another's blocks.
#
# A pool's memory mapping (GetPool's handle, `map_pools`) reads and writes every block of the pool, so it is
# granted only to a `map_pools` tenant that the pool serves alone: a pool naming that tenant as its only
# `tenants` entry (or, unnamed, a server with that one tenant). Another tenant may not use such a pool at all,
# and a pool shared by several tenants is never mapped: its K/V moves only through the server's own calls.
# With auth off every caller is the one trusted tenant and every pool may be mapped.


class PoolTenants(Protocol):
    """What pool access reads of a pool's configuration (`config.PoolConfig`): its name, the tenants it serves."""

    @property
    def name(self) -> str: ...

    @property
    def tenants(self) -> Sequence[str]: ...


class PoolAccess:
    def __init__(self, tenants: Sequence[TenantConfig], pools: Sequence[PoolTenants]) -> None:
        """ValueError (the server refuses to start) for a pool naming a tenant that is not configured."""
        everyone = frozenset(t.name for t in tenants)
        for pool in pools:
            unknown = sorted(set(pool.tenants) - everyone)
            if unknown:
                raise ValueError(f"pool {pool.name!r}: tenants {unknown} are not configured tenants")
        self.auth = bool(tenants)
        self.users = {p.name: frozenset(p.tenants) or everyone for p in pools}

    def check_use(self, pool: str, caller: Tenant) -> None:
        """PermissionDenied naming the pool unless the caller is one of the tenants it serves."""
        if self.auth and caller.name not in self.users[pool]:
            raise PermissionDenied(
                f"tenant {caller.name!r} may not use pool {pool!r} (its tenants: {sorted(self.users[pool])})",
                field="pool",
                pool=pool,
                tenant=caller.name,
            )

    def check_map(self, pool: str, caller: Tenant) -> None:
        """PermissionDenied naming the pool unless the caller may map memory and is the pool's only tenant."""
        if not caller.map_pools:
            raise PermissionDenied(
                f"tenant {caller.name!r} may not map pool memory (map_pools)", field="pool", tenant=caller.name
            )
        others = sorted(self.users[pool] - {caller.name}) if self.auth else []
        if others:
            raise PermissionDenied(
                f"pool {pool!r} also serves tenants {others}: its memory is mapped only by a tenant it serves alone "
                f'(a mapping writes every block; give the tenant its own pool, tenants = ["{caller.name}"])',
                field="pool",
                pool=pool,
                tenant=caller.name,
            )
