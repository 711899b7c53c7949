"""The server's bookkeeping beside the core: `PoolLedger` against a real `KVCache`.

The request-id window: test_request_window.py.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.errors import LimitExceeded, NotPinned, QuotaExceeded, RadixKVError, UnknownSequence
from radixkv.kv_cache import KVCache
from radixkv.server.rules.ledger import Pin, PoolLedger
from radixkv.server.rules.sessions import Session
from radixkv.server.rules.tenants import Tenant
from tests.examples import examples

BLOCK_SIZE = 4
HOST_SHARE = 12  # host blocks each tenant's swapped-out sequences may hold
TENANTS = [
    Tenant(name="a", namespaces=frozenset({"*"}), max_blocks=40, map_pools=False),
    Tenant(
        name="b", namespaces=frozenset({"*"}), max_blocks=None, map_pools=False, max_tokens_per_second=100.0
    ),  # prepaid tokens are kept for it
]


def _session(tenant: Tenant, n: int) -> Session:
    return Session(session_id=f"s{n}", tenant=tenant, ttl=60.0, deadline=time.monotonic() + 60)


class LedgerMachine(RuleBasedStateMachine):
    """Random opens (with budgets), appends, forks, preemptions (swap and recompute), resumes, releases, pins and
    session ends, each mirrored into the ledger as the service does it: the ledger must agree with the core after
    every step, and the quota (reservations included) and the host share hold."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCache(64, BLOCK_SIZE, host_num_blocks=32)
        self.ledger = PoolLedger(BLOCK_SIZE)
        self.sessions = [_session(TENANTS[i % 2], i) for i in range(4)]
        self.prepaid: dict[int, int] = {}  # the model: what each budgeted sequence's open stated, not yet appended

    def _live(self, session: Session) -> list[int]:
        return [s for s in self.cache.sequence_ids() if self.ledger.owner(s) is session]

    def _preempted(self, session: Session) -> list[int]:
        return [s for s in self.cache.preempted_sequence_ids() if self.ledger.owner(s) is session]

    @rule(who=st.integers(0, 3), num_tokens=st.integers(1, 24), token=st.integers(0, 3), budget=st.integers(0, 40))
    def open(self, who: int, num_tokens: int, token: int, budget: int) -> None:
        session = self.sessions[who]
        try:
            self.ledger.check_quota(session.tenant, self.ledger.blocks_to_open(self.cache, [num_tokens], [budget]))
            (result,) = self.cache.open_many([([token] * num_tokens, "ns")], max_new_tokens=[budget])
        except Exception:
            return
        self.ledger.adopt_opened(session, self.cache, [result], [budget])
        if session.tenant.max_tokens_per_second is not None and budget:
            self.prepaid[result.seq_id] = budget

    @rule(who=st.integers(0, 3), num_tokens=st.integers(1, 9), data=st.data())
    def append(self, who: int, num_tokens: int, data: st.DataObject) -> None:
        live = self._live(self.sessions[who])
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        try:
            growth = self.ledger.append_growth(self.cache, [seq_id], [num_tokens])
            self.ledger.check_quota(self.sessions[who].tenant, growth)
            assert self.ledger.prepaid.cost([seq_id], [num_tokens]) == num_tokens - min(
                num_tokens, self.prepaid.get(seq_id, 0)
            )
            batch = self.cache.append_batch([seq_id], [num_tokens], [1] * num_tokens)
        except (QuotaExceeded, RadixKVError):
            return
        self.ledger.follow_append(self.sessions[who], batch)
        if seq_id in self.prepaid:
            self.prepaid[seq_id] = max(0, self.prepaid[seq_id] - num_tokens)

    @rule(who=st.integers(0, 3), data=st.data())
    def fork(self, who: int, data: st.DataObject) -> None:
        session, live = self.sessions[who], self._live(self.sessions[who])
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        try:
            self.ledger.check_quota(session.tenant, self.cache.num_table_blocks(seq_id))
        except QuotaExceeded:
            return
        self.cache.commit([seq_id], [self.cache.num_tokens(seq_id)])  # as the service does before a fork
        for child in self.cache.fork(seq_id, 1):
            self.ledger.adopt(session, self.cache, child)

    @rule(who=st.integers(0, 3), swap=st.booleans(), data=st.data())
    def preempt(self, who: int, swap: bool, data: st.DataObject) -> None:
        session, live = self.sessions[who], self._live(self.sessions[who])
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        try:
            if swap:
                self.ledger.check_host_blocks(session.tenant, self.cache.swap_blocks(seq_id), HOST_SHARE)
            self.cache.preempt([seq_id], "swap" if swap else "recompute")
        except RadixKVError:
            return
        self.ledger.preempted(self.cache, seq_id)

    @rule(who=st.integers(0, 3), data=st.data())
    def resume(self, who: int, data: st.DataObject) -> None:
        session, parked = self.sessions[who], self._preempted(self.sessions[who])
        if not parked:
            return
        seq_id = data.draw(st.sampled_from(parked))
        try:
            self.ledger.check_quota(session.tenant, self.ledger.blocks_to_resume(self.cache, seq_id))
            result = self.cache.resume(seq_id)
        except RadixKVError:
            return
        assert self.cache.num_table_blocks(seq_id) == len(result.block_table)
        self.ledger.resumed(self.cache, seq_id)

    @rule(who=st.integers(0, 3), cache=st.booleans(), data=st.data())
    def release(self, who: int, cache: bool, data: st.DataObject) -> None:
        held = self._live(self.sessions[who]) + self._preempted(self.sessions[who])
        if not held:
            return
        seq_id = data.draw(st.sampled_from(held))
        if cache and not self.cache.is_preempted(seq_id):  # its K/V written: its full blocks enter the tree
            self.cache.commit([seq_id], [self.cache.num_tokens(seq_id)])
        self.cache.release_many([seq_id], cache=cache)
        self.ledger.forget(seq_id)

    @rule(who=st.integers(0, 3))
    def pin(self, who: int) -> None:
        session, key = self.sessions[who], bytes(4 * BLOCK_SIZE)  # one block of token 0
        num_blocks = self.cache.match(key, "ns") // BLOCK_SIZE
        if not num_blocks:
            return
        try:
            self.ledger.check_quota(session.tenant, num_blocks)
            num_pinned = self.cache.pin(key, "ns")
        except Exception:
            return
        self.ledger.add_pin(session, Pin("ns", key[: num_pinned * 4], num_pinned // BLOCK_SIZE))

    @rule(who=st.integers(0, 3))
    def unpin(self, who: int) -> None:
        try:
            pin = self.ledger.take_pin(self.sessions[who], "ns", bytes(4 * BLOCK_SIZE))
        except NotPinned:
            return
        self.cache.unpin(pin.token_bytes, pin.namespace)

    @precondition(lambda self: self.sessions)
    @rule(who=st.integers(0, 3))
    def end_session(self, who: int) -> None:
        session = self.sessions[who]
        seq_ids, pins = self.ledger.take_session(session)
        if seq_ids:
            self.cache.release_many(seq_ids, cache=False)
        for pin in pins:
            self.cache.unpin(pin.token_bytes, pin.namespace)
        self.sessions[who] = _session(session.tenant, 100 + who)

    @invariant()
    def agrees_with_the_core(self) -> None:
        self.cache.check_invariants()
        self.ledger.check_invariants(self.cache)
        quota = TENANTS[0].max_blocks
        assert quota is not None and self.ledger.tenant_blocks(TENANTS[0]) <= quota
        for tenant in TENANTS:
            assert self.ledger.tenant_host_blocks(tenant) <= HOST_SHARE
        for seq_id in self.cache.sequence_ids() + self.cache.preempted_sequence_ids():
            assert self.ledger.prepaid.left(seq_id) == self.prepaid.get(seq_id, 0), f"sequence {seq_id}: prepaid"


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=examples(150), stateful_step_count=30, deadline=None)


def _opened(cache: KVCache, ledger: PoolLedger, session: Session, num_tokens: int, budget: int = 0) -> int:
    (result,) = cache.open_many([([1] * num_tokens, "ns")], max_new_tokens=[budget])
    ledger.adopt_opened(session, cache, [result], [budget])
    return result.seq_id


def test_the_ledger_check_catches_a_charge_that_drifted() -> None:
    cache, ledger = KVCache(16, BLOCK_SIZE), PoolLedger(BLOCK_SIZE)
    seq_id = _opened(cache, ledger, _session(TENANTS[1], 0), 8)
    ledger.check_invariants(cache)
    cache.append_batch([seq_id], [1], [2])  # a third block the ledger was not told of
    with pytest.raises(AssertionError, match=f"sequence {seq_id}: charged 2 blocks, holds .* 3"):
        ledger.check_invariants(cache)


def test_a_foreign_sequence_is_refused_as_an_absent_one() -> None:
    cache, ledger = KVCache(16, BLOCK_SIZE), PoolLedger(BLOCK_SIZE)
    mine, theirs = _session(TENANTS[0], 0), _session(TENANTS[1], 1)
    held = _opened(cache, ledger, theirs, 1)
    for seq_id in (held, held + 1):
        with pytest.raises(UnknownSequence) as refused:
            ledger.check_owner(mine, seq_id)
        assert refused.value.metadata == {"seq_id": str(seq_id)}


def test_a_batch_is_checked_again_at_every_step() -> None:
    cache, ledger = KVCache(16, BLOCK_SIZE), PoolLedger(BLOCK_SIZE)
    mine, theirs = _session(TENANTS[0], 0), _session(TENANTS[1], 1)
    batch = [_opened(cache, ledger, mine, 1) for _ in range(3)]
    ledger.check_owners(mine, batch)
    ledger.check_owners(mine, batch)  # the decode step after: the same batch
    with pytest.raises(UnknownSequence):
        ledger.check_owners(theirs, batch)  # the same batch from another session: not theirs
    ledger.forget(batch[1])
    with pytest.raises(UnknownSequence) as refused:
        ledger.check_owners(mine, batch)
    assert refused.value.metadata == {"seq_id": str(batch[1])}
    ledger.check_owners(mine, [batch[0], batch[2]])
    ledger.forget(batch[0]), ledger.adopt(theirs, cache, batch[0])  # an id moving to another session (a restart's)
    with pytest.raises(UnknownSequence):
        ledger.check_owners(mine, [batch[0], batch[2]])


def test_growth_is_charged_to_each_sequence_and_its_sessions_tenant() -> None:
    cache, ledger = KVCache(32, BLOCK_SIZE), PoolLedger(BLOCK_SIZE)
    a, b = _session(TENANTS[0], 0), _session(TENANTS[1], 1)
    s1, s2, s3, s4 = (_opened(cache, ledger, who, n) for who, n in ((a, 8), (a, 3), (a, 4), (b, 1)))
    assert (ledger.tenant_blocks(TENANTS[0]), ledger.tenant_blocks(TENANTS[1])) == (4, 1)
    assert ledger.append_growth(cache, [s1, s2, s3], [1, 1, 5]) == 3
    ledger.follow_append(a, cache.append_batch([s1, s2, s3], [1, 1, 5], [2] * 7))  # 2 -> 3, 1 stays, 1 -> 3
    assert [cache.num_table_blocks(s) for s in (s1, s2, s3, s4)] == [3, 1, 3, 1]
    assert (ledger.tenant_blocks(TENANTS[0]), ledger.tenant_blocks(TENANTS[1])) == (7, 1)
    ledger.check_invariants(cache)


def test_a_reservation_is_charged_until_the_table_outgrows_it_and_a_preempted_sequence_charges_none() -> None:
    cache, ledger, a = KVCache(64, BLOCK_SIZE, host_num_blocks=16), PoolLedger(BLOCK_SIZE), _session(TENANTS[0], 0)
    assert ledger.blocks_to_open(cache, [1], [19]) == 5  # 1 prompt block + 4 reserved: ceil(20 / 4)
    (opened,) = cache.open_many([([1], "ns")], max_new_tokens=[19])
    ledger.adopt_opened(a, cache, [opened], [19])
    assert (cache.num_table_blocks(opened.seq_id), ledger.tenant_blocks(TENANTS[0])) == (1, 5)
    assert ledger.append_growth(cache, [opened.seq_id], [19]) == 0  # inside its reservation
    ledger.follow_append(a, cache.append_batch([opened.seq_id], [19], [2] * 19))
    assert ledger.tenant_blocks(TENANTS[0]) == 5
    assert ledger.append_growth(cache, [opened.seq_id], [1]) == 1  # past it
    ledger.follow_append(a, cache.append_batch([opened.seq_id], [1], [3]))
    assert ledger.tenant_blocks(TENANTS[0]) == 6
    ledger.check_invariants(cache)
    cache.preempt([opened.seq_id], "swap")
    ledger.preempted(cache, opened.seq_id)
    assert (ledger.tenant_blocks(TENANTS[0]), ledger.tenant_host_blocks(TENANTS[0])) == (0, 6)
    with pytest.raises(LimitExceeded) as refused:
        ledger.check_host_blocks(TENANTS[0], 1, 6)
    assert refused.value.limit == "host_blocks_per_tenant"
    ledger.check_invariants(cache)
    assert ledger.blocks_to_resume(cache, opened.seq_id) == 6
    cache.resume(opened.seq_id)
    ledger.resumed(cache, opened.seq_id)
    assert (ledger.tenant_blocks(TENANTS[0]), ledger.tenant_host_blocks(TENANTS[0])) == (6, 0)
    ledger.check_invariants(cache)


def test_the_machine_reaches_pins() -> None:
    """The state machine above is not hollow: a run of its rules pins and unpins."""
    machine = LedgerMachine()
    machine.open(0, 9, 0, 0)
    seq_id = machine.cache.sequence_ids()[0]
    machine.cache.commit([seq_id], [9])
    machine.cache.release_many([seq_id], cache=True)
    machine.ledger.forget(seq_id)
    machine.pin(0)
    assert machine.ledger.tenant_pinned_blocks(TENANTS[0]) == 1
    machine.agrees_with_the_core()
    machine.end_session(0)
    assert machine.ledger.tenant_pinned_blocks(TENANTS[0]) == 0
    machine.agrees_with_the_core()
