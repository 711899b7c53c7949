"""`radixkv.v1.Debug`: what integration tests must ask the server itself (served only with --debug-rpc).

A test running the server as a separate process cannot call `check_invariants()` on its cache or
read its storage; these RPCs do it server-side and return the verdict. `CorruptRefCount` breaks a pool
on purpose, so a test can prove the online audit (`radixkv.server.audit`) catches it.
"""

from __future__ import annotations

import hashlib

import grpc

from radixkv.errors import InvalidArgument, PermissionDenied
from radixkv.server.auth import current_caller
from radixkv.server.pools import Pool
from radixkv.server.service import KVService
from radixkv.server.status import translating_errors
from radixkv.v1 import debug_pb2 as pb
from radixkv.v1 import debug_pb2_grpc


def checksum_blocks(pool: Pool, block_ids: list[int]) -> str:
    """SHA-256 of data[:, :, block_ids] as this process's mapping of the pool holds it (C order)."""
    import torch

    bad = [b for b in block_ids if not 0 <= b < pool.layout.num_blocks]
    if bad:
        raise InvalidArgument("block_ids", f"ids must lie in [0, {pool.layout.num_blocks}), got {bad[:4]}")
    # selected: [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]
    selected = pool.storage.data[:, :, torch.tensor(block_ids, dtype=torch.long)].contiguous()
    return hashlib.sha256(selected.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()  # cpu(): CUDA pools


class DebugServicer(debug_pb2_grpc.DebugServicer):
    """Only for admin tenants (with auth on): a checksum reads any tenant's blocks."""

    def __init__(self, service: KVService) -> None:
        self._service = service

    @staticmethod
    def _check_admin() -> None:
        caller = current_caller()
        if not caller.admin:
            raise PermissionDenied(f"tenant {caller.name!r} may not call the Debug service (admin)", tenant=caller.name)

    @translating_errors
    def CheckInvariants(
        self, request: pb.CheckInvariantsRequest, context: grpc.ServicerContext
    ) -> pb.CheckInvariantsResponse:
        self._check_admin()
        pool = self._service.pool(request.pool)
        try:
            self._service.check_invariants(request.pool)
            violation = ""
        except AssertionError as e:
            violation = str(e) or "assertion failed"
        with pool.lock:
            num_live = len(pool.cache.sequence_ids())
        return pb.CheckInvariantsResponse(
            violation=violation,
            num_live_sequences=num_live,
            num_sessions=len(self._service.sessions),
            num_watch_streams=len(self._service.streams),
        )

    @translating_errors
    def ChecksumBlocks(
        self, request: pb.ChecksumBlocksRequest, context: grpc.ServicerContext
    ) -> pb.ChecksumBlocksResponse:
        self._check_admin()
        return pb.ChecksumBlocksResponse(
            sha256=checksum_blocks(self._service.pool(request.pool), list(request.block_ids))
        )

    @translating_errors
    def CorruptRefCount(
        self, request: pb.CorruptRefCountRequest, context: grpc.ServicerContext
    ) -> pb.CorruptRefCountResponse:
        """Breaks the pool on purpose (tests of the online audit); it stays broken until a restart."""
        self._check_admin()
        pool = self._service.pool(request.pool)
        if not 0 <= request.block_id < pool.layout.num_blocks:
            raise InvalidArgument("block_id", f"must lie in [0, {pool.layout.num_blocks}), got {request.block_id}")
        if request.delta == 0:
            raise InvalidArgument("delta", "must not be 0")
        with pool.lock:
            ref_counts = pool.cache.pool.ref_counts
            ref_counts[request.block_id] += request.delta
            return pb.CorruptRefCountResponse(ref_count=int(ref_counts[request.block_id]))
