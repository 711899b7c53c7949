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
get. A refusal names its item (`item` in the error's metadata).

Every call that opens, appends, forks, caches, releases or commits runs here: a Session step, and
each unary call as a step of one item (`service.py`), so they share one set of checks (`checks.py`:
sizes, the preamble, request ids, counts, quota, token budget) and one way of applying.

Items refer to sequences live before the step: the ids a step opens or forks come back in its
result, for the steps after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import TracebackType

import numpy as np

from radixkv.errors import InvalidArgument, RadixKVError, UnknownSequence
from radixkv.memory.block_pairs import NO_PAIRS, concat_pairs
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.sequences.step import Append, Step, StepResult
from radixkv.server.checks import Charge, Checks, Reply
from radixkv.server.idempotency import NO_REQUEST, RequestKey
from radixkv.server.miss_reasons import MissExplanation, after_open, explain_open
from radixkv.server.pools import Pool
from radixkv.server.sessions import Session
from radixkv.server.sizes import num_tokens
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
                (to_token_bytes(tokens, f"prompts[{i}].token_ids" if batch else "token_ids"),
                 caller.scope(ns, f"prompts[{i}].namespace" if batch else "namespace"))
                for i, (tokens, ns) in enumerate(step.opens)
            ]  # fmt: skip
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
                appended = AppendBatch([], [], [], [], [], [], [], np.empty(0, dtype=np.int64))
            else:
                appended = cache.append_batch(a.seq_ids, a.num_token_ids, a.token_ids)
                ledger.follow_append(session, appended)
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
        checks.keep_cache_share(pool, session.tenant)
    if not opened:  # a decode step: only its append's transfers
        offloads = appended.offloads if appended is not None else NO_PAIRS
        return StepResult(opened, appended, forked, num_cached, num_released, offloads=offloads)
    offloads = concat_pairs([*(r.offloads for r in opened), *([appended.offloads] if appended is not None else [])])
    loads = concat_pairs(r.loads for r in opened)
    return StepResult(opened, appended, forked, num_cached, num_released, offloads=offloads, loads=loads)


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
