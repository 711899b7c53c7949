"""One instance's cached blocks as a router sees them: content hashes, fed by WatchEvents.

The index is a set of 64-bit block hashes (`radixkv.block_hash`). A hash names a block together
with its whole prefix and namespace, so a request's cached prefix on this instance is the longest
run of its own chain hashes found in the set: no tree, no tokens kept, no RPC per lookup.

It stays honest by the stream's numbers: a snapshot replaces everything; a jump in a namespace's
sequence number (the server dropped events for a slow watcher) means "resync", and a new epoch
(the server restarted) means "rebuild", never "patch".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from radixkv.client.events import EventBatch, KVEventKind


class Verdict(enum.Enum):
    APPLIED = 1
    GAP = 2  # events were missed: reopen the stream with a snapshot
    NEW_EPOCH = 3  # a batch from another incarnation: only a snapshot may follow


class PrefixIndex:
    """Block hashes cached on one instance; `apply` each WatchEvents batch in order."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.epoch = 0  # 0: no snapshot yet, nothing to trust
        self.num_resyncs = 0  # gaps seen
        self.num_rebuilds = 0  # snapshots from a new epoch after the first (the instance restarted)
        self._last_epoch = 0  # survives `reset`, to tell a restart from a reconnect
        self._numbers: dict[str, int] = {}  # namespace -> last sequence number applied

    @property
    def ready(self) -> bool:
        return self.epoch != 0

    def reset(self) -> None:
        """The instance is gone (or unreachable): nothing it held can be relied on."""
        self.hashes = set()
        self.epoch = 0
        self._numbers = {}

    def apply(self, batch: EventBatch) -> Verdict:
        if batch.snapshot:
            if self._last_epoch and batch.epoch != self._last_epoch:
                self.num_rebuilds += 1
            self._last_epoch = batch.epoch
            self.hashes = {h for e in batch.events for h in e.block_hashes}  # built aside, swapped whole
            self._numbers = {e.namespace: e.sequence_number for e in batch.events}
            self.epoch = batch.epoch
            return Verdict.APPLIED
        if batch.epoch != self.epoch:
            return Verdict.NEW_EPOCH
        for event in batch.events:
            last = self._numbers.get(event.namespace)
            if last is not None and event.sequence_number != last + 1:
                self.num_resyncs += 1
                return Verdict.GAP
            self._numbers[event.namespace] = event.sequence_number
            if event.kind is KVEventKind.BLOCKS_STORED:
                self.hashes.update(event.block_hashes)
            else:
                self.hashes.difference_update(event.block_hashes)
        return Verdict.APPLIED

    def num_cached_blocks(self, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` (a request's wire hashes) this instance holds."""
        hashes = self.hashes
        for i, h in enumerate(chain):
            if h not in hashes:
                return i
        return len(chain)
