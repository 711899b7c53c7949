"""The server's domain layer: sessions own sequences, tenants own namespaces and quotas, pools serialise the core.

Every call that changes a pool passes the same checks (`checks.py`: sizes, the pool-lock
preamble, request ids, counts, quota, token budget). Opens, appends, forks, caches, releases and
commits are steps of one item the servicer builds from the request, run by the Session stream's own
`run_step` (below; `KVService.step` for a unary call); preempt,
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

import dataclasses
import threading
from collections.abc import Sequence
from types import TracebackType

import numpy as np

from radixkv.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    RadixKVError,
    UnknownPool,
    UnknownSequence,
)
from radixkv.memory.block_pairs import NO_PAIRS, concat_pairs
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.sequences.step import Append, Step, StepResult
from radixkv.server.events.block_checksums import check_digests, table_range
from radixkv.server.rules.checks import Charge, Checks, Reply, num_tokens
from radixkv.server.rules.config import DEFAULT_POOL, ServerConfig
from radixkv.server.rules.ledger import Pin
from radixkv.server.rules.miss_reasons import MissExplanation, after_open, explain_open
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.restart import Written, snapshot_all
from radixkv.server.rules.sessions import NO_REQUEST, RequestKey, Session, SessionRegistry, WindowBytes
from radixkv.server.rules.streams import WatchStreams
from radixkv.server.rules.tenants import PoolAccess, Tenant
from radixkv.tree.eviction import Retention
from radixkv.tree.radix_tree import TOKEN_BYTES, TokenIds, to_token_bytes

# -- from rules/step.py (merged, issue 41: one concept, one module):
# One scheduler step: a commit, opens, an append, forks, caches and releases applied in that order, all or none.
#
# A step must change nothing when any of its items is refused, yet its items are separate core
# calls, and some of them cannot be undone (an allocation may evict cached blocks; a release
# publishes blocks to the tree). So nothing is applied until every item is known to succeed: under
# the pool's lock, each item is checked in order against the state the items before it will leave
# (ownership, session and quota counts, and the blocks the opens take from what the append may use),
# and only then applied in order. The order is what makes the plan exact and small: the commit only
# moves watermarks, and it comes first so that the step's caches, forks and cached releases publish
# what the worker wrote in the step before; only opens and the append allocate; forks, caches and
# releases need no blocks, and their checks do not depend on which blocks the opens and the append
# get. A refusal names its item (`item` in the error's metadata).
#
# Every call that opens, appends, forks, caches, releases or commits runs here: a Session step, and
# each unary call as a step of one item (`service.py`), so they share one set of checks (`checks.py`:
# sizes, the preamble, request ids, counts, quota, token budget) and one way of applying.
#
# Items refer to sequences live before the step: the ids a step opens or forks come back in its
# result, for the steps after it.


class _item:  # noqa: N801 -- used as `with _item("opens"):`; a class: cheaper than a generator per item
    """Name the step item a refusal comes from."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(error, RadixKVError):
            error.metadata.setdefault("item", self.name)


def run_step(
    checks: Checks, pool: Pool, session: Session, step: Step, reply: Reply, request: RequestKey = NO_REQUEST
) -> StepResult:
    """Check every item of `step`, then apply them all (see the module docstring).

    `request`: with an id this session already stepped with (a step re-sent after a reconnect), the
    first result is returned and nothing is checked or applied again (see `idempotency`). `reply`:
    where the answer goes (its room bounds the step's response before anything applies), and whether
    a refusal names its item (a unary call is one item: it does not).

    Raises:
        RadixKVError: an item was refused (its `item` metadata names it); nothing changed.
    """
    try:
        return _run(checks, pool, session, step, reply, request)
    except RadixKVError as e:
        if not reply.items:
            e.metadata.pop("item", None)
        raise


