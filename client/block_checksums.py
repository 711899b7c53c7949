"""Writers' K/V checksums of a session's blocks: what a reader that copies blocks out checks (RecordBlockChecksums,
GetBlockChecksums; the vLLM connector records one per block it saves and checks them before vLLM reads a load).

A block keeps the first checksum recorded for it while the prefix tree holds it; see `server/block_checksums.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixkv.v1 import kvcache_pb2 as pb


class BlockChecksums:
    """The checksum calls of one session on one pool (`RadixKVClient.checksums`)."""

    def __init__(self, call: Callable[[Any, Any], Any], stub: Any, pool: str, session_id: str) -> None:
        self._call, self._stub, self._pool, self._session_id = call, stub, pool, session_id

    def record(self, seq_id: int, first_block: int, checksums: Sequence[int]) -> int:
        """Attach the writer's checksum of each block's K/V (nonzero) to blocks `first_block`... of the sequence that
        the prefix tree holds; returns how many took it (a block keeps its first, until it is evicted)."""
        request = pb.RecordBlockChecksumsRequest(
            pool=self._pool, session_id=self._session_id, seq_id=seq_id, first_block=first_block, checksums=checksums
        )
        return int(self._call(self._stub.RecordBlockChecksums, request).num_recorded)

    def get(self, seq_id: int, first_block: int, num_blocks: int) -> list[int]:
        """The checksums recorded for blocks [first_block, first_block + num_blocks) of the sequence (0: none)."""
        request = pb.GetBlockChecksumsRequest(
            pool=self._pool, session_id=self._session_id, seq_id=seq_id, first_block=first_block, num_blocks=num_blocks
        )
        return list(self._call(self._stub.GetBlockChecksums, request).checksums)
