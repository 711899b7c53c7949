"""radixkv's block events for vLLM's `take_events`: what the shared store holds, in vLLM's KV-events records.

vLLM publishes what its connector reports beside its own prefix cache's events (`--kv-events-config`), so a
KV-aware router (llm-d's precise prefix-cache scorer, Dynamo) learns which prefixes this engine can load from
radixkv. A thread reads the pool's WatchEvents stream (every namespace the session may see, from now on) and
queues each event as vLLM's `BlockStored` / `BlockRemoved`: radixkv's content hashes, the low 64 bits of the
`sha256_cbor` chain, which are vLLM's own int hashes when it runs `--prefix-caching-hash-algo sha256_cbor`.
`medium` says where the blocks are: radixkv's CPU pool, or a device pool. A broken stream (the server down or
restarted) is reopened after a pause; events in between are lost, as a router's resync covers.
"""

from __future__ import annotations

import collections
import logging
import threading

from radixkv.client import KVEvent, KVEventKind, RadixKVClient
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, KVCacheEvent

log = logging.getLogger("radixkv.vllm")
MAX_QUEUED = 100_000  # events kept for the next take (vLLM takes them every step); the oldest go first
REOPEN_AFTER = 5.0  # seconds before reopening a stream that broke


def vllm_event(event: KVEvent, block_size: int, medium: str) -> KVCacheEvent:
    if event.kind is KVEventKind.BLOCKS_STORED:
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
    return BlockRemoved(block_hashes=list(event.block_hashes), medium=medium)


class EventRelay:
    """A thread from radixkv's WatchEvents to a queue `take` empties."""

    def __init__(self, client: RadixKVClient, block_size: int, device: str) -> None:
        self._client = client
        self._block_size = block_size
        self._medium = MEDIUM_CPU if device.startswith("cpu") else MEDIUM_GPU
        self._queue: collections.deque[KVCacheEvent] = collections.deque(maxlen=MAX_QUEUED)
        self._closed = threading.Event()
        self._stream = client.watch_events()  # opened here: events from now on are relayed
        self._thread = threading.Thread(target=self._run, name="radixkv-vllm-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                for event in self._stream:
                    self._queue.append(vllm_event(event, self._block_size, self._medium))
            except Exception as e:
                log.warning("radixkv events stream broke, reopening in %.0f s: %s", REOPEN_AFTER, e)
            if self._closed.wait(REOPEN_AFTER):
                return
            try:
                self._stream = self._client.watch_events()
            except Exception as e:
                log.warning("radixkv events stream not reopened: %s", e)

    def take(self) -> list[KVCacheEvent]:
        taken = []
        while self._queue:
            taken.append(self._queue.popleft())
        return taken

    def close(self) -> None:
        self._closed.set()
        self._stream.cancel()
