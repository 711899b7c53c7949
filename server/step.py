"""One scheduler step: a commit, opens, an append, forks, caches and releases applied in that order, all or none.

A step must change nothing when any of its items is refused, yet its items are separate core
calls, and some of them cannot be undone (an allocation may evict cached blocks; a release
publishes blocks to the tree). So nothing is applied until every item is known to succeed: under
the pool's lock, each item is checked in order against the state the items before it will leave
(ownership, session and quota counts, and the blocks the opens take from what the append may use),
and only then applied in order. The order is what makes the plan exact and small: the commit only
moves watermarks, and it comes first so that the step's caches, forks and cached releases publish
what the worker wrote in the step before; only opens and the append allocate; forks, caches and
releases need no blocks, and their checks do not depend on which blocks the opens and the append
get. A refusal names its item
(`item` in the error's metadata) and otherwise carries what the unary call would have raised.

Items refer to sequences live before the step: the ids a step opens or forks come back in its
result, for the steps after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import TracebackType

from radixkv.errors import (
    InvalidArgument,
    QuotaExceeded,
    RadixKVError,
    ServerRestarting,
    UnknownSequence,
    UnknownSession,
)
from radixkv.memory.block_pairs import NO_PAIRS, concat_pairs
from radixkv.sequences.results import OpenResult
from radixkv.sequences.step import Step, StepResult
from radixkv.server.deadlines import check_deadline
from radixkv.server.miss_reasons import MissExplanation, after_open, explain_open
from radixkv.server.pools import Pool
from radixkv.server.service import KVService, _num_tokens
from radixkv.server.sessions import Session
from radixkv.server.sizes import check_request_size, open_response_bytes
from radixkv.server.tenants import Tenant
from radixkv.tree.token_ids import TokenIds, to_token_bytes


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
    service: KVService, caller: Tenant, session: Session, pool_name: str, step: Step, request_id: int = 0
) -> StepResult:
    """Check every item of `step`, then apply them all (see the module docstring).

    With a `request_id` this session already stepped with (a step re-sent after a reconnect), the
    first result is returned and nothing is checked or applied again.

    Raises:
        RadixKVError: an item was refused (its `item` metadata names it); nothing changed.
    """
    pool = service.pool(pool_name)
    requests: list[tuple[TokenIds, str]] = []
    keys: list[bytes | None] = []  # per open, its tokens packed where it asks to be explained
    num_prompt_tokens = 0  # the opens' tokens: charged to the token bucket, and their slots kept with the result
    if step.opens:
        with _item("opens"):  # as OpenSequences does before it takes the lock
            counts = [_num_tokens(t) for t, _ in step.opens]
            num_prompt_tokens = sum(counts)
            check_request_size(pool, num_prompt_tokens, open_response_bytes(pool, counts), service.max_message_bytes)
            batch = len(step.opens) > 1
            requests = [
                (tokens, caller.scope(ns, f"prompts[{i}].namespace" if batch else "namespace"))
                for i, (tokens, ns) in enumerate(step.opens)
            ]
            keys = _explained_keys(step, batch)
    with pool.lock:
        if session.closed:
            raise UnknownSession(session.session_id)
        if pool.frozen:
            raise ServerRestarting()
        check_deadline()

        def check_and_apply() -> StepResult:
            _StepPlan(service, pool, session, caller).check(step, requests)
            # As OpenSequences explains: before the opens (the commit before them leaves the tree as it is).
            before: list[MissExplanation | None] = (
                [
                    None if key is None else explain_open(pool.cache, pool.events, caller, key, ns)
                    for key, (_, ns) in zip(keys, requests, strict=True)
                ]
                if keys
                else []
            )
            cost = num_prompt_tokens + sum(step.max_new_tokens) if requests else 0
            if cost:
                with _item("opens"):
                    service.take_tokens(pool, caller, cost)  # last: a step refused for anything else charges nothing
            try:
                with (
                    pool.cache.one_result()
                ):  # the worker applies the step's transfers together (radixkv.tree.host_tier)
                    result = _apply(service, pool, session, step, requests)
            except BaseException:
                service.token_buckets.refund(caller, cost)
                raise
            if not before:
                return result
            size = pool.layout.block_size
            pairs = zip(before, result.opened, strict=True)
            return dataclasses.replace(
                result, explanations=[None if b is None else after_open(b, r.num_cached_tokens, size) for b, r in pairs]
            )

        return session.requests.once(
            request_id, f"Session {pool.name}", check_and_apply, lambda r: _result_cost(r) + num_prompt_tokens
        )


def _explained_keys(step: Step, batch: bool) -> list[bytes | None]:
    """Each open's tokens packed where it asks to be explained (none asks: empty), refused as OpenSequences
    refuses them."""
    if not any(step.explain):
        return []
    if len(step.explain) != len(step.opens):
        raise InvalidArgument("explain", f"needs one entry per prompt ({len(step.opens)}), got {len(step.explain)}")
    return [
        to_token_bytes(tokens, f"prompts[{i}].token_ids" if batch else "token_ids") if explain else None
        for i, ((tokens, _), explain) in enumerate(zip(step.opens, step.explain, strict=True))
    ]


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

    def __init__(self, service: KVService, pool: Pool, session: Session, caller: Tenant) -> None:
        self.service, self.pool, self.session, self.caller = service, pool, session, caller
        self.num_new_sequences = 0  # opened and forked by the items checked so far
        self.held_blocks = pool.ledger.tenant_blocks(caller)
        self.table_blocks: dict[int, int] = {}  # block-table lengths the append leaves (quota only)

    def check(self, step: Step, requests: list[tuple[TokenIds, str]]) -> None:
        pool, cache, bs = self.pool, self.pool.cache, self.pool.layout.block_size
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
                self.service.check_namespaces(pool, self.caller, {ns for _, ns in requests})
                self._charge(sum(-(-_num_tokens(tokens) // bs) for tokens, _ in requests))
                if committed or step.append is not None or after_append:
                    num_taken = cache.check_open(requests, **_budgets(step))
        if step.append is not None:
            with _item("append"):
                append = step.append
                self._own_all(append.seq_ids, "seq_ids")
                if self.caller.max_blocks is not None:  # as AppendTokens counts growth
                    growth = 0
                    for s, n in zip(append.seq_ids, append.num_token_ids, strict=False):
                        after = -(-(cache.num_tokens(s) + n) // bs)
                        growth += max(0, after - pool.ledger.num_table_blocks(s))
                        self.table_blocks[s] = max(after, pool.ledger.num_table_blocks(s))
                    self._charge(growth)
                if committed or requests or after_append:
                    cache.check_append(append.seq_ids, append.num_token_ids, append.token_ids, num_taken)
        for i, (seq_id, num_children) in enumerate(step.forks):
            with _item(f"forks[{i}]"):
                pool.ledger.check_owner(self.session, seq_id)
                self._add_sequences(num_children)
                if self.caller.max_blocks is not None:
                    self._charge(
                        max(num_children, 0) * self.table_blocks.get(seq_id, pool.ledger.num_table_blocks(seq_id))
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
        self.service.check_num_sequences(self.pool, self.session, self.num_new_sequences + num_new)
        self.num_new_sequences += num_new

    def _charge(self, num_blocks: int) -> None:
        quota = self.caller.max_blocks
        if quota is None:
            return
        if self.held_blocks + num_blocks > quota:
            raise QuotaExceeded(self.caller.name, num_blocks, max(0, quota - self.held_blocks))
        self.held_blocks += num_blocks


def _apply(
    service: KVService, pool: Pool, session: Session, step: Step, requests: list[tuple[TokenIds, str]]
) -> StepResult:
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
            for result in opened:
                ledger.adopt(session, result.seq_id, len(result.block_table))
    appended = None
    if step.append is not None:
        with applying.item("append"):
            a = step.append
            appended = cache.append_batch(a.seq_ids, a.num_token_ids, a.token_ids)
            ledger.follow_append(session, appended.seq_ids, appended.table_offsets, appended.num_block_ids)
    forked = []
    for i, (seq_id, num_children) in enumerate(step.forks):
        with applying.item(f"forks[{i}]"):
            children = cache.fork(seq_id, num_children)
            num_blocks = ledger.num_table_blocks(seq_id)
            for child in children:
                ledger.adopt(session, child, num_blocks)
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
        service.keep_cache_share(pool, session.tenant)
    if not opened:  # a decode step: only its append's transfers
        offloads = appended.offloads if appended is not None else NO_PAIRS
        return StepResult(opened, appended, forked, num_cached, num_released, offloads=offloads)
    offloads = concat_pairs([*(r.offloads for r in opened), *([appended.offloads] if appended is not None else [])])
    loads = concat_pairs(r.loads for r in opened)
    return StepResult(opened, appended, forked, num_cached, num_released, offloads=offloads, loads=loads)


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
