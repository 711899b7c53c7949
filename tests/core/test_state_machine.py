"""Random scheduler histories against a simple model, with every invariant checked after each step."""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from radixkv import KVCache
from radixkv.errors import OutOfBlocks
from radixkv.kv_cache import Limits

BLOCK_SIZE = 2
NUM_BLOCKS = 24
NAMESPACES = ["a", "b", "c"]
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 51, 52, 53], [7, 7, 7, 7, 7, 7]]

tails = st.lists(st.integers(0, 60), max_size=6)


class CacheMachine(RuleBasedStateMachine):
    """Model: live sequences' tokens, and every prefix ever cached per namespace (with the eviction
    count at that time). A hit must be a cached prefix of the same namespace, and no shorter than
    the longest such prefix while nothing has been evicted since it was cached."""

    seqs = Bundle("seqs")

    @initialize()
    def setup(self):
        self.cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, Limits(max_pinned_fraction=0.25))
        self.tokens: dict[int, list[int]] = {}
        self.namespace: dict[int, str] = {}
        self.published: dict[str, dict[tuple[int, ...], int]] = {ns: {} for ns in NAMESPACES}

    # -- helpers ---------------------------------------------------------------------------------

    def publish(self, seq_id):
        tokens = self.tokens[seq_id]
        full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
        evicted = self.cache.stats().num_evicted_blocks
        for end in range(BLOCK_SIZE, full + 1, BLOCK_SIZE):
            self.published[self.namespace[seq_id]][tuple(tokens[:end])] = evicted

    def evictable_snapshot(self):
        return {b: (n.last_access, n.lock_ref) for _, n in self.cache.tree.nodes() for b in n.block_ids}

    def check_lru(self, before):
        """Blocks that left the tree (only eviction removes them) were used no later than any
        unlocked block that stayed untouched."""
        after = self.evictable_snapshot()
        evicted = [access for b, (access, _) in before.items() if b not in after]
        kept = [access for b, (access, lock) in before.items() if lock == 0 and after.get(b) == (access, 0)]
        if evicted and kept:
            assert max(evicted) <= min(kept), "evicted a block more recently used than one kept"

    # -- rules -----------------------------------------------------------------------------------

    @rule(target=seqs, base=st.sampled_from(BASES), cut=st.integers(0, 10), tail=tails, namespace=st.sampled_from(NAMESPACES))
    def open(self, base, cut, tail, namespace):
        tokens = base[:cut] + tail or [0]
        before = self.evictable_snapshot()
        try:
            result = self.cache.open(tokens, namespace)
        except OutOfBlocks:
            return None
        self.check_lru(before)
        cached = result.num_cached_tokens
        assert cached % BLOCK_SIZE == 0 and cached < len(tokens)
        if cached:
            assert tuple(tokens[:cached]) in self.published[namespace], "a hit on a prefix never cached in this namespace"
        self.tokens[result.seq_id] = tokens
        self.namespace[result.seq_id] = namespace
        return result.seq_id

    @rule(seq=seqs, tail=st.lists(st.integers(0, 60), min_size=1, max_size=5))
    def append(self, seq, tail):
        if seq not in self.tokens:
            return
        before = self.evictable_snapshot()
        try:
            result = self.cache.append(seq, tail)
        except OutOfBlocks:
            return
        self.check_lru(before)
        self.tokens[seq] = self.tokens[seq] + tail
        assert result.num_tokens == len(self.tokens[seq])
        for src, dst in result.copies:
            assert self.cache.pool.ref_counts[dst] == 1 and src != dst

    @rule(target=seqs, seq=seqs, n=st.integers(1, 3))
    def fork(self, seq, n):
        if seq not in self.tokens:
            return None
        children = self.cache.fork(seq, n)
        self.publish(seq)
        for child in children:
            self.tokens[child] = list(self.tokens[seq])
            self.namespace[child] = self.namespace[seq]
            assert self.cache.block_table(child) == self.cache.block_table(seq)
        return children[0]

    @rule(seq=seqs)
    def cache_now(self, seq):
        if seq in self.tokens:
            self.cache.cache(seq)
            self.publish(seq)

    @rule(seq=consumes(seqs), keep=st.booleans())
    def release(self, seq, keep):
        if seq not in self.tokens:
            return
        self.cache.release(seq, cache=keep)
        if keep:
            self.publish(seq)
        del self.tokens[seq], self.namespace[seq]

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 10), namespace=st.sampled_from(NAMESPACES))
    def match(self, base, cut, namespace):
        tokens = base[:cut] or [0]
        m = self.cache.match(tokens, namespace)
        assert m % BLOCK_SIZE == 0
        published = self.published[namespace]
        if m:
            assert tuple(tokens[:m]) in published, "match reports a prefix never cached here"
        evicted_now = self.cache.stats().num_evicted_blocks
        for end in range(len(tokens) // BLOCK_SIZE * BLOCK_SIZE, m, -BLOCK_SIZE):
            when = published.get(tuple(tokens[:end]))
            if when is not None:
                assert when < evicted_now, f"prefix of {end} tokens was cached, nothing evicted since, yet match says {m}"

    @rule(base=st.sampled_from(BASES), cut=st.integers(2, 10), namespace=st.sampled_from(NAMESPACES))
    def pin_and_unpin(self, base, cut, namespace):
        try:
            pinned = self.cache.pin(base[:cut], namespace)
        except Exception as e:  # noqa: BLE001 - any refusal must be one of ours and change nothing
            assert getattr(e, "reason", None) in ("FAILED_PRECONDITION", "LIMIT_EXCEEDED"), repr(e)
            return
        assert pinned > 0
        self.cache.check_invariants()
        self.cache.unpin(base[:cut], namespace)

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.num_live_sequences == len(self.tokens)
        assert stats.num_blocks_free + stats.num_blocks_in_use + stats.num_blocks_evictable == NUM_BLOCKS
        for seq, tokens in self.tokens.items():
            assert self.cache.num_tokens(seq) == len(tokens)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        self.cache.release_many(list(self.tokens))
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.num_blocks_free + stats.num_blocks_evictable == NUM_BLOCKS, "a block leaked"


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_cache_state_machine = CacheMachine.TestCase
