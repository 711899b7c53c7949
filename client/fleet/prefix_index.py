"""One instance's cached blocks as a router sees them: content hashes, fed by WatchEvents.

The index is a set of 64-bit block hashes (`radixkv.tree.block_hash`). A hash names a block together
with its whole prefix and namespace, so a request's cached prefix on this instance is the longest
run of its own chain hashes found in the set: no tree, no tokens kept, no RPC per lookup.

It stays honest by the stream's numbers: a snapshot replaces everything; a jump in a namespace's
sequence number (the server dropped events for a slow watcher) means "resync", and a new epoch
(the server restarted) means "rebuild", never "patch".

And it proves itself without a dump: it keeps the same order-independent digest per namespace as the
server (`radixkv.tree.block_hash.digest_of`), moved by each event it applies, and compares it with the digest
each event and each batch carries. Any difference (a lost or misapplied event that the numbers did not
show) is a divergence: counted, and repaired by a resync from a snapshot.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from radixkv.client.fleet.events import EventBatch, KVEvent, KVEventKind
from radixkv.tree.block_hash import WIRE_MASK, mix64


class Verdict(enum.Enum):
    APPLIED = 1
    GAP = 2  # events were missed: reopen the stream with a snapshot
    NEW_EPOCH = 3  # a batch from another incarnation: only a snapshot may follow
    DIVERGED = 4  # the digests disagree with the server's: reopen the stream with a snapshot


class PrefixIndex:
    """Block hashes cached on one instance; `apply` each WatchEvents batch in order."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.epoch = 0  # 0: no snapshot yet, nothing to trust
        self.num_resyncs = 0  # gaps seen
        self.num_rebuilds = 0  # snapshots from a new epoch after the first (the instance restarted)
        self._last_epoch = 0  # survives `reset`, to tell a restart from a reconnect
        self.num_divergences = 0  # digests that disagreed with the server's
        self.digests: dict[str, int] = {}  # namespace -> digest of the blocks this index holds there
        self.num_events_to_drop = 0  # test hook: skip applying this many events (numbers still advance)
        self._numbers: dict[str, int] = {}  # namespace with cached blocks -> last sequence number applied

    @property
    def digest(self) -> int:
        """The digest of every namespace the index holds: equal to the server's for the same namespaces."""
        return sum(self.digests.values()) & WIRE_MASK

    @property
    def ready(self) -> bool:
        return self.epoch != 0

    def reset(self) -> None:
        """The instance is gone (or unreachable): nothing it held can be relied on."""
        self.hashes = set()
        self.digests = {}
        self.epoch = 0
        self._numbers = {}

    def apply(self, batch: EventBatch) -> Verdict:
        if batch.snapshot:
            if self._last_epoch and batch.epoch != self._last_epoch:
                self.num_rebuilds += 1
            self._last_epoch = batch.epoch
            self.hashes = {h for e in batch.events for h in e.block_hashes}  # built aside, swapped whole
            self._numbers = {e.namespace: e.sequence_number for e in batch.events}
            self.digests = {}
            for event in batch.events:
                self._move_digest(event, 1)
            self.epoch = batch.epoch
            if any(self.digests.get(e.namespace, 0) != e.namespace_digest for e in batch.events):
                return self._diverged()
            return self._diverged() if self.digest != batch.digest else Verdict.APPLIED
        if batch.epoch != self.epoch:
            return Verdict.NEW_EPOCH
        for event in batch.events:
            last = self._numbers.get(event.namespace)
            # 1: the namespace's cache emptied and fills again (the server forgot its numbers with it); anything
            # missed before that shows in the digest.
            if last is not None and event.sequence_number not in (last + 1, 1):
                self.num_resyncs += 1
                return Verdict.GAP
            self._numbers[event.namespace] = event.sequence_number
            if self.num_events_to_drop:
                self.num_events_to_drop -= 1
                continue
            if event.kind is KVEventKind.BLOCKS_STORED:
                self.hashes.update(event.block_hashes)
                self._move_digest(event, 1)
            else:
                self.hashes.difference_update(event.block_hashes)
                self._move_digest(event, -1)
            if self.digests.get(event.namespace, 0) != event.namespace_digest:
                return self._diverged()
        return self._diverged() if self.digest != batch.digest else Verdict.APPLIED

    def _move_digest(self, event: KVEvent, sign: int) -> None:
        digest = (self.digests.get(event.namespace, 0) + sign * sum(mix64(h) for h in event.block_hashes)) & WIRE_MASK
        if digest:
            self.digests[event.namespace] = digest
        else:  # nothing cached there: the server keeps nothing of it either
            self.digests.pop(event.namespace, None)
            self._numbers.pop(event.namespace, None)

    def _diverged(self) -> Verdict:
        self.num_divergences += 1
        self.reset()
        return Verdict.DIVERGED

    def num_cached_blocks(self, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` (a request's wire hashes) this instance holds."""
        hashes = self.hashes
        for i, h in enumerate(chain):
            if h not in hashes:
                return i
        return len(chain)
