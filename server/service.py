"""The server's domain layer: sessions own sequences, tenants own namespaces and quotas, pools serialise the core.

Threading model: gRPC runs each RPC on a thread of a fixed pool (`max_workers`); the lease reaper
is one more thread. Each pool has one lock (`Pool.lock`), held around every call into its `KVCache`
together with the bookkeeping that must agree with the core (`Pool.ledger`: which session owns
each sequence, each tenant's blocks, each session's pins) and the pool's event hub. So calls on
one pool run one at a time, whole (a batch is never interleaved with another call), and calls on
different pools do not wait for each other. The session registry has its own lock, never held
while a pool lock is taken. Ending a session marks it closed first and then takes each pool's
lock to release what it holds; every pool-locked section re-checks the mark (`_in_session`), so
no sequence can join a session that is being torn down. The other locks (the stream counts, each
watcher's queue, each session's request window) are leaves: nothing is taken while one is held.

A call either applies and its response can reach the client, or it changes nothing:
  - sizes are checked first, before any token list is converted and outside the pool's lock:
    the pool's `max_tokens_per_request`, and the response the call would produce against the
    server's `max_message_bytes` (a response over it would be lost after the call applied);
  - after taking the pool's lock, a call whose deadline has passed is refused (`check_deadline`);
  - then ownership, limits, tenant shares and quota are checked, then the core (which changes
    nothing when it refuses) is called, then the ledger follows its result;
  - a mutating call with a `request_id` runs once per session (`RequestWindow.once`): a retry is
    answered with the first result.

Sessions that end (closed, expired, server shutdown) release their sequences with cache=False:
the server cannot know whether a dead client's workers finished writing those blocks' K/V, and a
cached block with unwritten K/V would serve garbage to the next prompt that hits it. Their pins go too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from radixkv.errors import (
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
    ServerRestarting,
    TokenBudget,
    UnknownPool,
    UnknownSession,
)
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.server.block_checksums import table_range
from radixkv.server.config import DEFAULT_POOL, ServerConfig
from radixkv.server.deadlines import check_deadline
from radixkv.server.events import BlockEvent
from radixkv.server.ledger import Pin
from radixkv.server.miss_reasons import MissExplanation, after_open, explain_miss, explain_open
from radixkv.server.pools import Pool
from radixkv.server.restart import Written, snapshot_all
from radixkv.server.sessions import Session, SessionRegistry
from radixkv.server.shares import Shares
from radixkv.server.sizes import append_response_bytes, check_request_size, open_response_bytes
from radixkv.server.streams import WatchStreams
from radixkv.server.tenants import Tenant
from radixkv.server.token_budget import TokenBuckets
from radixkv.stats import Stats
from radixkv.tree.token_ids import TOKEN_BYTES, TokenIds, to_token_bytes


class KVService:
    """Every operation the wire contract offers, as typed calls on behalf of a caller (a `Tenant`)."""

    def __init__(self, config: ServerConfig, pools: dict[str, Pool]) -> None:
        self.pools = pools
        self.shares = Shares(len(config.tenants))
        self.sessions = SessionRegistry(
            config.session_ttl_seconds,
            config.max_session_ttl_seconds,
            config.max_sessions,
            self._end_session,
            self.shares.of(config.max_sessions),
        )
        assert config.max_watch_streams is not None
        self.streams = WatchStreams(config.max_watch_streams, self.shares.of(config.max_watch_streams))
        self.max_message_bytes = config.max_message_bytes
        self._max_sequences = config.max_sequences_per_session
        self._max_pins = config.max_pins_per_session
        self._max_pool_sequences = config.max_sequences
        self.token_buckets = TokenBuckets()
        self.stop_requested = threading.Event()  # SIGTERM or Upgrade: the process stops gracefully

    def start(self) -> None:
        self.sessions.start()

    def upgrade(self, caller: Tenant) -> list[Written]:
        """Freeze every kept pool, write its snapshot, and ask the process to stop (the `Upgrade` RPC).

        Raises:
            PermissionDenied: the caller is not an admin tenant.
            FailedPrecondition: no pool's memory is held by a live keeper: a restart would lose it all.
        """
        if not caller.admin:
            raise PermissionDenied(f"tenant {caller.name!r} may not call Upgrade (admin)", tenant=caller.name)
        if not any(pool.restart_safe() for pool in self.pools.values()):
            raise FailedPrecondition("no live keeper holds this server's pools: a restart would lose the cache")
        written = snapshot_all(self.pools, self.sessions)
        self.stop_requested.set()
        return written

    def close(self) -> None:
        """Shutdown: end every session (releasing its sequences), end event streams, free the pools."""
        self.sessions.stop()
        for pool in self.pools.values():
            pool.close()

    def pool(self, name: str) -> Pool:
        pool = self.pools.get(name or DEFAULT_POOL)
        if pool is None:
            raise UnknownPool(name or DEFAULT_POOL)
        return pool

    @contextlib.contextmanager
    def _in_session(self, caller: Tenant, session_id: str, pool_name: str) -> Iterator[tuple[Pool, Session]]:
        """The preamble of every session call: find the pool and session, take the pool's lock, and
        refuse a session ended meanwhile or a call whose deadline passed while it waited."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            if session.closed:
                raise UnknownSession(session.session_id)
            if pool.frozen:
                raise ServerRestarting()
            check_deadline()
            yield pool, session

    # -- sessions ---------------------------------------------------------------------------------

    def open_session(self, caller: Tenant, ttl_seconds: float) -> Session:
        return self.sessions.open(caller, ttl_seconds)

    def keep_alive(self, caller: Tenant, session_id: str) -> float:
        return self.sessions.get(session_id, caller).ttl

    def close_session(self, caller: Tenant, session_id: str) -> int:
        """End a session now; returns how many sequences it still held."""
        return self.sessions.close(session_id, caller)

    def _end_session(self, session: Session, why: str) -> int:
        num_released = 0
        for pool in self.pools.values():  # all pools: one may gain its first sequence of this session meanwhile
            with pool.lock:
                if pool.frozen:  # its snapshot holds the session: the next server's lease ends it
                    continue
                seq_ids, pins = pool.ledger.take_session(session)
                if seq_ids:
                    pool.cache.release_many(seq_ids, cache=False)
                for pin in pins:
                    pool.cache.unpin(pin.token_bytes, pin.namespace)
                num_released += len(seq_ids)
        return num_released

    # -- sequences --------------------------------------------------------------------------------

    def open_sequences(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        prompts: Sequence[tuple[TokenIds, str]],
        request_id: int = 0,
        explanations: list[MissExplanation] | None = None,
        max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[OpenResult]:
        """Open a batch of prompts, all or none (the whole batch counts against the request limits).

        `explanations`, when given, receives why each prompt's cached prefix ends where it does (nothing
        on a retry answered from the request window: the batch is not applied again). `max_new_tokens`
        and `priorities`: per prompt, as `KVCache.open_many` takes them; the prompts and budgets are
        charged to the tenant's token bucket (`token_budget`).
        """
        pool = self.pool(pool_name)
        counts = [_num_tokens(t) for t, _ in prompts]
        check_request_size(pool, sum(counts), open_response_bytes(pool, counts), self.max_message_bytes)
        batch = len(prompts) > 1
        requests = [
            (to_token_bytes(t, f"prompts[{i}].token_ids" if batch else "token_ids"),
             caller.scope(ns, f"prompts[{i}].namespace" if batch else "namespace"))
            for i, (t, ns) in enumerate(prompts)
        ]  # fmt: skip
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> list[OpenResult]:
                if not requests:
                    return []
                ledger = pool.ledger
                self.check_num_sequences(pool, session, len(requests))
                self.check_namespaces(pool, caller, {ns for _, ns in requests})
                ledger.check_quota(caller, ledger.blocks_to_open(pool.cache, counts, max_new_tokens))
                before = None
                if explanations is not None:
                    before = [explain_open(pool.cache, pool.events, caller, key, ns) for key, ns in requests]
                cost = sum(counts) + sum(max_new_tokens or ())
                self.take_tokens(pool, caller, cost)
                try:
                    results = pool.cache.open_many(requests, max_new_tokens=max_new_tokens, priorities=priorities)
                except BaseException:
                    self.token_buckets.refund(caller, cost)
                    raise
                ledger.adopt_opened(session, pool.cache, results, max_new_tokens)
                if before is not None and explanations is not None:
                    size = pool.layout.block_size
                    pairs = zip(before, results, strict=True)
                    explanations[:] = [after_open(b, r.num_cached_tokens, size) for b, r in pairs]
                return results

            return session.requests.once(
                request_id,
                f"OpenSequences {pool.name}",
                apply,
                lambda rs: sum(len(r.block_table) + 1 for r in rs) + sum(counts),
            )

    def append_tokens(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        seq_ids: Sequence[int],
        num_token_ids: Sequence[int],
        token_ids: TokenIds,
        request_id: int = 0,
    ) -> AppendBatch:
        """One decode step, in columns (see `KVCache.append_batch`)."""
        pool = self.pool(pool_name)
        num_tokens = _num_tokens(token_ids)
        check_request_size(
            pool, num_tokens, append_response_bytes(pool, len(seq_ids), num_tokens), self.max_message_bytes
        )
        token_ids = _as_int32(token_ids)
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> AppendBatch:
                if not seq_ids and not num_token_ids and not num_tokens:
                    return AppendBatch(
                        [], [], [], [], [], [], [], np.empty(0, dtype=np.int64)
                    )  # an empty step: a no-op
                ledger = pool.ledger
                ledger.check_owners(session, list(seq_ids))
                if caller.max_blocks is not None:
                    ledger.check_quota(caller, ledger.append_growth(pool.cache, seq_ids, num_token_ids))
                cost = ledger.prepaid.cost(seq_ids, num_token_ids) if caller.max_tokens_per_second is not None else 0
                self.take_tokens(pool, caller, cost)
                try:
                    batch = pool.cache.append_batch(seq_ids, num_token_ids, token_ids)
                except BaseException:
                    self.token_buckets.refund(caller, cost)
                    raise
                ledger.follow_append(session, batch)
                return batch

            return session.requests.once(
                request_id, f"AppendTokens {pool.name}", apply, lambda b: len(b.block_ids) + len(b.seq_ids) + num_tokens
            )

    def fork(
        self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, num_children: int, request_id: int = 0
    ) -> list[int]:
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> list[int]:
                ledger = pool.ledger
                ledger.check_owner(session, seq_id)
                self.check_num_sequences(pool, session, num_children)
                num_blocks = ledger.num_table_blocks(seq_id)
                ledger.check_quota(caller, max(num_children, 0) * num_blocks)
                children = pool.cache.fork(seq_id, num_children)
                for child in children:
                    ledger.adopt(session, child, num_blocks)
                self.keep_cache_share(pool, caller)
                return children

            return session.requests.once(request_id, f"ForkSequence {pool.name}", apply, len)

    def cache_sequence(self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, request_id: int = 0) -> int:
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> int:
                pool.ledger.check_owner(session, seq_id)
                num_cached = pool.cache.cache(seq_id)
                self.keep_cache_share(pool, caller)
                return num_cached

            return session.requests.once(request_id, f"CacheSequence {pool.name}", apply)

    def release(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], cache: bool, request_id: int = 0
    ) -> int:
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> int:
                ledger = pool.ledger
                ledger.check_owners(session, list(seq_ids))
                if seq_ids:
                    pool.cache.release_many(seq_ids, cache)
                for seq_id in seq_ids:
                    ledger.forget(seq_id)
                if cache:
                    self.keep_cache_share(pool, caller)
                return len(seq_ids)

            return session.requests.once(request_id, f"ReleaseSequences {pool.name}", apply)

    def commit(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_tokens: Sequence[int]
    ) -> None:
        """Advance the computed watermarks of the session's sequences (see `KVCache.commit`).

        Needs no request window: committing the same watermark again changes nothing."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            pool.cache.commit(seq_ids, num_tokens)

    def describe_sequences(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(num_tokens, num_computed_tokens) of each of the session's sequences."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            return [(pool.cache.num_tokens(s), pool.cache.num_computed_tokens(s)) for s in seq_ids]

    def record_block_checksums(
        self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, first_block: int, checksums: Sequence[int]
    ) -> int:
        """Attach writers' K/V checksums to the sequence's blocks the tree holds (server/block_checksums.py)."""
        if any(c == 0 for c in checksums):
            raise InvalidArgument("checksums", "a checksum is nonzero (0 reads as none)")
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            pool.ledger.check_owner(session, seq_id)
            blocks = table_range(pool.cache.block_table(seq_id), first_block, len(checksums), "first_block")
            held = [i for i, b in enumerate(blocks) if pool.events.hashes.get(b) is not None]  # in the tree
            return pool.events.checksums.record([blocks[i] for i in held], [checksums[i] for i in held])

    def get_block_checksums(
        self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, first_block: int, num_blocks: int
    ) -> list[int]:
        """The checksums recorded for the session's sequence's blocks (0: none)."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            pool.ledger.check_owner(session, seq_id)
            blocks = table_range(pool.cache.block_table(seq_id), first_block, num_blocks, "num_blocks")
            return pool.events.checksums.get(blocks)

    def can_append(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_token_ids: Sequence[int]
    ) -> tuple[bool, int]:
        """(would this append fit the pool now, blocks available); changes nothing."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            return pool.cache.can_append(seq_ids, num_token_ids), pool.cache.num_available_blocks()

    def freeable_blocks(self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int]) -> int:
        """Blocks releasing the session's `seq_ids` together would make available; changes nothing."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            pool.ledger.check_owners(session, list(seq_ids))
            return pool.cache.freeable_blocks(seq_ids)

    # -- preemption (see `radixkv.pressure.preemption`) ------------------------------------------------------

    def preempt(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], mode: str, request_id: int = 0
    ) -> PreemptResult:
        """Preempt the session's sequences, all or none; they stay the session's, holding no block."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> PreemptResult:
                ledger, cache = pool.ledger, pool.cache
                ledger.check_owners(session, list(seq_ids))
                if mode == "swap" and cache.host is not None:
                    needed = sum(cache.swap_blocks(s) for s in seq_ids if not cache.is_preempted(s))
                    ledger.check_host_blocks(caller, needed, self.host_share(pool))
                result = cache.preempt(seq_ids, mode)
                for seq_id in result.seq_ids:
                    ledger.preempted(seq_id, cache.swap_blocks(seq_id))
                self.keep_cache_share(pool, caller)  # recompute cached their blocks, as a cached release does
                return result

            return session.requests.once(
                request_id, f"Preempt {pool.name}", apply, lambda r: len(r.seq_ids) + 2 * len(r.offloads) + 1
            )

    def resume(self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, request_id: int = 0) -> ResumeResult:
        """Resume one of the session's preempted sequences; its blocks count against the tenant's quota again."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> ResumeResult:
                ledger, cache = pool.ledger, pool.cache
                ledger.check_owner(session, seq_id)
                cost = 0
                if cache.is_preempted(seq_id):
                    ledger.check_quota(caller, ledger.blocks_to_resume(cache, seq_id))
                    cost = cache.num_tokens(seq_id)  # needs what an open of them would; pays what it hands back
                    self.take_tokens(pool, caller, cost)
                try:
                    result = cache.resume(seq_id)  # raises for a live sequence
                except BaseException:
                    self.token_buckets.refund(caller, cost)
                    raise
                self.token_buckets.refund(caller, result.num_cached_tokens)  # not computed again: not charged
                ledger.resumed(seq_id, len(result.block_table))
                return result

            return session.requests.once(
                request_id, f"Resume {pool.name}", apply, lambda r: 2 * len(r.block_table) + len(r.loads) + 1
            )

    def victims(self, caller: Tenant, session_id: str, pool_name: str, num_blocks: int) -> list[int]:
        """Which of the session's live sequences to preempt for `num_blocks` (see `KVCache.victims`)."""
        with self._in_session(caller, session_id, pool_name) as (pool, session):
            cache = pool.cache
            candidates = [s for s in pool.ledger.sequences_of(session) if not cache.is_preempted(s)]
            return cache.victims(num_blocks, candidates)

    def take_tokens(self, pool: Pool, caller: Tenant, num_tokens: int) -> None:
        """Charge a call's tokens to the caller's token bucket (under `pool.lock`, which counts refusals); what
        each call pays: `radixkv.server.token_budget`."""
        try:
            self.token_buckets.take(caller, num_tokens)
        except TokenBudget:
            pool.num_token_budget_refusals += 1
            raise

    def num_available_blocks(self, pool_name: str) -> int:
        pool = self.pool(pool_name)
        with pool.lock:
            return pool.cache.num_available_blocks()

    def tombstones(self, pool_name: str) -> tuple[int, int]:
        """(evicted block hashes remembered, their estimated bytes) for Stats."""
        pool = self.pool(pool_name)
        with pool.lock:
            return len(pool.events.tombstones), pool.events.tombstones.num_bytes

    # -- prefixes ---------------------------------------------------------------------------------

    def _probe(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str
    ) -> tuple[Pool, str, bytes]:
        """What a read-only lookup checks first: the pool, the size, the session if one is named (routers
        probe without one); returns the pool, the tenant's namespace and the token key."""
        pool = self.pool(pool_name)
        check_request_size(pool, _num_tokens(token_ids))
        if session_id:
            self.sessions.get(session_id, caller)
        return pool, caller.scope(namespace), to_token_bytes(token_ids)

    def match(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str
    ) -> tuple[int, int]:
        """(device tokens, host tokens), as `KVCache.match_tiers`. Read-only; a session is optional (routers
        probe without one)."""
        pool, core_namespace, key = self._probe(caller, session_id, pool_name, token_ids, namespace)
        with pool.lock:
            return pool.cache.match_tiers(key, core_namespace)

    def explain_match(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str
    ) -> tuple[int, int, MissExplanation]:
        """`match` (device tokens, host tokens), and why the device's cached prefix ends there (hashes one block;
        see `miss_reasons`)."""
        pool, core_namespace, key = self._probe(caller, session_id, pool_name, token_ids, namespace)
        with pool.lock:
            num_cached, num_host = pool.cache.match_tiers(key, core_namespace)
            explanation = explain_miss(pool.cache, pool.events, caller, key, core_namespace, num_cached)
            reason = explanation.reason.name
            pool.num_miss_tokens[reason] = pool.num_miss_tokens.get(reason, 0) + explanation.num_missed_tokens
        return num_cached, num_host, explanation

    def pin(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str, request_id: int = 0
    ) -> int:
        """Pin the cached prefix until Unpin or the session's end; returns tokens pinned.

        The prefix's blocks count against the tenant's block quota and its share of the pinned blocks.
        """
        check_request_size(self.pool(pool_name), _num_tokens(token_ids))
        core_namespace, key = caller.scope(namespace), to_token_bytes(token_ids)
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> int:
                ledger = pool.ledger
                num_pins = len(ledger.pins(session))
                if num_pins >= self._max_pins:
                    raise LimitExceeded("max_pins_per_session", num_pins + 1, self._max_pins)
                num_blocks = pool.cache.match(key, core_namespace) // pool.layout.block_size
                ledger.check_quota(caller, num_blocks)
                share = self.shares.of(int(pool.cache.limits.max_pinned_fraction * pool.layout.num_blocks))
                pinned = ledger.tenant_pinned_blocks(caller)
                if self.shares.num_tenants > 1 and pinned + num_blocks > share:
                    raise LimitExceeded("pinned_blocks_per_tenant", pinned + num_blocks, share)
                num_pinned = pool.cache.pin(key, core_namespace)
                ledger.add_pin(
                    session, Pin(core_namespace, key[: num_pinned * TOKEN_BYTES], num_pinned // pool.layout.block_size)
                )
                return num_pinned

            return session.requests.once(request_id, f"Pin {pool.name}", apply)

    def unpin(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str, request_id: int = 0
    ) -> None:
        """Drop this session's longest pin on a prefix of `token_ids` (pins are the session's own)."""
        check_request_size(self.pool(pool_name), _num_tokens(token_ids))
        core_namespace, key = caller.scope(namespace), to_token_bytes(token_ids)
        with self._in_session(caller, session_id, pool_name) as (pool, session):

            def apply() -> None:
                pin = pool.ledger.take_pin(session, core_namespace, key)
                pool.cache.unpin(pin.token_bytes, core_namespace)

            session.requests.once(request_id, f"Unpin {pool.name}", apply)

    # -- pool-wide --------------------------------------------------------------------------------

    def stats(self, caller: Tenant, session_id: str, pool_name: str) -> Stats:
        pool = self.pool(pool_name)
        if session_id:
            self.sessions.get(session_id, caller)
        with pool.lock:
            return pool.cache.stats()

    def get_pool(self, caller: Tenant, session_id: str, pool_name: str) -> Pool:
        """The pool, for its layout and handle; only tenants trusted to map pool memory get one."""
        pool = self.pool(pool_name)
        if session_id:
            self.sessions.get(session_id, caller)
        if not caller.map_pools:
            raise PermissionDenied(
                f"tenant {caller.name!r} may not map pool memory (map_pools)", field="pool", tenant=caller.name
            )
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
        pool = self.pool(pool_name)
        if session_id:
            self.sessions.get(session_id, caller)
        scoped = frozenset(caller.scope(ns, f"namespaces[{i}]") for i, ns in enumerate(namespaces))
        accepts = scoped.__contains__ if scoped else caller.owns
        return self.streams.stream(pool, caller, accepts, include_snapshot, is_active)

    def verify(self, caller: Tenant, session_id: str, pool_name: str) -> tuple[Pool, dict[str, tuple[int, int]], int]:
        """The pool, the caller's namespaces (its own names) -> (digest, num_blocks), and the event count they
        are current to. Only the caller's own namespaces: a tenant never learns another's."""
        pool = self.pool(pool_name)
        if session_id:
            self.sessions.get(session_id, caller)
        with pool.lock:
            hub = pool.events
            digests = {
                caller.unscope(ns): (digest, hub.num_blocks[ns])
                for ns, digest in hub.digests.items()
                if caller.owns(ns)
            }
            return pool, digests, hub.num_events

    def check_invariants(self, pool_name: str) -> None:
        """Raises AssertionError naming the first broken invariant of the core or of the server's bookkeeping."""
        pool = self.pool(pool_name)
        with pool.lock:
            pool.cache.check_invariants()
            pool.ledger.check_invariants(pool.cache)
            for session in self.sessions.live():
                assert len(pool.ledger.pins(session)) <= self._max_pins, "a session holds too many pins"
                session.requests.check_invariants()

    # -- limits (under pool.lock) ------------------------------------------------------------------

    def check_num_sequences(self, pool: Pool, session: Session, num_new: int) -> None:
        ledger = pool.ledger
        held = ledger.num_sequences(session)
        if held + num_new > self._max_sequences:
            raise LimitExceeded("max_sequences_per_session", held + num_new, self._max_sequences)
        held = ledger.num_tenant_sequences(session.tenant)
        share = self.shares.of(self._max_pool_sequences)
        if held + num_new > share:
            raise LimitExceeded("max_sequences_per_tenant", held + num_new, share)
        held = ledger.num_sequences_total()
        if held + num_new > self._max_pool_sequences:
            raise LimitExceeded("max_sequences", held + num_new, self._max_pool_sequences)

    def host_share(self, pool: Pool) -> int | None:
        """How many of `pool`'s host-tier blocks one tenant's swapped-out sequences may hold; None: no bound (one
        caller, or no host tier)."""
        if self.shares.num_tenants <= 1 or pool.host_storage is None:
            return None
        return self.shares.of(pool.host_storage.layout.num_blocks)

    def cache_share(self, pool: Pool, caller: Tenant) -> int | None:
        """How many blocks of `pool` the tenant's namespaces may keep cached: its `max_cached_blocks`, else
        an even share of the pool when tenants are several; None: no bound (one caller)."""
        if caller.max_cached_blocks is not None:
            return caller.max_cached_blocks
        return self.shares.of(pool.layout.num_blocks) if self.shares.num_tenants > 1 else None

    def keep_cache_share(self, pool: Pool, caller: Tenant) -> None:
        """After a call that cached: evict the tenant's own least recently used unlocked blocks past its share.

        Without this one tenant could keep the whole pool resident by caching alone (its pins count
        against its block quota instead). Blocks its live sequences lock stay: the quota bounds those.
        """
        share = self.cache_share(pool, caller)
        if share is None:
            return
        cached = sum(n for ns, n in pool.cache.tree.num_cached_blocks_in.items() if caller.owns(ns))
        if cached > share:
            pool.cache.evict(cached - share, caller.owns)

    def check_namespaces(self, pool: Pool, caller: Tenant, namespaces: set[str]) -> None:
        """The tenant's share of the pool's namespaces: those it has cached or holds, plus these new ones."""
        if self.shares.num_tenants <= 1:
            return  # one tenant: the core's max_namespaces is its share
        roots = pool.cache.tree.roots
        new = [ns for ns in namespaces if ns not in roots]
        if not new:
            return
        share = self.shares.of(pool.cache.limits.max_namespaces)
        held = sum(1 for ns in roots if caller.owns(ns))
        if held + len(new) > share:
            raise LimitExceeded("max_namespaces_per_tenant", held + len(new), share)


def _as_int32(token_ids: TokenIds) -> TokenIds:
    """A wire column (uint32) as int32 in one numpy pass; ids >= 2^31 wrap negative, which the core refuses.

    Anything else (an in-process caller's list with a negative id, say) goes to the core as it is,
    whose check names the field.
    """
    if isinstance(token_ids, bytes | np.ndarray):
        return token_ids
    try:
        return np.array(token_ids, dtype=np.uint32).view(np.int32)
    except (OverflowError, TypeError, ValueError):
        return token_ids


def _num_tokens(token_ids: TokenIds) -> int:
    return len(token_ids) // TOKEN_BYTES if isinstance(token_ids, bytes) else len(token_ids)
