"""Random histories on a pool with a host tier, with a simulated worker that moves "K/V" as the results say.

The worker holds device and host memory as per-slot tags, where the tag of position p of a sequence is its
tokens up to p (what real K/V depends on). It applies each result exactly as a worker must (offloads, then
copy-on-write copies, then loads, then writes the new tokens), and after every step every live sequence's
table must hold its own tags: a cached or loaded hit is the right K/V, and no transfer clobbered a block in
use. Every invariant, host tier included, is checked after each step.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from radixkv import KVCache
from radixkv.errors import OutOfBlocks
from tests.examples import examples

BLOCK_SIZE = 2
NUM_BLOCKS = 12
NUM_HOST_BLOCKS = 6
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 51, 52, 53], [7, 7, 7, 7, 7, 7]]


class Worker:
    """Device and host memory as slot tags, changed only by applying results."""

    def __init__(self) -> None:
        self.device = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.host = [[None] * BLOCK_SIZE for _ in range(NUM_HOST_BLOCKS)]

    def apply(self, offloads=(), copies=(), loads=()) -> None:
        for device_block, host_block in offloads:
            self.host[host_block] = list(self.device[device_block])
        for src, dst, *_ in copies:
            self.device[dst] = list(self.device[src])
        for host_block, device_block in loads:
            self.device[device_block] = list(self.host[host_block])

    def write(self, table: list[int], tokens: list[int], start: int) -> None:
        for p in range(start, len(tokens)):
            self.device[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = tuple(tokens[: p + 1])

    def check(self, table: list[int], tokens: list[int], seq_id: int) -> None:
        for p in range(len(tokens)):
            held = self.device[table[p // BLOCK_SIZE]][p % BLOCK_SIZE]
            assert held == tuple(tokens[: p + 1]), f"seq {seq_id}: position {p} holds another K/V"


class HostTierMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize()
    def setup(self):
        self.cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=NUM_HOST_BLOCKS)
        self.worker = Worker()
        self.tokens: dict[int, list[int]] = {}
        self.preempted: dict[int, str] = {}  # seq -> mode

    @rule(
        target=seqs, base=st.sampled_from(BASES), cut=st.integers(0, 10), tail=st.lists(st.integers(0, 9), max_size=4)
    )
    def open(self, base, cut, tail):
        tokens = base[:cut] + tail or [0]
        device_tokens, host_tokens = self.cache.match_tiers(tokens)
        try:
            result = self.cache.open(tokens)
        except OutOfBlocks:
            return None
        limit = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert result.num_cached_tokens == min(device_tokens + host_tokens, limit), "open hit what match_tiers said"
        assert result.num_host_hit_tokens == len(result.loads) * BLOCK_SIZE
        assert result.num_host_hit_tokens <= host_tokens
        self.worker.apply(result.offloads, (), result.loads)
        self.worker.write(result.block_table, tokens, result.num_cached_tokens)
        self.cache.commit([result.seq_id], [len(tokens)])
        self.tokens[result.seq_id] = tokens
        return result.seq_id

    @rule(
        first=st.sampled_from(BASES), second=st.sampled_from(BASES), cut=st.integers(1, 10), seq=seqs,
        tail=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    )  # fmt: skip
    def step(self, first, second, cut, seq, tail):
        """Two opens and an append as one result (as a server step): the worker applies every offload of
        the step, then its copies, then every load, then writes."""
        appended = None
        with self.cache.one_result():
            try:
                opened = self.cache.open_many([(first[:cut], "default"), (second[: cut + 1], "default")])
            except OutOfBlocks:
                return
            if seq in self.tokens and seq not in self.preempted:
                try:
                    appended = self.cache.append(seq, tail).batch
                except OutOfBlocks:
                    pass
        offloads = [p for r in opened for p in r.offloads.tolist()] + (appended.offloads.tolist() if appended else [])
        loads = [p for r in opened for p in r.loads.tolist()]
        self.worker.apply(offloads, appended.copies if appended else (), loads)
        for result, tokens in zip(opened, (first[:cut], second[: cut + 1]), strict=True):
            self.worker.write(result.block_table, tokens, result.num_cached_tokens)
            self.tokens[result.seq_id] = list(tokens)
            self.cache.commit([result.seq_id], [len(tokens)])
        if appended is not None:
            old = len(self.tokens[seq])
            self.tokens[seq] = self.tokens[seq] + tail
            self.worker.write(self.cache.block_table(seq), self.tokens[seq], old)
            self.cache.commit([seq], [len(self.tokens[seq])])

    @rule(seq=seqs, tail=st.lists(st.integers(0, 9), min_size=1, max_size=4))
    def append(self, seq, tail):
        if seq not in self.tokens or seq in self.preempted:
            return
        try:
            result = self.cache.append(seq, tail)
        except OutOfBlocks:
            return
        old = len(self.tokens[seq])
        self.tokens[seq] = self.tokens[seq] + tail
        self.worker.apply(result.batch.offloads, result.copies, ())
        self.worker.write(self.cache.block_table(seq), self.tokens[seq], old)
        self.cache.commit([seq], [len(self.tokens[seq])])

    @rule(target=seqs, seq=seqs, n=st.integers(1, 2))
    def fork(self, seq, n):
        if seq not in self.tokens or seq in self.preempted:
            return None
        children = self.cache.fork(seq, n)
        for child in children:
            self.tokens[child] = list(self.tokens[seq])
        return children[0]

    @rule(seq=consumes(seqs), keep=st.booleans())
    def release(self, seq, keep):
        if seq in self.tokens:
            self.cache.release(seq, cache=keep)
            del self.tokens[seq]
            self.preempted.pop(seq, None)

    @rule(seq=seqs, mode=st.sampled_from(["swap", "recompute"]))
    def preempt(self, seq, mode):
        if seq not in self.tokens or seq in self.preempted:
            return
        available = self.cache.num_available_blocks()
        try:
            result = self.cache.preempt([seq], mode)
        except OutOfBlocks as e:
            assert mode == "swap" and e.metadata["tier"] == "host", "only a full host tier refuses a swap"
            return
        assert self.cache.num_available_blocks() - available == result.num_freed_blocks
        assert mode == "swap" or not len(result.offloads)
        self.worker.apply(result.offloads)
        self.preempted[seq] = mode

    @rule(seq=seqs)
    def resume(self, seq):
        if seq not in self.preempted:
            return
        try:
            result = self.cache.resume(seq)
        except OutOfBlocks:
            return
        tokens = self.tokens[seq]
        assert result.seq_id == seq and len(result.slots) == len(tokens) - result.num_cached_tokens
        self.worker.apply(result.offloads, (), result.loads)
        self.worker.write(result.block_table, tokens, result.num_cached_tokens)
        self.cache.commit([seq], [len(tokens)])
        del self.preempted[seq]

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        """Offloads wait for the next result that hands out blocks; the worker applies them only then."""
        self.cache.evict(n)

    @invariant()
    def every_table_holds_its_own_kv(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        for seq, tokens in self.tokens.items():
            if seq not in self.preempted:
                self.worker.check(self.cache.block_table(seq), tokens, seq)
        stats = self.cache.stats()
        assert stats.num_host_blocks_free + stats.num_host_blocks_cached + stats.num_host_blocks_swapped == (
            NUM_HOST_BLOCKS
        )
        assert stats.num_swapped_sequences == sum(mode == "swap" for mode in self.preempted.values())

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        self.cache.release_many(list(self.tokens))
        self.cache.check_invariants()


HostTierMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_host_tier_state_machine = HostTierMachine.TestCase
