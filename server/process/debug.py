"""`radixkv.v1.Debug`: what integration tests must ask the server itself (served only with --debug-rpc).

A test running the server as a separate process cannot call `check_invariants()` on its cache or
read its storage; these RPCs do it server-side and return the verdict. `CorruptRefCount` breaks a pool
on purpose, so a test can prove the online audit (`radixkv.server.process.audit`) catches it; `StallSteps`
holds a step inside its pool's lock, so a test can prove what a slow step holds back.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator

import grpc

from radixkv.errors import InvalidArgument, PermissionDenied, UnknownPool
from radixkv.server.rules.config import DEFAULT_POOL
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.service import KVService
from radixkv.server.wire.auth import current_caller
from radixkv.server.wire.reads import KVReads
from radixkv.server.wire.status import translating_errors, translating_stream
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
        self._reads = KVReads(service)

    @staticmethod
    def _check_admin() -> None:
        caller = current_caller()
        if not caller.admin:
            raise PermissionDenied(f"tenant {caller.name!r} may not call the Debug service (admin)", tenant=caller.name)

    def _pool(self, name: str) -> Pool:
        """Any pool, whichever tenants it serves: an admin's Debug calls read (or break, in tests) every pool."""
        pool = self._service.pools.get(name or DEFAULT_POOL)
        if pool is None:
            raise UnknownPool(name or DEFAULT_POOL)
        return pool

    @translating_errors
    def CheckInvariants(
        self, request: pb.CheckInvariantsRequest, context: grpc.ServicerContext
    ) -> pb.CheckInvariantsResponse:
        self._check_admin()
        pool = self._pool(request.pool)
        try:
            self._reads.check_invariants(pool)
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
        return pb.ChecksumBlocksResponse(sha256=checksum_blocks(self._pool(request.pool), list(request.block_ids)))

    @translating_errors
    def CorruptRefCount(
        self, request: pb.CorruptRefCountRequest, context: grpc.ServicerContext
    ) -> pb.CorruptRefCountResponse:
        """Breaks the pool on purpose (tests of the online audit); it stays broken until a restart."""
        self._check_admin()
        pool = self._pool(request.pool)
        if not 0 <= request.block_id < pool.layout.num_blocks:
            raise InvalidArgument("block_id", f"must lie in [0, {pool.layout.num_blocks}), got {request.block_id}")
        if request.delta == 0:
            raise InvalidArgument("delta", "must not be 0")
        with pool.lock:
            ref_counts = pool.cache.pool.ref_counts
            ref_counts[request.block_id] += request.delta
            return pb.CorruptRefCountResponse(ref_count=int(ref_counts[request.block_id]))

    @translating_errors
    def StallSteps(
        self, request: pb.StallStepsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StallStepsResponse]:
        """Holds the next step applied on the pool inside its lock until this call ends (or `max_seconds`)."""
        self._check_admin()
        pool = self._pool(request.pool)
        if not 0 < request.max_seconds <= 60:
            raise InvalidArgument("max_seconds", f"must lie in (0, 60], got {request.max_seconds}")
        held, released = threading.Event(), threading.Event()
        context.add_callback(released.set)  # the client ended the call
        cache = pool.cache
        one_result = cache.one_result

        @contextlib.contextmanager
        def stalled() -> Iterator[None]:  # every step applies inside `one_result()`, under the pool's lock
            vars(cache).pop("one_result", None)  # only this step is held
            held.set()
            released.wait(request.max_seconds)
            with one_result():
                yield

        with pool.lock:
            cache.one_result = stalled  # type: ignore[method-assign,assignment]  # this object, one step

        def answers() -> Iterator[pb.StallStepsResponse]:
            try:
                yield pb.StallStepsResponse(stalled=False)  # armed: the next step will be held
                if held.wait(request.max_seconds):
                    yield pb.StallStepsResponse(stalled=True)
                    released.wait(request.max_seconds)
            finally:
                with pool.lock:
                    vars(cache).pop("one_result", None)

        return translating_stream(context, "StallSteps", answers())