def _run(checks: Checks, pool: Pool, session: Session, step: Step, reply: Reply, request: RequestKey) -> StepResult:
    caller = session.tenant
    checks.check_step_size(pool, step, reply)
    requests: list[tuple[bytes, str]] = []  # the opens' (tokens, namespace), checked and packed, as the core takes them
    keys: list[bytes | None] = []  # per open, its tokens where it asks to be explained
    num_prompt_tokens = 0  # the opens' tokens: charged to the token bucket, and their slots kept with the result
    if step.opens:
        with _item("opens"):
            num_prompt_tokens = sum(num_tokens(t) for t, _ in step.opens)
            batch = len(step.opens) > 1
            requests = [
                (
                    to_token_bytes(tokens, f"prompts[{i}].token_ids" if batch else "token_ids"),
                    caller.scope(ns, f"prompts[{i}].namespace" if batch else "namespace"),
                )
                for i, (tokens, ns) in enumerate(step.opens)
            ]
            keys = _explained_keys(step, requests)
    if step.append is not None and not isinstance(step.append.token_ids, bytes | np.ndarray):
        step = dataclasses.replace(step, append=dataclasses.replace(step.append, token_ids=_as_int32(step.append)))

    if pool.disk is not None:  # disk blocks past each prompt's match join the host tier (read without the lock)
        for key, ns in requests:
            pool.disk.promote(key, ns)

    def check_and_apply() -> StepResult:
        _StepPlan(checks, pool, session).check(step, requests)
        # Explained before the opens (the commit before them leaves the tree as it is).
        before: list[MissExplanation | None] = (
            [
                None if key is None else explain_open(pool.cache, pool.events, caller, key, ns)
                for key, (_, ns) in zip(keys, requests, strict=True)
            ]
            if keys
            else []
        )
        cost = checks.step_tokens(pool, caller, step, num_prompt_tokens if requests else 0)
        if cost:
            with _item("opens" if requests else "append"):
                checks.take_tokens(pool, caller, cost)  # last: a step refused for anything else charges nothing
        try:
            with pool.cache.one_result():  # the worker applies the step's transfers together (radixkv.tree.host_tier)
                result = _apply(checks, pool, session, step, requests)
        except BaseException:
            checks.refund(caller, cost)
            raise
        if not before:
            return result
        size = pool.layout.block_size
        pairs = zip(before, result.opened, strict=True)
        return dataclasses.replace(
            result, explanations=[None if b is None else after_open(b, r.num_cached_tokens, size) for b, r in pairs]
        )

    return checks.applied_once(pool, session, request, check_and_apply, lambda r: _result_cost(r) + num_prompt_tokens)


def _explained_keys(step: Step, requests: list[tuple[bytes, str]]) -> list[bytes | None]:
    """Each open's tokens where it asks to be explained (none asks: empty)."""
    if not any(step.explain):
        return []
    if len(step.explain) != len(step.opens):
        raise InvalidArgument("explain", f"needs one entry per prompt ({len(step.opens)}), got {len(step.explain)}")
    return [tokens if explain else None for (tokens, _), explain in zip(requests, step.explain, strict=True)]


def _as_int32(append: Append) -> TokenIds:
    """A unary append's token list (uint32 on the wire) as int32 in one numpy pass; ids >= 2^31 wrap negative,
    which the core refuses. Anything else (an in-process caller's list with a negative id, say) goes to the core
    as it is, whose check names the field."""
    try:
        return np.array(append.token_ids, dtype=np.uint32).view(np.int32)
    except (OverflowError, TypeError, ValueError):
        return append.token_ids


def _result_cost(result: StepResult) -> int:
    """What a kept result holds alive, in ids (the request window's unit, as the unary calls count it)."""
    cost = 1 + len(result.num_cached_tokens) + sum(map(len, result.forked))
    cost += sum(len(r.block_table) + 1 for r in result.opened) if result.opened else 0
    if result.appended is not None:
        a = result.appended
        cost += len(a.block_ids) + len(a.seq_ids) + sum(a.num_appended)
    return cost


