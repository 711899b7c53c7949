"""The server's bookkeeping beside the core: `PoolLedger` against a real `KVCache`, and the request-id window."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.errors import NotPinned, QuotaExceeded, UnknownSequence
from radixkv.kv_cache import KVCache
from radixkv.server.ledger import Pin, PoolLedger
from radixkv.server.sessions import Session
from radixkv.server.tenants import Tenant

BLOCK_SIZE = 4
TENANTS = [Tenant("a", frozenset({"*"}), 40, False), Tenant("b", frozenset({"*"}), None, False)]


def _session(tenant: Tenant, n: int) -> Session:
    return Session(f"s{n}", tenant, 60.0, time.monotonic() + 60)


class LedgerMachine(RuleBasedStateMachine):
    """Random opens, appends, forks, releases, pins and session ends, each mirrored into the ledger
    as the service does it: the ledger must agree with the core after every step, and quotas hold."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCache(64, BLOCK_SIZE)
        self.ledger = PoolLedger(BLOCK_SIZE)
        self.sessions = [_session(TENANTS[i % 2], i) for i in range(4)]

    def _live(self, session: Session) -> list[int]:
        return [s for s in self.cache.sequence_ids() if self.ledger.owner(s) is session]

    @rule(who=st.integers(0, 3), num_tokens=st.integers(1, 24), token=st.integers(0, 3))
    def open(self, who: int, num_tokens: int, token: int) -> None:
        session = self.sessions[who]
        try:
            self.ledger.check_quota(session.tenant, self.ledger.blocks_for(num_tokens))
            (result,) = self.cache.open_many([([token] * num_tokens, "ns")])
        except Exception:
            return
        self.ledger.adopt(session, result.seq_id, len(result.block_table))

    @rule(who=st.integers(0, 3), num_tokens=st.integers(1, 9), data=st.data())
    def append(self, who: int, num_tokens: int, data: st.DataObject) -> None:
        live = self._live(self.sessions[who])
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        growth = max(
            0, self.ledger.blocks_for(self.cache.num_tokens(seq_id) + num_tokens) - self.ledger.num_table_blocks(seq_id)
        )
        try:
            self.ledger.check_quota(self.sessions[who].tenant, growth)
            batch = self.cache.append_batch([seq_id], [num_tokens], [1] * num_tokens)
        except Exception:
            return
        self.ledger.resize(seq_id, batch.table_offsets[0] + batch.num_block_ids[0])

    @rule(who=st.integers(0, 3), data=st.data())
    def fork(self, who: int, data: st.DataObject) -> None:
        session, live = self.sessions[who], self._live(self.sessions[who])
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        try:
            self.ledger.check_quota(session.tenant, self.ledger.num_table_blocks(seq_id))
        except QuotaExceeded:
            return
        self.cache.commit([seq_id], [self.cache.num_tokens(seq_id)])  # as the service does before a fork
        for child in self.cache.fork(seq_id, 1):
            self.ledger.adopt(session, child, self.ledger.num_table_blocks(seq_id))

    @rule(who=st.integers(0, 3), cache=st.booleans(), data=st.data())
    def release(self, who: int, cache: bool, data: st.DataObject) -> None:
        live = self._live(self.sessions[who])
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        if cache:  # its K/V written: its full blocks enter the tree, and pins can take them
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


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_the_ledger_check_catches_a_count_that_drifted() -> None:
    cache, ledger = KVCache(16, BLOCK_SIZE), PoolLedger(BLOCK_SIZE)
    session = _session(TENANTS[1], 0)
    (result,) = cache.open_many([([1] * 9, "ns")])
    ledger.adopt(session, result.seq_id, len(result.block_table) - 1)  # one block short
    with pytest.raises(AssertionError, match="block count stale"):
        ledger.check_invariants(cache)


def test_a_foreign_sequence_is_refused_as_an_absent_one() -> None:
    ledger, mine, theirs = PoolLedger(BLOCK_SIZE), _session(TENANTS[0], 0), _session(TENANTS[1], 1)
    ledger.adopt(theirs, 7, 1)
    for seq_id in (7, 8):
        with pytest.raises(UnknownSequence) as refused:
            ledger.check_owner(mine, seq_id)
        assert refused.value.metadata == {"seq_id": str(seq_id)}


def test_a_batch_checked_once_is_checked_again_when_ownership_changes() -> None:
    ledger, mine, theirs = PoolLedger(BLOCK_SIZE), _session(TENANTS[0], 0), _session(TENANTS[1], 1)
    for seq_id in (1, 2, 3):
        ledger.adopt(mine, seq_id, 1)
    ledger.check_owners(mine, [1, 2, 3])
    ledger.check_owners(mine, [1, 2, 3])  # the decode step after: the same batch, checked already
    with pytest.raises(UnknownSequence):
        ledger.check_owners(theirs, [1, 2, 3])  # checked for another session: not theirs
    ledger.forget(2)
    with pytest.raises(UnknownSequence) as refused:
        ledger.check_owners(mine, [1, 2, 3])
    assert refused.value.metadata == {"seq_id": "2"}
    ledger.adopt(theirs, 4, 1)
    ledger.check_owners(mine, [1, 3])
    ledger.forget(1), ledger.adopt(theirs, 1, 1)  # an id moving to another session (as a restart may adopt it)
    with pytest.raises(UnknownSequence):
        ledger.check_owners(mine, [1, 3])


def test_growth_is_charged_to_each_sequence_and_its_sessions_tenant() -> None:
    ledger, a, b = PoolLedger(BLOCK_SIZE), _session(TENANTS[0], 0), _session(TENANTS[1], 1)
    ledger.adopt(a, 1, 2), ledger.adopt(a, 2, 1), ledger.adopt(a, 3, 1), ledger.adopt(b, 4, 1)
    ledger.follow_append(a, [1, 2, 3], [2, 1, 0], [1, 0, 2])  # 1 grows to 3 blocks, 2 stays, 3 is rewritten to 2
    assert [ledger.num_table_blocks(s) for s in (1, 2, 3, 4)] == [3, 1, 2, 1]
    assert (ledger.tenant_blocks(TENANTS[0]), ledger.tenant_blocks(TENANTS[1])) == (6, 1)
    ledger.follow_append(a, [3], [0], [1])  # shrinks to 1 block (a copy-on-write's rewrite of a shorter table)
    assert ledger.tenant_blocks(TENANTS[0]) == 5


def test_the_machine_reaches_pins() -> None:
    """The state machine above is not hollow: a run of its rules pins and unpins."""
    machine = LedgerMachine()
    machine.open(0, 9, 0)
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
