"""What each tenant is charged, through the real service (in process): after every call, its blocks and host blocks
equal a recount from the core's own facts (table lengths, reservations, swapped-out blocks) and its pins.

The ledger itself against a bare `KVCache`: test_ledger.py.
"""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.errors import RadixKVError
from radixkv.sequences.step import Append, Commit, Step
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.rules.config import ServerConfig, TenantConfig, parse_pool_flag
from radixkv.server.rules.service import KVService
from radixkv.server.rules.tenants import Tenant
from tests.examples import examples

BLOCK_SIZE = 4
POOL = f"p:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},num_blocks=64,host_num_blocks=32"
QUOTA = 24
TENANTS = (TenantConfig(name="a", token="tok-a", max_blocks=QUOTA), TenantConfig(name="b", token="tok-b"))
WHO = st.integers(0, 2)  # sessions 0 and 2 are tenant a's, 1 tenant b's


class ServiceCharges(RuleBasedStateMachine):
    """Opens (with `max_new_tokens`), appends (alone and before a fork in one step), forks, preemptions (swap and
    recompute), resumes, releases (cached or not) and session ends, each a call of the service."""

    def __init__(self) -> None:
        super().__init__()
        config = ServerConfig(pools=(parse_pool_flag(POOL),), tenants=TENANTS)
        self.service = KVService(config, {p.name: build_pool(p, config.watch_queue_size, None) for p in config.pools})
        self.tenants = [Tenant.from_config(t) for t in TENANTS]
        self.session_ids = [self._open_session(who) for who in range(3)]
        self.pool = self.service.pool("p", self.tenants[0])

    def teardown(self) -> None:
        self.service.close()

    def _open_session(self, who: int) -> str:
        return self.service.open_session(self.tenants[who % 2], 600.0).session_id

    def _call(self, who: int, step: Step) -> None:
        try:
            self.service.step(self.tenants[who % 2], self.session_ids[who], "p", step)
        except RadixKVError:
            pass  # a refusal (the quota, the pool full, a preempted sequence): nothing applied, as checked after

    def _held(self, who: int) -> list[int]:
        session = self.service.sessions.get(self.session_ids[who], self.tenants[who % 2])
        return self.pool.ledger.sequences_of(session)

    def _pick(self, data: st.DataObject, seq_ids: list[int]) -> tuple[int, int]:
        """One of `seq_ids`, and which session holds it."""
        seq_id = data.draw(st.sampled_from(seq_ids))
        owner = self.pool.ledger.owner(seq_id)
        assert owner is not None
        return self.session_ids.index(owner.session_id), seq_id

    @rule(who=WHO, num_tokens=st.integers(1, 20), token=st.integers(0, 2), budget=st.integers(0, 30))
    def open(self, who: int, num_tokens: int, token: int, budget: int) -> None:
        self._call(who, Step(opens=[([token] * num_tokens, "")], max_new_tokens=[budget]))

    @precondition(lambda self: self.pool.cache.sequence_ids())
    @rule(num_tokens=st.integers(1, 9), fork=st.booleans(), data=st.data())
    def append(self, num_tokens: int, fork: bool, data: st.DataObject) -> None:
        who, seq_id = self._pick(data, self.pool.cache.sequence_ids())
        forks = [(seq_id, 1)] if fork else []  # a child of the table the append leaves
        self._call(who, Step(append=Append([seq_id], [num_tokens], [1] * num_tokens), forks=forks))

    @precondition(lambda self: self.pool.cache.sequence_ids())
    @rule(num_children=st.integers(1, 2), data=st.data())
    def fork(self, num_children: int, data: st.DataObject) -> None:
        who, seq_id = self._pick(data, self.pool.cache.sequence_ids())
        self._call(who, Step(forks=[(seq_id, num_children)]))

    @precondition(lambda self: self.pool.cache.sequence_ids())
    @rule(swap=st.booleans(), data=st.data())
    def preempt(self, swap: bool, data: st.DataObject) -> None:
        who, seq_id = self._pick(data, self.pool.cache.sequence_ids())
        self._call(who, Step(commit=Commit([seq_id], [self.pool.cache.num_tokens(seq_id)])))  # recompute caches it
        try:
            self.service.preempt(
                self.tenants[who % 2], self.session_ids[who], "p", [seq_id], "swap" if swap else "recompute"
            )
        except RadixKVError:
            pass

    @precondition(lambda self: self.pool.cache.preempted_sequence_ids())
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        who, seq_id = self._pick(data, self.pool.cache.preempted_sequence_ids())
        try:
            self.service.resume(self.tenants[who % 2], self.session_ids[who], "p", seq_id)
        except RadixKVError:
            pass

    @precondition(lambda self: self.pool.cache.sequence_ids() or self.pool.cache.preempted_sequence_ids())
    @rule(keep=st.booleans(), data=st.data())
    def release(self, keep: bool, data: st.DataObject) -> None:
        who, seq_id = self._pick(data, self.pool.cache.sequence_ids() + self.pool.cache.preempted_sequence_ids())
        self._call(who, Step(releases=[([seq_id], keep)]))

    @rule(who=WHO)
    def end_session(self, who: int) -> None:
        self.service.close_session(self.tenants[who % 2], self.session_ids[who])
        self.session_ids[who] = self._open_session(who)

    @invariant()
    def charges_equal_the_cores_recount(self) -> None:
        cache, ledger = self.pool.cache, self.pool.ledger
        cache.check_invariants()
        ledger.check_invariants(cache)
        blocks = dict.fromkeys((t.name for t in self.tenants), 0)
        host_blocks = dict(blocks)
        for seq_id in cache.sequence_ids():
            owner = ledger.owner(seq_id)
            assert owner is not None, f"live sequence {seq_id} owned by no session"
            blocks[owner.tenant.name] += max(len(cache.block_table(seq_id)), cache.reserve_until(seq_id))
        for seq_id in cache.preempted_sequence_ids():
            owner = ledger.owner(seq_id)
            assert owner is not None, f"preempted sequence {seq_id} owned by no session"
            host_blocks[owner.tenant.name] += cache.swap_blocks(seq_id)
        for tenant in self.tenants:
            assert ledger.tenant_pinned_blocks(tenant) == 0
            assert ledger.tenant_blocks(tenant) == blocks[tenant.name], f"tenant {tenant.name}: blocks"
            assert ledger.tenant_host_blocks(tenant) == host_blocks[tenant.name], f"tenant {tenant.name}: host blocks"
        assert blocks["a"] <= QUOTA