class _StepPlan:
    """The checks of each item against the counts the items before it leave; changes nothing."""

    def __init__(self, checks: Checks, pool: Pool, session: Session) -> None:
        self.checks, self.pool, self.session, self.caller = checks, pool, session, session.tenant
        self.num_new_sequences = 0  # opened and forked by the items checked so far
        self.charge = Charge(pool, session.tenant)
        self.table_blocks: dict[int, int] = {}  # block-table lengths the append leaves (quota only)

    def check(self, step: Step, requests: list[tuple[bytes, str]]) -> None:
        pool, cache = self.pool, self.pool.cache
        num_taken = 0  # available blocks the opens take before the append runs
        if step.commit is not None:
            with _item("commit"):
                self._own_all(step.commit.seq_ids, "seq_ids")
                cache.check_commit(step.commit.seq_ids, step.commit.num_tokens)
        # The core checks an item when it is applied; an item that others follow or precede is
        # checked now, so that the first item refused in order is the one reported and nothing
        # before it was applied. A step of one item (a decode step) is checked once.
        after_append = bool(step.forks or step.caches or step.releases)
        committed = step.commit is not None
        if requests:
            with _item("opens"):
                self._add_sequences(len(requests))
                self.checks.check_namespaces(pool, self.caller, {ns for _, ns in requests})
                if self.caller.max_blocks is not None:  # each prompt's blocks, or its reserved table if longer
                    counts = [num_tokens(tokens) for tokens, _ in requests]
                    self.charge.add(pool.ledger.blocks_to_open(cache, counts, step.max_new_tokens))
                if committed or step.append is not None or after_append:
                    num_taken = cache.check_open(requests, **_budgets(step))
        if step.append is not None:
            with _item("append"):
                append = step.append
                self._own_all(append.seq_ids, "seq_ids")
                if self.caller.max_blocks is not None:  # the growth past what each sequence charges already
                    self.charge.add(
                        pool.ledger.append_growth(cache, append.seq_ids, append.num_token_ids, self.table_blocks)
                    )
                if (committed or requests or after_append) and not _is_empty(append):
                    cache.check_append(append.seq_ids, append.num_token_ids, append.token_ids, num_taken)
        for i, (seq_id, num_children) in enumerate(step.forks):
            with _item(f"forks[{i}]"):
                pool.ledger.check_owner(self.session, seq_id)
                self._add_sequences(num_children)
                if self.caller.max_blocks is not None:
                    self.charge.add(
                        max(num_children, 0) * self.table_blocks.get(seq_id, cache.num_table_blocks(seq_id))
                    )
                cache.check_fork(seq_id, num_children)
        for i, seq_id in enumerate(step.caches):
            with _item(f"caches[{i}]"):
                pool.ledger.check_owner(self.session, seq_id)
        released: set[int] = set()
        for i, (seq_ids, _) in enumerate(step.releases):
            with _item(f"releases[{i}]"):
                for j, seq_id in enumerate(seq_ids):
                    if seq_id in released:  # an earlier release of this step ends it
                        raise UnknownSequence(seq_id)
                    pool.ledger.check_owner(self.session, seq_id, f"seq_ids[{j}]")
                if len(set(seq_ids)) != len(seq_ids):
                    raise InvalidArgument("seq_ids", "a sequence appears twice in one batch")
                released.update(seq_ids)

    def _own_all(self, seq_ids: Sequence[int], field: str) -> None:
        self.pool.ledger.check_owners(self.session, seq_ids, field)

    def _add_sequences(self, num_new: int) -> None:
        self.checks.check_num_sequences(self.pool, self.session, self.num_new_sequences + num_new)
        self.num_new_sequences += num_new


