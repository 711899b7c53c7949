"""Random scheduler histories against a simple model, with every invariant checked after each step."""

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from radixkv import KVCache
from radixkv.errors import FailedPrecondition, InvalidArgument, NotAdmitted, OutOfBlocks, SequencePreempted
from radixkv.kv_cache import Limits
from radixkv.memory.block_pool import cdiv
from radixkv.pressure.preemption import all_token_bytes
from tests.examples import examples

BLOCK_SIZE = 2
NUM_BLOCKS = 24
NAMESPACES = ["a", "b", "c"]
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 51, 52, 53], [7, 7, 7, 7, 7, 7]]

tails = st.lists(st.integers(0, 60), max_size=6)


class CacheMachine(RuleBasedStateMachine):
    """Model: live sequences' tokens and computed watermarks, and every prefix ever cached per
    namespace (with the eviction count at that time). A hit must be a prefix some sequence of the
    same namespace cached with all its tokens computed (never unwritten K/V), and no shorter than
    the longest such prefix while nothing has been evicted since it was cached.

    Where a fork shares not-yet-computed full blocks by count, publishing them waits until every holder
    in the family has computed them, or the others go; the model does not track who holds what, so past
    `sure` it only allows those hits.

    Admission with a budget: the model knows each sequence's reserved table length, so an append
    inside it (and with no copy-on-write: never shared by a fork) must succeed. Preempted sequences
    keep their tokens and refuse everything but resume and release; victims follow the priority order.
    """

    seqs = Bundle("seqs")

    @initialize()
    def setup(self):
        self.cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, Limits(max_pinned_fraction=0.25), watermark_fraction=0.1)
        self.tokens: dict[int, list[int]] = {}
        self.namespace: dict[int, str] = {}
        self.computed: dict[int, int] = {}  # the watermark
        self.sure: dict[int, int] = {}  # leading full blocks certainly published by this sequence
        self.shared_upto: dict[int, int] = {}  # full blocks a fork may still share by count
        self.reserve_until: dict[int, int] = {}  # the table length each admission reserved up to
        self.priority: dict[int, int] = {}
        self.forked: set[int] = set()  # parents and children of forks: their appends may copy
        self.preempted: set[int] = set()
        self.published: dict[str, dict[tuple[int, ...], int]] = {ns: {} for ns in NAMESPACES}  # must hit
        self.allowed: dict[str, set[tuple[int, ...]]] = {ns: set() for ns in NAMESPACES}  # may hit

    # -- helpers ---------------------------------------------------------------------------------

    def track(self, seq_id, tokens, namespace, computed, sure=0, shared_upto=0, reserve_until=0, priority=0):
        self.tokens[seq_id], self.namespace[seq_id], self.computed[seq_id] = tokens, namespace, computed
        self.sure[seq_id], self.shared_upto[seq_id] = sure, shared_upto
        self.reserve_until[seq_id], self.priority[seq_id] = reserve_until, priority

    def forget(self, seq_id):
        for table in (self.tokens, self.namespace, self.computed, self.sure, self.shared_upto, self.reserve_until,
                      self.priority):  # fmt: skip
            del table[seq_id]
        self.forked.discard(seq_id)
        self.preempted.discard(seq_id)

    def live(self, seq_id):
        """A live sequence of the model; a preempted one must refuse `call` with SequencePreempted."""
        return seq_id in self.tokens and seq_id not in self.preempted

    def refused_while_preempted(self, seq_id, call):
        if seq_id not in self.preempted:
            return False
        before = self.cache.stats()
        try:
            call()
        except SequencePreempted as e:
            assert e.seq_id == seq_id
        else:
            raise AssertionError("a preempted sequence accepted an operation")
        assert self.cache.stats().num_blocks_free == before.num_blocks_free
        return True

    def publish(self, seq_id):
        tokens, namespace = self.tokens[seq_id], self.namespace[seq_id]
        num_full = min(self.computed[seq_id], len(tokens)) // BLOCK_SIZE
        if self.shared_upto[seq_id] <= self.sure[seq_id]:
            self.sure[seq_id] = max(self.sure[seq_id], num_full)
        evicted = self.cache.stats().num_evicted_blocks
        for blocks in range(1, num_full + 1):
            prefix = tuple(tokens[: blocks * BLOCK_SIZE])
            self.allowed[namespace].add(prefix)
            if blocks <= self.sure[seq_id]:
                self.published[namespace][prefix] = evicted

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

    @rule(
        target=seqs,
        base=st.sampled_from(BASES),
        cut=st.integers(0, 10),
        tail=tails,
        namespace=st.sampled_from(NAMESPACES),
    )
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
            assert tuple(tokens[:cached]) in self.allowed[namespace], (
                "a hit on a prefix never cached written in this namespace"
            )
        self.track(result.seq_id, tokens, namespace, cached, cached // BLOCK_SIZE)
        return result.seq_id

    @rule(
        target=seqs,
        base=st.sampled_from(BASES),
        cut=st.integers(0, 10),
        tail=tails,
        max_new_tokens=st.integers(1, 12),
        priority=st.integers(0, 3),
    )
    def open_budgeted(self, base, cut, tail, max_new_tokens, priority):
        """Admission by token budget: admitted with its growth reserved, or refused changing nothing."""
        tokens = base[:cut] + tail or [0]
        available = self.cache.num_available_blocks() - self.cache.stats().num_blocks_reserved
        try:
            result = self.cache.open(tokens, "a", max_new_tokens=max_new_tokens, priority=priority)
        except (NotAdmitted, OutOfBlocks) as e:
            assert isinstance(e, NotAdmitted), "a budgeted open is refused as NotAdmitted"
            assert e.blocks_needed > e.blocks_available
            assert e.blocks_available == max(0, available - self.cache.budget.watermark_blocks)
            return None
        until = cdiv(len(tokens) + max_new_tokens, BLOCK_SIZE)
        cached = result.num_cached_tokens
        self.track(result.seq_id, tokens, "a", cached, cached // BLOCK_SIZE, 0, until, priority)
        return result.seq_id

    @rule(target=seqs, base=st.sampled_from(BASES), cut=st.integers(1, 10), namespace=st.sampled_from(NAMESPACES))
    def lock_prefix(self, base, cut, namespace):
        tokens = base[:cut]
        free = self.cache.stats().num_blocks_free
        try:
            result = self.cache.lock_prefix(tokens, namespace)
        except OutOfBlocks:  # its cached blocks would eat into reservations
            assert self.cache.stats().num_blocks_free == free
            return None
        cached = result.num_cached_tokens
        assert self.cache.stats().num_blocks_free == free, "locking a prefix allocates nothing"
        if cached:
            assert tuple(tokens[:cached]) in self.allowed[namespace], "locked a prefix never cached written"
        self.track(result.seq_id, tokens[:cached], namespace, cached, cached // BLOCK_SIZE)
        return result.seq_id

    @rule(seq=seqs, data=st.data())
    def commit(self, seq, data):
        if seq not in self.tokens or self.refused_while_preempted(seq, lambda: self.cache.commit([seq], [0])):
            return
        n = data.draw(st.integers(0, len(self.tokens[seq])))
        if n < self.computed[seq]:
            try:
                self.cache.commit([seq], [n])
            except InvalidArgument as e:
                assert e.field == "num_tokens[0]"
            else:
                raise AssertionError("commit moved the watermark backwards")
            return
        self.cache.commit([seq], [n])
        self.computed[seq] = n

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        before = self.evictable_snapshot()
        evictable = self.cache.stats().num_blocks_evictable
        assert self.cache.evict(n) == min(n, evictable)
        self.check_lru(before)

    @rule(seq=seqs, tail=st.lists(st.integers(0, 60), min_size=1, max_size=5))
    def append(self, seq, tail):
        if seq not in self.tokens or self.refused_while_preempted(seq, lambda: self.cache.append(seq, tail)):
            return
        before = self.evictable_snapshot()
        fits = self.cache.can_append([seq], [len(tail)])
        reserved = cdiv(len(self.tokens[seq]) + len(tail), BLOCK_SIZE) <= self.reserve_until[seq]
        try:
            result = self.cache.append(seq, tail)
        except OutOfBlocks:
            assert not fits, "can_append said yes, append ran out of blocks"
            assert not reserved or seq in self.forked, "an append inside its reservation ran out of blocks"
            return
        assert fits, "can_append said no, append succeeded"
        self.check_lru(before)
        self.computed[seq] = max(self.computed[seq], len(self.tokens[seq]))
        self.tokens[seq] = self.tokens[seq] + tail
        assert result.num_tokens == len(self.tokens[seq])
        for src, dst in result.copies:
            assert self.cache.pool.ref_counts[dst] == 1 and src != dst

    @rule(target=seqs, seq=seqs, n=st.integers(1, 3))
    def fork(self, seq, n):
        if seq not in self.tokens or self.refused_while_preempted(seq, lambda: self.cache.fork(seq, n)):
            return None
        children = self.cache.fork(seq, n)
        self.forked.update([seq, *children])
        self.publish(seq)
        shared = len(self.tokens[seq]) // BLOCK_SIZE if self.sure[seq] < len(self.tokens[seq]) // BLOCK_SIZE else 0
        self.shared_upto[seq] = max(self.shared_upto[seq], shared)
        for child in children:
            self.track(
                child,
                list(self.tokens[seq]),
                self.namespace[seq],
                self.computed[seq],
                self.sure[seq],
                self.shared_upto[seq],
                priority=self.priority[seq],
            )
            assert self.cache.block_table(child) == self.cache.block_table(seq)
            assert self.cache.num_computed_tokens(child) == self.computed[seq]
        return children[0]

    @rule(seq=seqs)
    def cache_now(self, seq):
        if seq in self.tokens and not self.refused_while_preempted(seq, lambda: self.cache.cache(seq)):
            self.cache.cache(seq)
            self.publish(seq)

    @rule(seq=consumes(seqs), other=seqs, both=st.booleans(), keep=st.booleans())
    def release(self, seq, other, both, keep):
        """Release one sequence or two together; `freeable_blocks` must have predicted the gain."""
        batch = [s for s in ([seq, other] if both else [seq]) if s in self.tokens]
        batch = list(dict.fromkeys(batch))
        if not batch:
            return
        live = [s for s in batch if s not in self.preempted]
        expected = self.cache.freeable_blocks(live)
        available = self.cache.num_available_blocks()
        self.cache.release_many(batch, cache=keep)
        assert self.cache.num_available_blocks() - available == expected, "freeable_blocks mispredicted the release"
        for s in batch:
            if keep and s in live:
                self.publish(s)
            self.forget(s)

    @rule(seq=seqs, commit_first=st.booleans())
    def preempt(self, seq, commit_first):
        """Recompute: like a cached release that keeps the id and tokens; a second preempt is refused."""
        if seq not in self.tokens or self.refused_while_preempted(seq, lambda: self.cache.preempt([seq], "recompute")):
            return
        if commit_first:  # what a scheduler does: what the worker wrote is published, not recomputed
            self.cache.commit([seq], [len(self.tokens[seq])])
            self.computed[seq] = len(self.tokens[seq])
        expected = self.cache.freeable_blocks([seq])
        result = self.cache.preempt([seq], "recompute")
        assert result.num_freed_blocks == expected and not len(result.offloads)
        self.publish(seq)
        self.preempted.add(seq)
        self.computed[seq] = 0
        assert self.cache.block_table(seq) == [] and self.cache.is_preempted(seq)

    @rule(seq=seqs)
    def resume(self, seq):
        if seq not in self.tokens:
            return
        if seq not in self.preempted:
            try:
                self.cache.resume(seq)
            except FailedPrecondition as e:
                assert e.reason == "FAILED_PRECONDITION"
            else:
                raise AssertionError("resumed a live sequence")
            return
        tokens, namespace = self.tokens[seq], self.namespace[seq]
        before = self.cache.stats()
        try:
            result = self.cache.resume(seq)
        except OutOfBlocks:
            after = self.cache.stats()
            assert (after.num_blocks_free, after.num_blocks_reserved) == (before.num_blocks_free,
                                                                          before.num_blocks_reserved)  # fmt: skip
            return
        assert result.seq_id == seq
        cached = result.num_cached_tokens
        assert cached % BLOCK_SIZE == 0 and (cached < len(tokens) or cached == 0)
        if cached:
            assert tuple(tokens[:cached]) in self.allowed[namespace], "resume hit a prefix never cached written"
        assert len(result.slots) == len(tokens) - cached
        self.preempted.discard(seq)
        self.computed[seq], self.sure[seq], self.shared_upto[seq] = cached, cached // BLOCK_SIZE, 0
        self.forked.discard(seq)

    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def victims(self, n):
        chosen = self.cache.victims(n)
        live = [s for s in self.tokens if s not in self.preempted]
        assert set(chosen) <= set(live)
        order = sorted(live, key=lambda s: (self.priority[s], -s))
        assert chosen == order[: len(chosen)], "victims out of priority-then-latest order"
        reserved = sum(max(0, self.reserve_until[s] - len(self.cache.block_table(s))) for s in chosen)
        given = self.cache.freeable_blocks(chosen) + reserved if chosen else 0
        assert given >= n or chosen == order, "victims stopped short"
        if chosen:
            shorter = chosen[:-1]
            less = self.cache.freeable_blocks(shorter) + sum(
                max(0, self.reserve_until[s] - len(self.cache.block_table(s))) for s in shorter
            )
            assert less < n, "victims took one more than needed"

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 10), namespace=st.sampled_from(NAMESPACES))
    def match(self, base, cut, namespace):
        tokens = base[:cut] or [0]
        m = self.cache.match(tokens, namespace)
        assert m % BLOCK_SIZE == 0
        published = self.published[namespace]
        if m:
            assert tuple(tokens[:m]) in self.allowed[namespace], "match reports a prefix never cached written here"
        evicted_now = self.cache.stats().num_evicted_blocks
        for end in range(len(tokens) // BLOCK_SIZE * BLOCK_SIZE, m, -BLOCK_SIZE):
            when = published.get(tuple(tokens[:end]))
            if when is not None:
                assert when < evicted_now, (
                    f"prefix of {end} tokens was cached, nothing evicted since, yet match says {m}"
                )

    @rule(base=st.sampled_from(BASES), cut=st.integers(2, 10), namespace=st.sampled_from(NAMESPACES))
    def pin_and_unpin(self, base, cut, namespace):
        try:
            pinned = self.cache.pin(base[:cut], namespace)
        except Exception as e:  # noqa: BLE001 - any refusal must be one of ours and change nothing
            assert getattr(e, "reason", None) in ("FAILED_PRECONDITION", "LIMIT_EXCEEDED", "OUT_OF_BLOCKS"), repr(e)
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
        assert stats.num_live_sequences == len(self.tokens) - len(self.preempted)
        assert stats.num_preempted_sequences == len(self.preempted)
        assert stats.num_blocks_free + stats.num_blocks_in_use + stats.num_blocks_evictable == NUM_BLOCKS
        reserved = 0
        for seq, tokens in self.tokens.items():
            assert self.cache.num_tokens(seq) == len(tokens)
            assert self.cache.num_computed_tokens(seq) == self.computed[seq]
            assert self.cache.num_table_blocks(seq) == len(self.cache.block_table(seq))  # 0 while preempted
            if seq not in self.preempted:
                reserved += max(0, self.reserve_until[seq] - len(self.cache.block_table(seq)))
                live = self.cache._sequences.get(seq)  # its tokens: the locked path's, then its tail
                assert np.frombuffer(all_token_bytes(live), dtype="<i4").tolist() == tokens
        assert stats.num_blocks_reserved == reserved

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        self.cache.release_many(list(self.tokens))
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.num_blocks_free + stats.num_blocks_evictable == NUM_BLOCKS, "a block leaked"


CacheMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_cache_state_machine = CacheMachine.TestCase