TestServiceCharges = ServiceCharges.TestCase
TestServiceCharges.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)


def test_the_machine_reaches_reservations_preemptions_and_forks() -> None:
    """The machine above is not hollow: its rules reserve, swap out, resume and fork what the recount then sees."""
    machine = ServiceCharges()
    try:
        machine.open(0, 5, 0, 11)  # 2 blocks, a reservation up to ceil(16 / 4) = 4
        (seq_id,) = machine._held(0)
        assert machine.pool.ledger.tenant_blocks(machine.tenants[0]) == math.ceil(16 / BLOCK_SIZE)
        machine.append(8, True, _Fixed(seq_id))  # to 13 tokens (inside the reservation), and a child of 4 blocks
        assert len(machine._held(0)) == 2
        assert machine.pool.ledger.tenant_blocks(machine.tenants[0]) == 8
        machine.charges_equal_the_cores_recount()
        machine.preempt(True, _Fixed(seq_id))
        assert machine.pool.ledger.tenant_host_blocks(machine.tenants[0]) > 0
        machine.charges_equal_the_cores_recount()
        machine.resume(_Fixed(seq_id))
        assert machine.pool.ledger.tenant_host_blocks(machine.tenants[0]) == 0
        machine.charges_equal_the_cores_recount()
        machine.end_session(0)
        assert machine.pool.ledger.tenant_blocks(machine.tenants[0]) == 0
        machine.charges_equal_the_cores_recount()
    finally:
        machine.teardown()


class _Fixed:
    """A stand-in for `st.data()` that draws the value given."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object) -> object:
        return self.value
