"""Preemption by swap: a sequence's own blocks go to the host tier and come back on resume, under the same id.

`HostSwap` is the host tier's side of `radixkv.pressure.preemption` (its `SwapTier`). Swapping out copies every block
of the table past the sequence's locked tree path to host blocks (offload pairs) and drops every device
hold, so those device blocks are free at once; blocks shared with fork siblings are copied too and stay
with the siblings. The locked path is the tree's: it stays cached (evictable, so it may later move to
the host tier itself, or leave both tiers).

Resuming re-matches that path on the device and the host tier. When all of it is still there, the
sequence comes back whole: the path is locked (its host-resident part loaded), and the swapped blocks are
loaded into new device blocks, so nothing is recomputed past the computed watermark. When part of the
path is gone, the swapped blocks are useless (the K/V after a missing prefix cannot be trusted to be
complete) and the resume recomputes from where the match ends, as a recompute resume would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from radixkv.errors import FailedPrecondition, OutOfBlocks
from radixkv.memory.block_pairs import NO_PAIRS, Pairs, concat_pairs
from radixkv.memory.block_pool import NO_BLOCKS, cdiv
from radixkv.pressure.preemption import ResumeResult
from radixkv.sequences.admission import Allocator
from radixkv.sequences.publish import release
from radixkv.sequences.results import SlotPlan
from radixkv.sequences.sequence import BlockTable, LiveSequence, PreemptedSequence, path_runs
from radixkv.tree.host_tier import BlockIds, HostTier
from radixkv.tree.radix_tree import Node, TokenKey


@dataclasses.dataclass(frozen=True, slots=True)
class SwappedBlocks:
    """What the host tier keeps for a swapped-out sequence (`PreemptedSequence.host`)."""

    num_path_blocks: int  # leading blocks of its table the tree held (its locked path when swapped out)
    host_block_ids: BlockIds  # the rest of its table, in order, on the host


class HostSwap:
    """`SwapTier` over a cache's allocator and host tier; `root(namespace)` gives a namespace's tree root."""

    def __init__(self, blocks: Allocator, host: HostTier, root: Callable[[str], Node]) -> None:
        self.blocks, self.host, self.root = blocks, host, root

    def swap_out(self, sequences: list[LiveSequence]) -> tuple[Pairs, list[object]]:
        """Copy each sequence's blocks past its locked path to the host tier and drop all its device holds.

        All or none: OutOfBlocks (host blocks needed, free or evictable on the host) and nothing changes when
        the host tier cannot take them all; FailedPrecondition when the pool has none (a tier of no blocks). The
        offload pairs include any still pending from evictions.
        """
        host = self.host
        if not host.enabled:
            raise FailedPrecondition("mode: swap needs a host tier, and this pool has none", field="mode")
        needed = sum(map(num_swap_blocks, sequences))
        if not host.can_make_room(needed):
            error = OutOfBlocks(needed, host.pool.num_free + host.num_evictable())
            error.metadata["tier"] = "host"
            raise error
        kept: list[object] = []
        for seq in sequences:
            own = seq.block_table[seq.num_tree_blocks :]
            host_ids = host.offload_private(own)
            assert host_ids is not None, "the host tier had room for every swapped block"
            release(self.blocks.tree, self.blocks.pool, seq, cache=False)
            kept.append(SwappedBlocks(seq.num_tree_blocks, host_ids))
        host.num_swapped_sequences += len(sequences)
        return host.take_offloads(), kept

    def swap_in(self, record: PreemptedSequence, reserve: int) -> tuple[LiveSequence, ResumeResult]:
        """Bring `record` back (see the module docstring); OutOfBlocks and nothing changes when the blocks it
        takes plus `reserve` exceed the unreserved blocks."""
        blocks, host, tree = self.blocks, self.host, self.blocks.tree
        swapped = record.host
        assert isinstance(swapped, SwappedBlocks), "a swapped-out sequence keeps its SwappedBlocks"
        bs, key = tree.block_size, TokenKey(record.token_bytes)
        root = self.root(record.namespace)
        match = tree.match(root, key.data, swapped.num_path_blocks)
        _, _, num_on_host = host.match(match, key.data, swapped.num_path_blocks)
        whole = match.num_blocks + num_on_host == swapped.num_path_blocks
        num_new = cdiv(key.num_tokens, bs) - match.num_blocks
        try:
            blocks.refuse_unless(num_new + match.num_newly_locked() + reserve, blocks.num_unreserved())
        except OutOfBlocks:
            tree.drop_empty_roots()  # the namespace `root` may have made
            raise
        node = tree.split(match)
        tree.lock(node)
        on_host = host.plan_load(key.data, node, match.num_blocks, swapped.num_path_blocks)
        new_blocks = blocks.allocate(num_new)
        node, path_loads = host.load_back(node, on_host, new_blocks)
        num_matched = match.num_blocks + num_on_host
        own = new_blocks[num_on_host:]
        if whole:
            own_loads = host.load_private(swapped.host_block_ids, own)
            num_computed = record.num_computed_tokens
        else:
            host.release_swapped(swapped.host_block_ids)
            own_loads, num_computed = NO_PAIRS, num_matched * bs
        host.num_swapped_sequences -= 1
        table = BlockTable.of([*path_runs(node), own])
        seq = LiveSequence(
            record.seq_id,
            namespace=record.namespace,
            tail=key.tail_after(num_matched * bs),
            block_table=table,
            lock_node=node,
            num_tree_blocks=num_matched,
            private_prefix=NO_BLOCKS,
            num_tokens=key.num_tokens,
            num_computed_tokens=num_computed,
            priority=record.priority,
            reserve_until=record.reserve_until,
        )
        table_ids = table.array()
        slots = SlotPlan(
            block_size=bs,
            span_blocks=table_ids[num_computed // bs :],
            span_starts=[num_computed % bs],
            counts=[key.num_tokens - num_computed],
        )
        resumed = ResumeResult(
            seq_id=record.seq_id,
            num_cached_tokens=num_computed,
            block_table=table_ids,
            slot_source=slots,
            num_host_hit_tokens=num_on_host * bs,
            offloads=host.take_offloads(),
            loads=concat_pairs([path_loads, own_loads]),
        )
        return seq, resumed

    def discard(self, record: PreemptedSequence) -> None:
        """A swapped-out sequence is released: its host blocks are free."""
        assert isinstance(record.host, SwappedBlocks), "a swapped-out sequence keeps its SwappedBlocks"
        self.host.release_swapped(record.host.host_block_ids)
        self.host.num_swapped_sequences -= 1


def num_swap_blocks(seq: LiveSequence) -> int:
    """Host blocks swapping `seq` out takes: its table past its locked path."""
    return len(seq.block_table) - seq.num_tree_blocks


def swapped_host_blocks(records: Iterable[PreemptedSequence]) -> list[BlockIds]:
    """The host blocks each swapped-out record holds (for the host tier's recount)."""
    return [r.host.host_block_ids for r in records if isinstance(r.host, SwappedBlocks)]
