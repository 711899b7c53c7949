"""The server's domain layer: sessions own sequences, tenants own namespaces and quotas, pools serialise the core.

Every call that changes a pool passes the same checks (`checks.py`: sizes, the pool-lock
preamble, request ids, counts, quota, token budget). Opens, appends, forks, caches, releases and
commits are steps of one item, run by the Session stream's own `run_step` (`step.py`); preempt,
resume, pin and unpin, which no step carries, pass the same preamble and request window
(`Checks.applied_once`) around their core call. Reads are `reads.py`.

Threading model: gRPC runs each RPC on a thread of a fixed pool (`max_workers`), a Session stream
included; the lease reaper is one more thread. No pool work runs on gRPC's own threads. Each pool
has one lock (`Pool.lock`), held around every call into its `KVCache` together with the
bookkeeping that must agree with the core (`Pool.ledger`: which session owns each sequence, each
tenant's blocks, each session's pins) and the pool's event hub. So calls on one pool run one at a
time, whole (a step is never interleaved with another call), and calls on different pools do not
wait for each other. The session registry has its own lock, never held while a pool lock is
taken. Ending a session marks it closed first and then takes each pool's lock to release what it
holds; every pool-locked section re-checks the mark (`Checks.locked`), so no sequence can join a
session that is being torn down. The other locks (the stream counts, each watcher's queue, each
session's request window, the token buckets) are leaves: nothing is taken while one is held.

Sessions that end (closed, expired, server shutdown) release their sequences with cache=False:
the server cannot know whether a dead client's workers finished writing those blocks' K/V, and a
cached block with unwritten K/V would serve garbage to the next prompt that hits it. Their pins go too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from radixkv.errors import FailedPrecondition, PermissionDenied, UnknownPool
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.events.block_checksums import check_digests, table_range
from radixkv.server.rules.checks import Checks, Reply
from radixkv.server.rules.config import DEFAULT_POOL, ServerConfig
from radixkv.server.rules.idempotency import NO_REQUEST, RequestKey, WindowBytes
from radixkv.server.rules.ledger import Pin
from radixkv.server.rules.miss_reasons import MissExplanation
from radixkv.server.rules.pool_access import PoolAccess
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.restart import Written, snapshot_all
from radixkv.server.rules.sessions import Session, SessionRegistry
from radixkv.server.rules.sizes import num_tokens
from radixkv.server.rules.step import run_step
from radixkv.server.rules.streams import WatchStreams
from radixkv.server.rules.tenants import Tenant
from radixkv.tree.retention import Retention
from radixkv.tree.token_ids import TOKEN_BYTES, TokenIds, to_token_bytes


class KVService:
    """Every operation that changes a pool, and the sessions, as typed calls on behalf of a caller (a `Tenant`)."""

    def __init__(self, config: ServerConfig, pools: dict[str, Pool]) -> None:
        self.pools = pools
        self.access = PoolAccess(config)
        self.checks = Checks(config)
        self.shares = self.checks.shares
        self.sessions = SessionRegistry(
            config.session_ttl_seconds,
            config.max_session_ttl_seconds,
            config.max_sessions,
            self._end_session,
            self.shares.of(config.max_sessions),
            WindowBytes(config.max_request_window_bytes, self.shares.of(config.max_request_window_bytes)),
            config.max_request_window_bytes_per_session,
        )
        assert config.max_watch_streams is not None
        self.streams = WatchStreams(config.max_watch_streams, self.shares.of(config.max_watch_streams))
        self.max_message_bytes = config.max_message_bytes
        self.unary = Reply(config.max_message_bytes, packed=False, items=False)  # how a unary call answers
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

    def pool(self, name: str, caller: Tenant) -> Pool:
        """The pool named (default: "default") if the caller may use it (server/rules/pool_access.py)."""
        pool = self.pools.get(name or DEFAULT_POOL)
        if pool is None:
            raise UnknownPool(name or DEFAULT_POOL)
        self.access.check_use(pool.name, caller)
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
                if pool.frozen:  # its snapshot holds the session: the next server's lease ends it
                    continue
                seq_ids, pins = pool.ledger.take_session(session)
                if seq_ids:
                    pool.cache.release_many(seq_ids, cache=False)
                for pin in pins:
                    pool.cache.unpin(pin.token_bytes, pin.namespace)
                num_released += len(seq_ids)
        return num_released

    # -- steps of one item -------------------------------------------------------------------------

    def step(
        self, caller: Tenant, session_id: str, pool_name: str, step: Step, request: RequestKey = NO_REQUEST
    ) -> StepResult:
        """A unary call as a step of one item (see `step.run_step`); its refusal names no item."""
        pool = self.pool(pool_name, caller)
        return run_step(self.checks, pool, self.sessions.get(session_id, caller), step, self.unary, request)

    def open_sequences(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        prompts: Sequence[tuple[TokenIds, str]],
        request: RequestKey = NO_REQUEST,
        explanations: list[MissExplanation] | None = None,
        max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[OpenResult]:
        """Open a batch of prompts, all or none (the whole batch counts against the request limits).

        `explanations`, when given, receives why each prompt's cached prefix ends where it does (as
        the first call found it, on a retry answered from the request window). `max_new_tokens` and
        `priorities`: per prompt, as `KVCache.open_many` takes them.
        """
        explain = [True] * len(prompts) if explanations is not None else ()
        step = Step(opens=prompts, max_new_tokens=max_new_tokens or (), priorities=priorities or (), explain=explain)
        result = self.step(caller, session_id, pool_name, step, request)
        if explanations is not None:
            explanations[:] = result.explanations
        return result.opened

    def append_tokens(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        seq_ids: Sequence[int],
        num_token_ids: Sequence[int],
        token_ids: TokenIds,
        request: RequestKey = NO_REQUEST,
    ) -> AppendBatch:
        """One decode step, in columns (see `KVCache.append_batch`)."""
        step = Step(append=Append(seq_ids, num_token_ids, token_ids))
        appended = self.step(caller, session_id, pool_name, step, request).appended
        assert appended is not None, "a step with an append answers it"
        return appended

    def fork(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        seq_id: int,
        num_children: int,
        request: RequestKey = NO_REQUEST,
    ) -> list[int]:
        return self.step(caller, session_id, pool_name, Step(forks=[(seq_id, num_children)]), request).forked[0]

    def cache_sequence(
        self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, request: RequestKey = NO_REQUEST
    ) -> int:
        return self.step(caller, session_id, pool_name, Step(caches=[seq_id]), request).num_cached_tokens[0]

    def release(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], cache: bool,
        request: RequestKey = NO_REQUEST,
    ) -> int:  # fmt: skip
        step = Step(releases=[(seq_ids, cache)])
        return self.step(caller, session_id, pool_name, step, request).num_released_sequences

    def commit(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], num_tokens: Sequence[int]
    ) -> None:
        """Advance the computed watermarks of the session's sequences (see `KVCache.commit`).

        Needs no request id: committing the same watermark again changes nothing."""
        self.step(caller, session_id, pool_name, Step(commit=Commit(seq_ids, num_tokens)))

    def record_block_checksums(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        seq_id: int,
        first_block: int,
        digests: Sequence[bytes],
        checksums: Sequence[int] = (),
    ) -> int:
        """Attach writers' K/V digests to the sequence's blocks the tree holds (server/events/block_checksums.py).

        Needs no request id: a block keeps its first digest, so recording again changes nothing."""
        check_digests(digests, checksums)
        pool, session = self.pool(pool_name, caller), self.sessions.get(session_id, caller)
        with self.checks.locked(pool, session):
            pool.ledger.check_owner(session, seq_id)
            blocks = table_range(pool.cache.block_table(seq_id), first_block, len(digests), "first_block")
            held = [i for i, b in enumerate(blocks) if pool.events.hashes.get(b) is not None]  # in the tree
            return pool.events.checksums.record([blocks[i] for i in held], [digests[i] for i in held])

    # -- what no step carries: the same preamble and request window around the core call -------------

    def preempt(
        self, caller: Tenant, session_id: str, pool_name: str, seq_ids: Sequence[int], mode: str,
        request: RequestKey = NO_REQUEST,
    ) -> PreemptResult:  # fmt: skip
        """Preempt the session's sequences, all or none; they stay the session's, holding no block."""
        pool, session = self.pool(pool_name, caller), self.sessions.get(session_id, caller)

        def apply() -> PreemptResult:
            ledger, cache = pool.ledger, pool.cache
            ledger.check_owners(session, list(seq_ids))
            self.checks.check_swap(pool, caller, seq_ids, mode)
            result = cache.preempt(seq_ids, mode)
            for seq_id in result.seq_ids:
                ledger.preempted(seq_id, cache.swap_blocks(seq_id))
            self.checks.keep_cache_share(pool, caller)  # recompute cached their blocks, as a cached release does
            return result

        return self.checks.applied_once(
            pool, session, request, apply, lambda r: len(r.seq_ids) + 2 * len(r.offloads) + 1
        )

    def resume(
        self, caller: Tenant, session_id: str, pool_name: str, seq_id: int, request: RequestKey = NO_REQUEST
    ) -> ResumeResult:
        """Resume one of the session's preempted sequences; its blocks count against the tenant's quota again, and
        the tokens it hands back to compute against its token budget."""
        pool, session = self.pool(pool_name, caller), self.sessions.get(session_id, caller)

        def apply() -> ResumeResult:
            pool.ledger.check_owner(session, seq_id)
            cost = self.checks.resume_tokens(pool, caller, seq_id) if pool.cache.is_preempted(seq_id) else 0
            try:
                result = pool.cache.resume(seq_id)  # raises for a live sequence
            except BaseException:
                self.checks.refund(caller, cost)
                raise
            self.checks.refund(caller, min(cost, result.num_cached_tokens))  # found cached: not computed, not paid
            pool.ledger.resumed(seq_id, len(result.block_table))
            return result

        return self.checks.applied_once(
            pool, session, request, apply, lambda r: 2 * len(r.block_table) + len(r.loads) + 1
        )

    def pin(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str,
        request: RequestKey = NO_REQUEST,
    ) -> int:  # fmt: skip
        """Pin the cached prefix until Unpin or the session's end; returns tokens pinned.

        The prefix's blocks count against the tenant's block quota and its share of the pinned blocks.
        """
        pool, key, core_namespace = self._prefix(caller, pool_name, token_ids, namespace)
        session = self.sessions.get(session_id, caller)

        def apply() -> int:
            self.checks.check_pin(pool, session, pool.cache.match(key, core_namespace) // pool.layout.block_size)
            num_pinned = pool.cache.pin(key, core_namespace)
            pin = Pin(core_namespace, key[: num_pinned * TOKEN_BYTES], num_pinned // pool.layout.block_size)
            pool.ledger.add_pin(session, pin)
            return num_pinned

        return self.checks.applied_once(pool, session, request, apply, lambda _: 1)

    def unpin(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str,
        request: RequestKey = NO_REQUEST,
    ) -> None:  # fmt: skip
        """Drop this session's longest pin on a prefix of `token_ids` (pins are the session's own)."""
        pool, key, core_namespace = self._prefix(caller, pool_name, token_ids, namespace)
        session = self.sessions.get(session_id, caller)

        def apply() -> None:
            pin = pool.ledger.take_pin(session, core_namespace, key)
            pool.cache.unpin(pin.token_bytes, core_namespace)

        self.checks.applied_once(pool, session, request, apply, lambda _: 1)

    def retain(
        self, caller: Tenant, session_id: str, pool_name: str, token_ids: TokenIds, namespace: str,
        retention: tuple[float, int, bool, bool], request: RequestKey = NO_REQUEST,
    ) -> int:  # fmt: skip
        """A soft retention hint on the cached prefix (`radixkv.tree.retention`); returns the tokens it covers.
        Nothing to quota: a hint orders eviction and holds nothing."""
        pool, key, core_namespace = self._prefix(caller, pool_name, token_ids, namespace)
        session = self.sessions.get(session_id, caller)
        hint = Retention(*retention)  # InvalidArgument names the field before anything is applied
        return self.checks.applied_once(
            pool, session, request, lambda: pool.cache.retain(key, core_namespace, hint), lambda _: 1
        )

    def _prefix(self, caller: Tenant, pool_name: str, token_ids: TokenIds, namespace: str) -> tuple[Pool, bytes, str]:
        """A pin's pool, its tokens (their count checked before they are converted) and the tenant's namespace."""
        pool = self.pool(pool_name, caller)
        self.checks.check_size(pool, num_tokens(token_ids))
        return pool, to_token_bytes(token_ids), caller.scope(namespace)
