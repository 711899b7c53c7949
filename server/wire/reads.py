"""The calls that change nothing: lookups for routers and schedulers, stats, the event stream, verification.

They take the pool's lock only to read a consistent state, and pass no request window (a repeat
answers again). A lookup with a session names one of the caller's own (checked first); routers
probe without one. None of them reveals another tenant's prefixes, namespaces or sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from radixkv.server.events.block_checksums import table_range
from radixkv.server.events.hub import BlockEvent
from radixkv.server.rules.checks import num_tokens
from radixkv.server.rules.miss_reasons import MissExplanation, explain_miss
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.service import KVService
from radixkv.server.rules.tenants import Tenant
from radixkv.stats import Stats
from radixkv.tree.radix_tree import TokenIds, to_token_bytes


class KVReads:
    """The read-only calls of the wire contract, on the service's pools and sessions."""

    def __init__(self, service: KVService) -> None:
        self._service = service
        self._sessions = service.sessions

    def _pool(self, caller: Tenant, session_id: str, pool_name: str) -> Pool:
        """The pool, after checking the session when one is named."""
        pool = self._service.pool(pool_name, caller)
        if session_id:
            self._sessions.get(session_id, caller)
        return pool

    # -- the session's sequences (under the preamble every call on a session passes) -----------------

    def describe_sequences(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(num_tokens, num_computed_tokens) of each of the session's sequences."""
        pool, session = self._service.pool(pool_name, caller), self._sessions.get(session_id, caller)
        with self._service.checks.locked(pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            return [(pool.cache.num_tokens(s), pool.cache.num_computed_tokens(s)) for s in seq_ids]

    def block_checksums(
        self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, first_block: int, num_blocks: int
    ) -> list[bytes]:
        """The writers' digests recorded for the session's sequence's blocks (b"": none;
        server/events/block_checksums.py)."""
        pool, session = self._service.pool(pool_name, caller), self._sessions.get(session_id, caller)
        with self._service.checks.locked(pool, session):
            pool.ledger.check_owner(session, seq_id)
            blocks = table_range(pool.cache.block_table(seq_id), first_block, num_blocks, "num_blocks")
            return pool.events.checksums.get(blocks)

    def can_append(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_token_ids: Sequence[int]
    ) -> tuple[bool, int]:
        """(would this append fit the pool now, blocks available)."""
        pool, session = self._service.pool(pool_name, caller), self._sessions.get(session_id, caller)
        with self._service.checks.locked(pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            return pool.cache.can_append(seq_ids, num_token_ids), pool.cache.num_available_blocks()

    def freeable_blocks(self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int]) -> int:
        """Blocks releasing the session's `seq_ids` together would make available."""
        pool, session = self._service.pool(pool_name, caller), self._sessions.get(session_id, caller)
        with self._service.checks.locked(pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            return pool.cache.freeable_blocks(seq_ids)

    def victims(self, caller: Tenant, session_id: str, pool_name: str, num_blocks: int) -> list[int]:
        """Which of the session's live sequences to preempt for `num_blocks` (see `KVCache.victims`)."""
        pool, session = self._service.pool(pool_name, caller), self._sessions.get(session_id, caller)
        with self._service.checks.locked(pool, session):
            cache = pool.cache
            candidates = [s for s in pool.ledger.sequences_of(session) if not cache.is_preempted(s)]
            return cache.victims(num_blocks, candidates)

    # -- prefixes ---------------------------------------------------------------------------------

    def _probe(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str
    ) -> tuple[Pool, str, bytes]:
        """The pool, the tenant's namespace and the token key of a lookup; its size checked before the tokens are
        converted."""
        pool = self._service.pool(pool_name, caller)
        self._service.checks.check_size(pool, num_tokens(token_ids))
        if session_id:
            self._sessions.get(session_id, caller)
        return pool, caller.scope(namespace), to_token_bytes(token_ids)

    def match(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str
    ) -> tuple[int, int, int]:
        """(device tokens, host tokens, disk tokens): `KVCache.match_tiers`, then what the disk tier continues."""
        pool, core_namespace, key = self._probe(caller, session_id, pool_name, token_ids, namespace)
        with pool.lock:
            num_cached, num_host = pool.cache.match_tiers(key, core_namespace)
            num_disk = pool.disk.num_on_disk_tokens(key, core_namespace) if pool.disk is not None else 0
        return num_cached, num_host, num_disk

    def explain_match(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str
    ) -> tuple[int, int, int, MissExplanation]:
        """`match`, and why the device's cached prefix ends there (hashes one block; see `miss_reasons`)."""
        pool, core_namespace, key = self._probe(caller, session_id, pool_name, token_ids, namespace)
        with pool.lock:
            num_cached, num_host = pool.cache.match_tiers(key, core_namespace)
            num_disk = pool.disk.num_on_disk_tokens(key, core_namespace) if pool.disk is not None else 0
            explanation = explain_miss(pool.cache, pool.events, caller, key, core_namespace, num_cached)
            reason = explanation.reason.name
            pool.num_miss_tokens[reason] = pool.num_miss_tokens.get(reason, 0) + explanation.num_missed_tokens
        return num_cached, num_host, num_disk, explanation

    # -- pool-wide --------------------------------------------------------------------------------

    def stats(self, caller: Tenant, session_id: str, pool_name: str) -> tuple[Stats, int, int, int]:
        """The pool's counters, its available blocks, and its evicted block hashes remembered (count, bytes)."""
        pool = self._pool(caller, session_id, pool_name)
        with pool.lock:
            tombstones = pool.events.tombstones
            return pool.cache.stats(), pool.cache.num_available_blocks(), len(tombstones), tombstones.num_bytes

    def get_pool(self, caller: Tenant, session_id: str, pool_name: str) -> Pool:
        """The pool, for its layout and handle; only tenants trusted to map pool memory get one."""
        pool = self._pool(caller, session_id, pool_name)
        self._service.access.check_map(pool.name, caller)
        return pool

    def watch_events(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        namespaces: Sequence[str],
        include_snapshot: bool,
        is_active: Callable[[], bool],
    ) -> Iterator[tuple[list[BlockEvent], bool, int]]:
        """Batches of events (first the snapshot, if asked) until the caller leaves or the server stops.

        Validates now, so errors surface before the stream starts; the stream's slot and watcher
        are taken when the first batch is asked for (`WatchStreams.stream`).
        """
        pool = self._pool(caller, session_id, pool_name)
        scoped = frozenset(caller.scope(ns, f"namespaces[{i}]") for i, ns in enumerate(namespaces))
        accepts = scoped.__contains__ if scoped else caller.owns
        return self._service.streams.stream(pool, caller, accepts, include_snapshot, is_active)

    def verify(self, caller: Tenant, session_id: str, pool_name: str) -> tuple[Pool, dict[str, tuple[int, int]], int]:
        """The pool, the caller's namespaces (its own names) -> (digest, num_blocks), and the event count they
        are current to: its tenant's (the pool's, auth off). Only the caller's own: a tenant never learns another's
        namespaces, nor how active another is."""
        pool = self._pool(caller, session_id, pool_name)
        with pool.lock:
            hub = pool.events
            digests = {
                caller.unscope(ns): (digest, hub.num_blocks[ns])
                for ns, digest in hub.digests.items()
                if caller.owns(ns)
            }
            return pool, digests, hub.num_events_seen_by(caller.prefix)

    def check_invariants(self, pool: Pool) -> None:
        """Raises AssertionError naming the first broken invariant of the core or of the server's bookkeeping."""
        with pool.lock:
            pool.cache.check_invariants()
            pool.ledger.check_invariants(pool.cache)
            for session in self._sessions.live():
                assert len(pool.ledger.pins(session)) <= self._service.checks.max_pins, "a session holds too many pins"
                session.requests.check_invariants()
