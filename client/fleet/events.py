"""Prefix-tree events as a router consumes them: blocks stored and removed, numbered per namespace."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from types import TracebackType

import grpc

from radixkv.client.errors import error_from_rpc
from radixkv.v1 import kvcache_pb2 as pb


class KVEventKind(enum.Enum):
    BLOCKS_STORED = pb.KV_EVENT_KIND_BLOCKS_STORED
    BLOCKS_REMOVED = pb.KV_EVENT_KIND_BLOCKS_REMOVED


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVEvent:
    """One change to a namespace's cached blocks.

    `sequence_number` grows by one per event within a namespace: a jump means events were missed,
    so rebuild from a new stream with `include_snapshot=True`. It starts again at 1 when the namespace's
    cache emptied and fills again (the server keeps nothing of a namespace without cached blocks).
    Snapshot events carry the number the snapshot is current to.
    """

    sequence_number: int
    namespace: str
    kind: KVEventKind
    block_ids: list[int]
    token_ids: list[int]  # BLOCKS_STORED: block_size tokens per block
    parent_block_id: int | None  # BLOCKS_STORED: the block before these; None at the namespace's root
    snapshot: bool  # part of the snapshot the stream started with
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # content hashes (low 64 bits), beside block_ids
    parent_block_hash: int | None = None  # BLOCKS_STORED: hash of the block before these; None at the root
    epoch: int = 0  # the server's incarnation: a new value means it restarted (rebuild, do not patch)
    seq: int = 0  # the caller's event count (its tenant's; the pool's, auth off) up to the end of the response
    namespace_digest: int = 0  # the namespace's digest after this event (`radixkv.tree.block_hash.digest_of`)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    """One WatchEvents response: the server's epoch, the caller's event count (its tenant's), and its events."""

    epoch: int
    seq: int
    snapshot: bool
    events: list[KVEvent]
    digest: int = 0  # of every namespace the stream watches, after this batch


def _event(e: pb.KVEvent, response: pb.WatchEventsResponse) -> KVEvent:
    return KVEvent(
        sequence_number=e.sequence_number,
        namespace=e.namespace,
        kind=KVEventKind(e.kind),
        block_ids=list(e.block_ids),
        token_ids=list(e.token_ids),
        parent_block_id=e.parent_block_id if e.HasField("parent_block_id") else None,
        snapshot=response.snapshot,
        block_hashes=list(e.block_hashes),
        parent_block_hash=e.parent_block_hash if e.HasField("parent_block_hash") else None,
        epoch=response.epoch,
        seq=response.seq,
        namespace_digest=e.namespace_digest,
    )


def event_batch(response: pb.WatchEventsResponse) -> EventBatch:
    """One WatchEvents response as the clients hand it out."""
    events = [_event(e, response) for e in response.events]
    return EventBatch(
        epoch=response.epoch, seq=response.seq, snapshot=response.snapshot, events=events, digest=response.digest
    )


class EventStream:
    """An open WatchEvents stream: iterate it for events; `cancel()` (or leaving `with`) ends it."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[KVEvent]:
        for batch in self.batches():
            yield from batch.events

    def batches(self) -> Iterator[EventBatch]:
        """One batch per response, empty ones included (an empty snapshot still names the epoch)."""
        try:
            for response in self._call:  # type: ignore[attr-defined]
                yield event_batch(response)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(e) from e

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()
