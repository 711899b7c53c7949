"""Each open sequence's block table on the client, followed from the deltas the server answers (no RPC to read).

Both clients keep one; the server sends what changed (a new sequence's table, an append's new
blocks from an offset, a fork's parent), never whole tables again.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

from radixkv.errors import UnknownSequence
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.sequences.step import Step, StepResult


class BlockTables:
    """Each open sequence's block table as the server's deltas built it here; thread-safe."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def get(self, seq_id: int) -> list[int]:
        with self._lock:
            table = self._tables.get(seq_id)
            if table is None:
                raise UnknownSequence(seq_id)
            return list(table)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()

    def opened(self, results: Iterable[OpenResult]) -> None:
        with self._lock:
            for result in results:
                self._tables[result.seq_id] = result.block_table.tolist()

    def appended(self, batch: AppendBatch) -> None:
        # Only sequences that got blocks changed (about 1 in block_size per decode step): visit just those.
        if not batch.block_ids:
            return
        changed = itertools.compress(range(len(batch.num_block_ids)), batch.num_block_ids)
        with self._lock:
            start = 0
            for i in changed:
                num_blocks = batch.num_block_ids[i]
                table = self._tables.get(batch.seq_ids[i])
                if table is not None:
                    table[batch.table_offsets[i] :] = batch.block_ids[start : start + num_blocks]
                start += num_blocks

    def forked(self, parent: int, children: Iterable[int]) -> None:
        with self._lock:
            table = self._tables.get(parent, [])
            for child in children:
                self._tables[child] = list(table)

    def preempted(self, seq_ids: Iterable[int]) -> None:
        """Preempted sequences hold no block until resumed (`opened` with the resume's result)."""
        with self._lock:
            for seq_id in seq_ids:
                if seq_id in self._tables:
                    self._tables[seq_id] = []

    def released(self, seq_ids: Iterable[int]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._tables.pop(seq_id, None)

    def stepped(self, step: Step, result: StepResult) -> None:
        """A step's changes, in the order the server applied them."""
        if result.opened:
            self.opened(result.opened)
        if result.appended is not None:
            self.appended(result.appended)
        for (parent, _), children in zip(step.forks, result.forked, strict=True):
            self.forked(parent, children)
        for seq_ids, _ in step.releases:
            self.released(seq_ids)
