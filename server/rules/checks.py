"""The rules every call that changes a pool passes, written once: the unary calls and the Session's steps share them.

In the order a call meets them:
  1. sizes, before the pool's lock and before any token list is converted: the pool's
     `max_tokens_per_request`, and the most the response can take against the room the message has
     left (`Reply`): a response over it would be lost after the call applied (`sizes.py`);
  2. the preamble (`applied_once`): the pool's lock, a session ended meanwhile, a pool frozen for
     a restart, a deadline that passed while the call waited (`check_deadline`, below);
  3. the request id (`RequestWindow`, sessions.py): a call the session already made returns its first result
     or is refused, and is not checked or applied again;
  4. ownership and counts against the ledger: sequences per session, tenant and pool; namespaces,
     pins and cached blocks per tenant; the tenant's block quota, reservations included (`Charge`,
     one running count per call); its share of the host tier (`check_swap`);
  5. the token budget, last (`step_tokens`, `resume_tokens`; what pays is `TokenBuckets`, tenants.py), so
     that a call refused for anything else charges nothing.
Then the core applies (it changes nothing when it refuses) and the ledger follows its result. The
rules' arithmetic lives with the state it reads (`ledger.py`, `tenants.py`, `sizes.py`); this
module is where every call meets them, in this order.

Everything here runs under the pool's lock except the size checks of step 1, and reads the ledger
and the core without changing them (`keep_cache_share`, which evicts after a call cached, and
`take_tokens`, which charges the bucket, are the exceptions and say so).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import TypeVar

import grpc

from radixkv.errors import DeadlineExceeded, LimitExceeded, ServerRestarting, TokenBudget, UnknownSession
from radixkv.sequences.step import Step
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.sessions import RequestKey, Session, retained_bytes
from radixkv.server.rules.tenants import Shares, Tenant, TokenBuckets
from radixkv.tree.radix_tree import TOKEN_BYTES, TokenIds

# -- from rules/sizes.py (merged, issue 41: one concept, one module):
# How large a call's response can be, from its request's counts alone: bounded before anything applies.
#
# A call whose response would exceed the message limit must be refused before it applies: gRPC would
# drop the response after the server had applied the call, and the client would see
# RESOURCE_EXHAUSTED for a change that happened (an open whose sequence id never arrived). So each
# response's size is bounded from the request's counts (a varint's widest encoding for each slot and
# block id of a unary response; 8 bytes a slot and 4 a block id where the Session stream packs them)
# and checked up front (`checks.Checks.check_size`). A Session frame's steps answer in one message:
# each step is bounded against what the steps before it left (`session_stream`).


DEFAULT_MAX_STEPS_PER_FRAME = (
    256  # a Session frame's steps: four times the clients' (client/session/pipeline.py MAX_FRAME_STEPS)
)
_PER_SEQUENCE_BYTES = 48  # a response's fixed fields per sequence (ids, counts, a copy), with their tags
_ENVELOPE_BYTES = 64
_STEP_ENVELOPE_BYTES = 128  # a step's request id and session id, and the tags of its result fields
_EXPLANATION_BYTES = 32 + 256  # an explained open's miss fields, and the other namespace it names
_ID_BYTES = 11  # a uint64 varint at its widest, with its tag
_TRANSFER_BYTES = 14  # one BlockTransfer at its widest: tag, length, two tagged uint32 varints
_PACKED_SLOT_BYTES, _PACKED_ID_BYTES = 8, 4  # the stream's int64 slots and uint32 columns


def num_tokens(token_ids: TokenIds) -> int:
    """How many tokens a request's token list holds, without converting it."""
    return len(token_ids) // TOKEN_BYTES if isinstance(token_ids, bytes) else len(token_ids)


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


@functools.cache
def _widths(num_blocks: int, block_size: int, packed: bool) -> tuple[int, int]:
    """(response bytes per token, per appended sequence) at most, for a pool of this shape: a token's slot plus one
    block id (a token starts at most one block); a sequence's fixed fields plus its table offset."""
    if packed:
        per_token = _PACKED_SLOT_BYTES + max(_PACKED_ID_BYTES, _varint_bytes(num_blocks))
    else:
        per_token = _varint_bytes(num_blocks * block_size) + _varint_bytes(num_blocks)
    return per_token, _PER_SEQUENCE_BYTES + _varint_bytes(num_blocks)


def _transfers_bytes(pool: Pool, num_blocks: int) -> int:
    """With a host tier, every block a response hands out may bring an offload and a load."""
    return 2 * _TRANSFER_BYTES * num_blocks if pool.host_storage is not None else 0