def _apply(checks: Checks, pool: Pool, session: Session, step: Step, requests: list[tuple[bytes, str]]) -> StepResult:
    """Apply a checked step. Only a step's single item may still refuse (it was left to check itself)."""
    cache, ledger = pool.cache, pool.ledger
    applying = _Applying()
    if step.commit is not None:
        with applying.item("commit"):
            cache.commit(step.commit.seq_ids, step.commit.num_tokens)
    opened: list[OpenResult] = []
    if requests:
        with applying.item("opens"):
            opened = cache.open_many(requests, **_budgets(step))
            ledger.adopt_opened(session, cache, opened, step.max_new_tokens)
    appended = None
    if step.append is not None:
        with applying.item("append"):
            a = step.append
            if _is_empty(a):  # an append of nothing: a no-op, answered with an empty result
                appended = AppendBatch(
                    seq_ids=[],
                    num_appended=[],
                    num_tokens=[],
                    table_offsets=[],
                    num_block_ids=[],
                    block_ids=[],
                    copies=[],
                    slot_source=np.empty(0, dtype=np.int64),
                )
            else:
                appended = cache.append_batch(a.seq_ids, a.num_token_ids, a.token_ids)
                ledger.follow_append(session, appended)
    forked = []
    for i, (seq_id, num_children) in enumerate(step.forks):
        with applying.item(f"forks[{i}]"):
            children = cache.fork(seq_id, num_children)
            for child in children:
                ledger.adopt(session, cache, child)
            forked.append(children)
    num_cached = []
    for i, seq_id in enumerate(step.caches):
        with applying.item(f"caches[{i}]"):
            num_cached.append(cache.cache(seq_id))
    num_released = 0
    for i, (seq_ids, keep) in enumerate(step.releases):
        with applying.item(f"releases[{i}]"):
            cache.release_many(seq_ids, keep)
            for seq_id in seq_ids:
                ledger.forget(seq_id)
            num_released += len(seq_ids)
    if step.forks or step.caches or any(keep for _, keep in step.releases):
        checks.keep_cache_share(pool, session.tenant)
    if not opened:  # a decode step: only its append's transfers
        offloads = appended.offloads if appended is not None else NO_PAIRS
        return StepResult(
            opened=opened,
            appended=appended,
            forked=forked,
            num_cached_tokens=num_cached,
            num_released_sequences=num_released,
            offloads=offloads,
        )
    offloads = concat_pairs([*(r.offloads for r in opened), *([appended.offloads] if appended is not None else [])])
    loads = concat_pairs(r.loads for r in opened)
    return StepResult(
        opened=opened,
        appended=appended,
        forked=forked,
        num_cached_tokens=num_cached,
        num_released_sequences=num_released,
        offloads=offloads,
        loads=loads,
    )


def _is_empty(append: Append) -> bool:
    return not (len(append.seq_ids) or len(append.num_token_ids) or len(append.token_ids))


def _budgets(step: Step) -> dict[str, Sequence[int] | None]:
    """The opens' max_new_tokens and priorities as `open_many` takes them (None: not given)."""
    return {"max_new_tokens": step.max_new_tokens or None, "priorities": step.priorities or None}


class _Applying:
    """`with applying.item(name)`: names a refusal, and turns one after an earlier item applied into a bug."""

    __slots__ = ("applied", "name")

    def __init__(self) -> None:
        self.applied, self.name = False, ""

    def item(self, name: str) -> _Applying:
        self.name = name
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is None:
            self.applied = True
        elif isinstance(error, RadixKVError):
            error.metadata.setdefault("item", self.name)
            if self.applied:  # a later call refused after earlier ones changed the pool: the plan missed a check
                raise AssertionError(
                    f"step item {self.name} refused after the step began applying: {error!r}"
                ) from error


