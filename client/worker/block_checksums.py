"""Writers' K/V digests of a session's blocks: what a reader that copies blocks out checks (RecordBlockChecksums,
GetBlockChecksums; the vLLM connector records one per block it saves and checks them before vLLM reads a load).

A digest is 32 bytes (BLAKE3 of the block's K/V in the pool's layout); a block keeps the first recorded for it
while the prefix tree holds it, kept by the server; see `server/events/block_checksums.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixkv.v1 import kvcache_pb2 as pb


class BlockChecksums:
    """The digest calls of one session on one pool (`RadixKVClient.checksums`)."""

    def __init__(self, call: Callable[[Any, Any], Any], stub: Any, *, pool: str, session_id: str) -> None:
        self._call, self._stub, self._pool, self._session_id = call, stub, pool, session_id

    def record(self, seq_id: int, first_block: int, digests: Sequence[bytes]) -> int:
        """Attach the writer's 32-byte digest of each block's K/V to blocks `first_block`... of the sequence that
        the prefix tree holds; returns how many took it (a block keeps its first, until it is evicted)."""
        request = pb.RecordBlockChecksumsRequest(
            pool=self._pool, session_id=self._session_id, seq_id=seq_id, first_block=first_block, digests=digests
        )
        return int(self._call(self._stub.RecordBlockChecksums, request).num_recorded)

    def get(self, seq_id: int, first_block: int, num_blocks: int) -> list[bytes]:
        """The digests recorded for blocks [first_block, first_block + num_blocks) of the sequence (b"": none)."""
        request = pb.GetBlockChecksumsRequest(
            pool=self._pool, session_id=self._session_id, seq_id=seq_id, first_block=first_block, num_blocks=num_blocks
        )
        return list(self._call(self._stub.GetBlockChecksums, request).digests)