def open_response_bytes(pool: Pool, counts: Sequence[int], packed: bool = False) -> int:
    """The most the opens of prompts of these token counts can answer (an OpenSequences response, or a step's
    `opened`); a Resume's answer is one such open."""
    layout = pool.layout
    per_token, _ = _widths(layout.num_blocks, layout.block_size, packed)
    num_blocks = sum(-(-n // layout.block_size) for n in counts)
    return (
        _ENVELOPE_BYTES
        + sum(counts) * per_token
        + len(counts) * _PER_SEQUENCE_BYTES
        + _transfers_bytes(pool, num_blocks)
    )


def append_response_bytes(pool: Pool, num_sequences: int, num_tokens: int, packed: bool = False) -> int:
    """The most an append of this batch can answer (each sequence may add a block and a copy)."""
    layout = pool.layout
    per_token, per_sequence = _widths(layout.num_blocks, layout.block_size, packed)
    total = _ENVELOPE_BYTES + num_tokens * per_token + num_sequences * per_sequence
    if pool.host_storage is None:
        return total
    return total + _transfers_bytes(pool, num_tokens // layout.block_size + 2 * num_sequences)  # new blocks, copies


def preempt_response_bytes(pool: Pool, num_sequences: int, num_blocks: int) -> int:
    """The most a preemption of sequences holding `num_blocks` blocks can answer (an offload per block)."""
    return _ENVELOPE_BYTES + num_sequences * _ID_BYTES + _transfers_bytes(pool, num_blocks)


def step_sizes(pool: Pool, step: Step, max_children: int, packed: bool) -> Iterator[tuple[str, int, int]]:
    """Item by item: (the item, its tokens, the most the step's response takes up to and with that item, if the step
    applies). A fork that applies makes at most `max_children` children (more are refused by the sequence limits);
    forks, caches and releases answer ids and counts."""
    total = _STEP_ENVELOPE_BYTES
    if step.opens:
        counts = [num_tokens(t) for t, _ in step.opens]
        total += open_response_bytes(pool, counts, packed) + _EXPLANATION_BYTES * sum(map(bool, step.explain))
        yield "opens", sum(counts), total
    if step.append is not None:
        a = step.append
        count = num_tokens(a.token_ids)
        total += append_response_bytes(pool, len(a.seq_ids), count, packed)
        yield "append", count, total
    for i, (_, num_children) in enumerate(step.forks):
        total += _ID_BYTES * (1 + min(max(num_children, 0), max_children))
        yield f"forks[{i}]", 0, total
    if step.caches or step.releases:
        total += _ID_BYTES * (len(step.caches) + 1)  # each cache's count, and the count of released sequences
        yield ("caches[0]" if step.caches else "releases[0]"), 0, total


def message_bytes_needed(max_tokens_per_request: int, max_sequences_per_session: int, host_tier: bool = False) -> int:
    """A default `max_message_bytes`: room for the largest request and response these limits allow, with any layout
    (and, with a host tier, an offload and a load for every block, at one token per block)."""
    per_token = 10 + 5  # an int64 slot and a uint32 block id, each at its widest
    per_block = 2 * _TRANSFER_BYTES if host_tier else 0
    return (
        _ENVELOPE_BYTES
        + max_tokens_per_request * (per_token + per_block)
        + max_sequences_per_session * (_PER_SEQUENCE_BYTES + 5 + 2 * per_block)
        + (1 << 16)
    )


# -- from rules/deadlines.py (merged, issue 41: one concept, one module):
# The current RPC's deadline, so the service never applies a call its client has stopped waiting for.
#
# A call may wait for its pool's lock behind slower ones. If its deadline passes meanwhile, the
# client has already seen DEADLINE_EXCEEDED; applying it then would change state the client
# believes unchanged. So the servicer records each call's deadline here, and the service checks it
# after taking the pool's lock and before applying anything.

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("radixkv_deadline", default=None)
_NO_DEADLINE_SECONDS = 10**8  # grpc reports a call without a deadline as one this far away, or further


@contextlib.contextmanager
def call_deadline(context: grpc.ServicerContext) -> Iterator[None]:
    """Within: `check_deadline()` refers to this call's deadline (when it has one)."""
    remaining = context.time_remaining()
    deadline = None if remaining is None or remaining > _NO_DEADLINE_SECONDS else time.monotonic() + remaining
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check_deadline() -> None:
    """Raises DeadlineExceeded when the current call's deadline has passed (nothing is applied after it)."""
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded()


T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """How a call's answer travels: at most `max_bytes` (None: unbounded), with its slots packed (the Session
    stream) or as repeated varints (the unary calls). `items`: a refusal names the step item it comes from."""

    max_bytes: int | None
    packed: bool = True
    items: bool = True


class Checks:
    """A server's limits and the checks against them; one instance, shared by every pool's calls."""

    def __init__(
        self,
        *,
        num_tenants: int,
        max_message_bytes: int | None,
        max_sequences_per_session: int,
        max_pins: int,
        max_pool_sequences: int,
    ) -> None:
        """The limits by name, read from a `config.ServerConfig` (which imports this module's defaults)."""
        self.shares = Shares(num_tenants)
        self.max_message_bytes = max_message_bytes
        self.max_sequences_per_session = max_sequences_per_session
        self.max_pins = max_pins
        self.max_pool_sequences = max_pool_sequences
        self.token_buckets = TokenBuckets()

    # -- 1. sizes (outside the lock) -----------------------------------------------------------------

    @staticmethod
    def check_size(pool: Pool, num_tokens: int, response_bytes: int = 0, reply: Reply | None = None) -> None:
        """Raises LimitExceeded naming `max_tokens_per_request` or `max_message_bytes`."""
        allowed = pool.cache.limits.max_tokens_per_request
        if num_tokens > allowed:
            raise LimitExceeded("max_tokens_per_request", num_tokens, allowed)
        if reply is not None and reply.max_bytes is not None and response_bytes > reply.max_bytes:
            raise LimitExceeded("max_message_bytes", response_bytes, reply.max_bytes)

    def check_step_size(self, pool: Pool, step: Step, reply: Reply) -> None:
        """Each item's tokens, and the step's response up to and with each item, against the limits (see
        `sizes.step_sizes`); a refusal names its item (`item`)."""
        for item, count, response_bytes in step_sizes(pool, step, self.max_sequences_per_session, reply.packed):
            try:
                self.check_size(pool, count, response_bytes, reply)
            except LimitExceeded as e:
                e.metadata["item"] = item
                raise

    # -- 2 and 3. the preamble and the request id ------------------------------------------------------

    def locked(self, pool: Pool, session: Session) -> _Locked:
        """`with checks.locked(pool, session):` holds the pool's lock, refusing a session ended meanwhile, a frozen
        pool, or a call past its deadline."""
        return _Locked(pool, session)

    def applied_once(
        self, pool: Pool, session: Session, request: RequestKey, apply: Callable[[], T], cost: Callable[[T], int]
    ) -> T:
        """`apply()` under the preamble, at most once per request id of the session (see `RequestWindow.once`);
        `cost`: the ids and counts its result holds."""
        with self.locked(pool, session):
            return session.requests.once(request, apply, lambda result: retained_bytes(cost(result)))

    # -- 4. counts against the ledger (under the lock) ---------------------------------------------------

    def check_num_sequences(self, pool: Pool, session: Session, num_new: int) -> None:
        ledger = pool.ledger
        held = ledger.num_sequences(session)
        if held + num_new > self.max_sequences_per_session:
            raise LimitExceeded("max_sequences_per_session", held + num_new, self.max_sequences_per_session)
        held = ledger.num_tenant_sequences(session.tenant)
        share = self.shares.of(self.max_pool_sequences)
        if held + num_new > share:
            raise LimitExceeded("max_sequences_per_tenant", held + num_new, share)
        held = ledger.num_sequences_total()
        if held + num_new > self.max_pool_sequences:
            raise LimitExceeded("max_sequences", held + num_new, self.max_pool_sequences)

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

    def check_pin(self, pool: Pool, session: Session, num_blocks: int) -> None:
        """A new pin of `num_blocks`: the session's pins, the tenant's quota and its share of the pinned blocks."""
        ledger, caller = pool.ledger, session.tenant
        num_pins = len(ledger.pins(session))
        if num_pins >= self.max_pins:
            raise LimitExceeded("max_pins_per_session", num_pins + 1, self.max_pins)
        Charge(pool, caller).add(num_blocks)
        share = self.shares.of(int(pool.cache.limits.max_pinned_fraction * pool.layout.num_blocks))
        pinned = ledger.tenant_pinned_blocks(caller)
        if self.shares.num_tenants > 1 and pinned + num_blocks > share:
            raise LimitExceeded("pinned_blocks_per_tenant", pinned + num_blocks, share)

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
        cached = pool.cache.tree.num_cached_blocks_of.get(caller.name, 0)  # its namespaces: "<name>/..."
        if cached > share:
            pool.cache.evict(cached - share, caller.name)  # its own LRU order: no other tenant's leaf is looked at

    # -- 5. the token budget, last -------------------------------------------------------------------

    @staticmethod
    def step_tokens(pool: Pool, caller: Tenant, step: Step, num_prompt_tokens: int) -> int:
        """Tokens a step pays (what pays: `TokenBuckets`, tenants.py): its opens' prompts and `max_new_tokens`, its
        append's tokens past those their sequences' opens prepaid. A unary open or append is such a step."""
        cost = num_prompt_tokens + sum(step.max_new_tokens) if step.opens else 0
        if step.append is not None and caller.max_tokens_per_second is not None:
            cost += pool.ledger.prepaid.cost(step.append.seq_ids, step.append.num_token_ids)
        return cost

    def resume_tokens(self, pool: Pool, caller: Tenant, seq_id: int) -> int:
        """Charge a resume of a preempted sequence: its blocks against the quota (its table or its reservation), its
        answer against the message limit, and its tokens to the token budget (it needs what an open of all of them
        would; the caller refunds what the resume found cached). Returns the tokens taken."""
        length = pool.cache.num_tokens(seq_id)
        self.check_size(pool, 0, open_response_bytes(pool, [length]), Reply(self.max_message_bytes, packed=False))
        Charge(pool, caller).add(pool.ledger.blocks_to_resume(pool.cache, seq_id))
        self.take_tokens(pool, caller, length)
        return length

    def check_swap(self, pool: Pool, caller: Tenant, seq_ids: Sequence[int], mode: str) -> None:
        """A preemption by swap: the host blocks it moves against the tenant's share of the host tier; and its
        answer (an offload per block) against the message limit."""
        cache, ledger = pool.cache, pool.ledger
        num_blocks = sum(map(cache.num_table_blocks, seq_ids))
        reply = Reply(self.max_message_bytes, packed=False)
        self.check_size(pool, 0, preempt_response_bytes(pool, len(seq_ids), num_blocks), reply)
        if mode == "swap":  # without a host tier the share is None, and the preemption refuses
            needed = sum(cache.swap_blocks(s) for s in seq_ids if not cache.is_preempted(s))
            ledger.check_host_blocks(caller, needed, self.host_share(pool))

    def host_share(self, pool: Pool) -> int | None:
        """How many of `pool`'s host-tier blocks one tenant's swapped-out sequences may hold; None: no bound (one
        caller, or no host tier)."""
        if self.shares.num_tenants <= 1 or pool.host_storage is None:
            return None
        return self.shares.of(pool.host_storage.layout.num_blocks)

    def take_tokens(self, pool: Pool, caller: Tenant, num_tokens: int) -> None:
        """Charge tokens to the caller's bucket (under `pool.lock`, which counts the refusals)."""
        try:
            self.token_buckets.take(caller, num_tokens)
        except TokenBudget:
            pool.num_token_budget_refusals += 1
            raise

    def refund(self, caller: Tenant, num_tokens: int) -> None:
        """Give back what `take_tokens` charged for a call the core then refused (nothing applied)."""
        self.token_buckets.refund(caller, num_tokens)


class Charge:
    """One call's blocks against the tenant's quota: each item adds what it takes, and the first item that
    would take the tenant past its quota is refused (the quota's rule is the ledger's `check_quota`)."""

    __slots__ = ("ledger", "caller", "num_blocks")

    def __init__(self, pool: Pool, caller: Tenant) -> None:
        self.ledger, self.caller, self.num_blocks = pool.ledger, caller, 0

    def add(self, num_blocks: int) -> None:
        """Raises QuotaExceeded when this call's blocks so far plus `num_blocks` pass the tenant's quota."""
        if self.caller.max_blocks is None:
            return
        self.ledger.check_quota(self.caller, self.num_blocks + num_blocks)
        self.num_blocks += num_blocks


class _Locked:
    """The preamble as a context manager (a class: a generator-based one costs a decode step 4 us more)."""

    __slots__ = ("pool", "session")

    def __init__(self, pool: Pool, session: Session) -> None:
        self.pool, self.session = pool, session

    def __enter__(self) -> None:
        self.pool.lock.acquire()
        try:
            if self.session.closed:
                raise UnknownSession(self.session.session_id)
            if self.pool.frozen:
                raise ServerRestarting()
            check_deadline()
        except BaseException:
            self.pool.lock.release()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.pool.lock.release()