class KVService:
    """Every operation that changes a pool, and the sessions, as typed calls on behalf of a caller (a `Tenant`)."""

    def __init__(self, config: ServerConfig, pools: dict[str, Pool]) -> None:
        self.pools = pools
        self.access = PoolAccess(config.tenants, config.pools)
        self.checks = Checks(
            num_tenants=len(config.tenants),
            max_message_bytes=config.max_message_bytes,
            max_sequences_per_session=config.max_sequences_per_session,
            max_pins=config.max_pins_per_session,
            max_pool_sequences=config.max_sequences,
        )
        self.shares = self.checks.shares
        self.sessions = SessionRegistry(
            default_ttl=config.session_ttl_seconds,
            max_ttl=config.max_session_ttl_seconds,
            max_sessions=config.max_sessions,
            on_end=self._end_session,
            max_sessions_per_tenant=self.shares.of(config.max_sessions),
            windows=WindowBytes(config.max_request_window_bytes, self.shares.of(config.max_request_window_bytes)),
            max_window_bytes_per_session=config.max_request_window_bytes_per_session,
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
        """The pool named (default: "default") if the caller may use it (server/rules/tenants.py)."""
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
        """A unary call as the step of one item the servicer built (see `run_step`); its refusal names no item."""
        pool = self.pool(pool_name, caller)
        return run_step(self.checks, pool, self.sessions.get(session_id, caller), step, self.unary, request)

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
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        seq_ids: Sequence[int],
        mode: str,
        request: RequestKey = NO_REQUEST,
    ) -> PreemptResult:
        """Preempt the session's sequences, all or none; they stay the session's, holding no block."""
        pool, session = self.pool(pool_name, caller), self.sessions.get(session_id, caller)

        def apply() -> PreemptResult:
            ledger, cache = pool.ledger, pool.cache
            ledger.check_owners(session, list(seq_ids))
            self.checks.check_swap(pool, caller, seq_ids, mode)
            result = cache.preempt(seq_ids, mode)
            for seq_id in result.seq_ids:
                ledger.preempted(cache, seq_id)
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
            pool.ledger.resumed(pool.cache, seq_id)
            return result

        return self.checks.applied_once(
            pool, session, request, apply, lambda r: 2 * len(r.block_table) + len(r.loads) + 1
        )

    def pin(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        token_ids: TokenIds,
        namespace: str,
        request: RequestKey = NO_REQUEST,
    ) -> int:
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
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        token_ids: TokenIds,
        namespace: str,
        request: RequestKey = NO_REQUEST,
    ) -> None:
        """Drop this session's longest pin on a prefix of `token_ids` (pins are the session's own)."""
        pool, key, core_namespace = self._prefix(caller, pool_name, token_ids, namespace)
        session = self.sessions.get(session_id, caller)

        def apply() -> None:
            pin = pool.ledger.take_pin(session, core_namespace, key)
            pool.cache.unpin(pin.token_bytes, core_namespace)

        self.checks.applied_once(pool, session, request, apply, lambda _: 1)

    def retain(
        self,
        caller: Tenant,
        session_id: str,
        pool_name: str,
        token_ids: TokenIds,
        namespace: str,
        retention: tuple[float, int, bool, bool],
        request: RequestKey = NO_REQUEST,
    ) -> int:
        """A soft retention hint on the cached prefix (`radixkv.tree.eviction`); returns the tokens it covers.
        Nothing to quota: a hint orders eviction and holds nothing."""
        pool, key, core_namespace = self._prefix(caller, pool_name, token_ids, namespace)
        session = self.sessions.get(session_id, caller)
        ttl_s, priority, refresh, end_session = retention
        # InvalidArgument names the field before anything is applied
        hint = Retention(ttl_s=ttl_s, priority=priority, refresh=refresh, end_session=end_session)
        return self.checks.applied_once(
            pool, session, request, lambda: pool.cache.retain(key, core_namespace, hint), lambda _: 1
        )

    def _prefix(self, caller: Tenant, pool_name: str, token_ids: TokenIds, namespace: str) -> tuple[Pool, bytes, str]:
        """A pin's pool, its tokens (their count checked before they are converted) and the tenant's namespace."""
        pool = self.pool(pool_name, caller)
        self.checks.check_size(pool, num_tokens(token_ids))
        return pool, to_token_bytes(token_ids), caller.scope(namespace)
