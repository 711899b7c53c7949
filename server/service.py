"""The server's domain layer: sessions own sequences, tenants own namespaces and quotas, pools serialise the core.

Threading model: gRPC runs each RPC on a thread of a fixed pool (`max_workers`); the lease reaper
is one more thread. Each pool has one lock (`Pool.lock`), held around every call into its `KVCache`
together with the bookkeeping that must agree with the core: which session owns each sequence,
each tenant's block count, the pool's event hub. So calls on one pool run one at a time, whole
(a batch is never interleaved with another call), and calls on different pools do not wait for
each other. The session registry has its own lock, never held while a pool lock is taken. Ending
a session marks it closed first and then takes each pool's lock to release what it holds; every
pool-locked section re-checks the mark, so no sequence can join a session that is being torn
down. The other locks (the stream count, each watcher's queue) are leaves: nothing is taken while
one is held. Nothing changes before a request is known to be allowed: ownership, limits and quota
are checked, then the core (which changes nothing when it refuses) is called, then the bookkeeping
follows its result. An open WatchEvents stream holds a thread, so at most `max_watch_streams`
(fewer than `max_workers`) are open at once.

Sessions that end (closed, expired, server shutdown) release their sequences with cache=False:
the server cannot know whether a dead client's workers finished writing those blocks' K/V, and a
cached block with unwritten K/V would serve garbage to the next prompt that hits it. Their pins go too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from radixkv.errors import (
    LimitExceeded,
    NotPinned,
    PermissionDenied,
    QuotaExceeded,
    UnknownPool,
    UnknownSequence,
    UnknownSession,
)
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.results import AppendBatch, OpenResult
from radixkv.server.config import DEFAULT_POOL, ServerConfig
from radixkv.server.events import BlockEvent
from radixkv.server.pools import Pool
from radixkv.server.sessions import Session, SessionRegistry
from radixkv.server.streams import WatchStreams
from radixkv.server.tenants import Tenant
from radixkv.stats import Stats
from radixkv.token_ids import TOKEN_BYTES, TokenIds, to_token_bytes


class KVService:
    """Every operation the wire contract offers, as typed calls on behalf of a caller (a `Tenant`)."""

    def __init__(self, config: ServerConfig, pools: dict[str, Pool]) -> None:
        self.pools = pools
        self.sessions = SessionRegistry(
            config.session_ttl_seconds, config.max_session_ttl_seconds, config.max_sessions, self._end_session
        )
        self.streams = WatchStreams(config.max_watch_streams or 0)
        self._max_sequences = config.max_sequences_per_session
        self._max_pins = config.max_pins_per_session

    def start(self) -> None:
        self.sessions.start()

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
                seq_ids = list(session.sequences.pop(pool.name, ()))
                if seq_ids:
                    pool.cache.release_many(seq_ids, cache=False)
                for seq_id in seq_ids:
                    self._forget(pool, session, seq_id)
                for namespace, prefix in session.pins.pop(pool.name, ()):
                    pool.cache.unpin(prefix, namespace)
                num_released += len(seq_ids)
        return num_released

    # -- sequences --------------------------------------------------------------------------------

    def open_sequences(
        self, caller: Tenant, session_id: str, pool_name: str, prompts: Sequence[tuple[TokenIds, str]]
    ) -> list[OpenResult]:
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        # The whole request against the pool's token limit before any prompt is converted: a batch of
        # prompts each under the limit must not add up to one request the size of the message limit.
        num_tokens, allowed = sum(_num_tokens(t) for t, _ in prompts), pool.cache.limits.max_tokens_per_request
        if num_tokens > allowed:
            raise LimitExceeded("max_tokens_per_request", num_tokens, allowed)
        batch = len(prompts) > 1
        requests = [
            (tokens, caller.scope(ns, f"prompts[{i}].namespace" if batch else "namespace"))
            for i, (tokens, ns) in enumerate(prompts)
        ]
        with pool.lock:
            _check_live(session)
            self._check_num_sequences(pool, session, len(requests))
            if caller.max_blocks is not None:
                block_size = pool.layout.block_size
                self._check_quota(pool, caller, sum(-(-_num_tokens(tokens) // block_size) for tokens, _ in requests))
            results = pool.cache.open_many(requests)
            for result in results:
                self._adopt(pool, session, result.seq_id, len(result.block_table))
        return results

    def append_tokens(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds
    ) -> AppendBatch:
        """One decode step, in columns (see `KVCache.append_batch`)."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            owners = pool.owners
            if any(owners.get(seq_id) is not session for seq_id in seq_ids):  # a decode step: check fast, name slowly
                for i, seq_id in enumerate(seq_ids):
                    _check_owner(pool, session, seq_id, f"seq_ids[{i}]")
            if caller.max_blocks is None:
                return pool.cache.append_batch(seq_ids, num_token_ids, token_ids)
            block_size, tables = pool.layout.block_size, pool.num_table_blocks
            growth = sum(
                max(0, -(-(pool.cache.num_tokens(s) + n) // block_size) - tables[s])
                for s, n in zip(seq_ids, num_token_ids, strict=False)
            )
            self._check_quota(pool, caller, growth)
            batch = pool.cache.append_batch(seq_ids, num_token_ids, token_ids)
            for seq_id, offset, num_blocks in zip(batch.seq_ids, batch.table_offsets, batch.num_block_ids, strict=True):
                self._resize(pool, caller, seq_id, offset + num_blocks)
            return batch

    def fork(self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, num_children: int) -> list[int]:
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            _check_owner(pool, session, seq_id, "seq_id")
            self._check_num_sequences(pool, session, num_children)
            num_blocks = pool.num_table_blocks.get(seq_id, 0)
            if caller.max_blocks is not None:
                self._check_quota(pool, caller, max(num_children, 0) * num_blocks)
            children = pool.cache.fork(seq_id, num_children)
            for child in children:
                self._adopt(pool, session, child, num_blocks)
        return children

    def cache_sequence(self, caller: Tenant, session_id: str, pool_name: str, seq_id: int) -> int:
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            _check_owner(pool, session, seq_id, "seq_id")
            return pool.cache.cache(seq_id)

    def release(self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], cache: bool) -> int:
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            for i, seq_id in enumerate(seq_ids):
                _check_owner(pool, session, seq_id, f"seq_ids[{i}]")
            pool.cache.release_many(seq_ids, cache)
            for seq_id in seq_ids:
                self._forget(pool, session, seq_id)
        return len(seq_ids)

    def commit(self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Advance the computed watermarks of the session's sequences (see `KVCache.commit`)."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            self._check_owners(pool, session, seq_ids)
            pool.cache.commit(seq_ids, num_tokens)

    def describe_sequences(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(num_tokens, num_computed_tokens) of each of the session's sequences."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            self._check_owners(pool, session, seq_ids)
            return [(pool.cache.num_tokens(s), pool.cache.num_computed_tokens(s)) for s in seq_ids]

    def can_append(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_token_ids: Sequence[int]
    ) -> tuple[bool, int]:
        """(would this append fit the pool now, blocks available); changes nothing."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            self._check_owners(pool, session, seq_ids)
            return pool.cache.can_append(seq_ids, num_token_ids), pool.cache.num_available_blocks()

    def freeable_blocks(self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int]) -> int:
        """Blocks releasing the session's `seq_ids` together would make available; changes nothing."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        with pool.lock:
            _check_live(session)
            self._check_owners(pool, session, seq_ids)
            return pool.cache.freeable_blocks(seq_ids)

    def num_available_blocks(self, pool_name: str) -> int:
        pool = self.pool(pool_name)
        with pool.lock:
            return pool.cache.num_available_blocks()

    @staticmethod
    def _check_owners(pool: Pool, session: Session, seq_ids: Sequence[int]) -> None:
        owners = pool.owners
        if any(owners.get(seq_id) is not session for seq_id in seq_ids):  # check fast, name slowly
            for i, seq_id in enumerate(seq_ids):
                _check_owner(pool, session, seq_id, f"seq_ids[{i}]")

    # -- prefixes ---------------------------------------------------------------------------------

    def match(self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str) -> int:
        """Read-only; a session is optional (routers probe without one)."""
        pool = self.pool(pool_name)
        if session_id:
            self.sessions.get(session_id, caller)
        core_namespace = caller.scope(namespace)
        with pool.lock:
            return pool.cache.match(token_ids, core_namespace)

    def pin(self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str) -> int:
        """Pin the cached prefix until Unpin or the session's end; returns tokens pinned."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        core_namespace, key = caller.scope(namespace), to_token_bytes(token_ids)
        with pool.lock:
            _check_live(session)
            pins = session.pins.setdefault(pool.name, [])
            if len(pins) >= self._max_pins:
                raise LimitExceeded("max_pins_per_session", len(pins) + 1, self._max_pins)
            num_pinned = pool.cache.pin(key, core_namespace)
            pins.append((core_namespace, key[: num_pinned * TOKEN_BYTES]))
        return num_pinned

    def unpin(self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str) -> None:
        """Drop this session's longest pin on a prefix of `token_ids` (pins are the session's own)."""
        pool, session = self.pool(pool_name), self.sessions.get(session_id, caller)
        core_namespace, key = caller.scope(namespace), to_token_bytes(token_ids)
        with pool.lock:
            _check_live(session)
            pins = session.pins.get(pool.name, [])
            held = [p for p in pins if p[0] == core_namespace and key.startswith(p[1])]
            if not held:
                raise NotPinned(namespace or DEFAULT_NAMESPACE)
            pin = max(held, key=lambda p: len(p[1]))
            pool.cache.unpin(pin[1], core_namespace)
            pins.remove(pin)

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
    ) -> Iterator[tuple[list[BlockEvent], bool]]:
        """Batches of events (first the snapshot, if asked) until the caller leaves or the server stops.

        Validates now, so errors surface before the stream starts; the stream's slot and watcher
        are taken when the first batch is asked for (`WatchStreams.stream`).
        """
        pool = self.pool(pool_name)
        if session_id:
            self.sessions.get(session_id, caller)
        scoped = frozenset(caller.scope(ns, f"namespaces[{i}]") for i, ns in enumerate(namespaces))
        return self.streams.stream(pool, scoped.__contains__ if scoped else caller.owns, include_snapshot, is_active)

    def check_invariants(self, pool_name: str) -> str:
        """The first broken invariant of the core or of this layer's bookkeeping; "" when all hold."""
        pool = self.pool(pool_name)
        with pool.lock:
            try:
                pool.cache.check_invariants()
                assert set(pool.owners) == set(pool.cache.sequence_ids()), (
                    "owned sequences != the core's live sequences"
                )
                tenant_blocks: dict[str, int] = {}
                for seq_id, owner in pool.owners.items():
                    assert seq_id in owner.sequences.get(pool.name, ()), f"sequence {seq_id} missing from its session"
                    if seq_id in pool.num_table_blocks:
                        assert pool.num_table_blocks[seq_id] == len(pool.cache.block_table(seq_id)), (
                            f"sequence {seq_id}: quota count stale"
                        )
                        name = owner.tenant.name
                        tenant_blocks[name] = tenant_blocks.get(name, 0) + pool.num_table_blocks[seq_id]
                assert set(pool.num_table_blocks) <= set(pool.owners), "a quota count outlived its sequence"
                held = {name: n for name, n in pool.tenant_blocks.items() if n}
                assert held == tenant_blocks, f"tenant block counts {held} != their sequences' {tenant_blocks}"
                for session in self.sessions.live():
                    for seq_id in session.sequences.get(pool.name, ()):
                        assert pool.owners.get(seq_id) is session, f"session holds sequence {seq_id} it does not own"
                    assert len(session.pins.get(pool.name, ())) <= self._max_pins, "a session holds too many pins"
            except AssertionError as e:
                return str(e) or "assertion failed"
        return ""

    # -- bookkeeping (under pool.lock) -------------------------------------------------------------

    def _check_num_sequences(self, pool: Pool, session: Session, num_new: int) -> None:
        held = len(session.sequences.get(pool.name, ()))
        if held + num_new > self._max_sequences:
            raise LimitExceeded("max_sequences_per_session", held + num_new, self._max_sequences)

    @staticmethod
    def _check_quota(pool: Pool, tenant: Tenant, needed: int) -> None:
        assert tenant.max_blocks is not None
        held = pool.tenant_blocks.get(tenant.name, 0)
        if held + needed > tenant.max_blocks:
            raise QuotaExceeded(tenant.name, needed, max(0, tenant.max_blocks - held))

    @staticmethod
    def _adopt(pool: Pool, session: Session, seq_id: int, num_blocks: int) -> None:
        pool.owners[seq_id] = session
        session.sequences.setdefault(pool.name, set()).add(seq_id)
        if session.tenant.max_blocks is not None:
            pool.num_table_blocks[seq_id] = num_blocks
            pool.tenant_blocks[session.tenant.name] = pool.tenant_blocks.get(session.tenant.name, 0) + num_blocks

    @staticmethod
    def _resize(pool: Pool, tenant: Tenant, seq_id: int, num_blocks: int) -> None:
        pool.tenant_blocks[tenant.name] += num_blocks - pool.num_table_blocks[seq_id]
        pool.num_table_blocks[seq_id] = num_blocks

    @staticmethod
    def _forget(pool: Pool, session: Session, seq_id: int) -> None:
        del pool.owners[seq_id]
        seq_ids = session.sequences.get(pool.name)
        if seq_ids is not None:
            seq_ids.discard(seq_id)
        num_blocks = pool.num_table_blocks.pop(seq_id, None)
        if num_blocks is not None:
            pool.tenant_blocks[session.tenant.name] -= num_blocks


def _check_live(session: Session) -> None:
    if session.closed:
        raise UnknownSession(session.session_id)


def _check_owner(pool: Pool, session: Session, seq_id: int, field: str) -> None:
    owner = pool.owners.get(seq_id)
    if owner is not session:
        if owner is None:
            raise UnknownSequence(seq_id)
        raise PermissionDenied(f"sequence {seq_id} belongs to another session", field=field, seq_id=seq_id)


def _num_tokens(token_ids: TokenIds) -> int:
    return len(token_ids) // TOKEN_BYTES if isinstance(token_ids, bytes) else len(token_ids)
