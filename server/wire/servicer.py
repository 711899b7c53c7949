"""`radixkv.v1.KVCache` on the wire: each method turns its request into one `KVService` call and the
result into its response. Nothing here decides anything: sessions, ownership, quotas, namespaces and
locking live in `KVService`; refusals become statuses in `status.translating_errors`.

The caller is `auth.current_caller()`: the auth interceptor maps the call's bearer token to its tenant
for the call's thread before the method runs (without auth: `ANONYMOUS`). The interceptors and their
order are in `interceptors.py`; `translating_errors` records the call's deadline (`deadlines.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import numpy as np

from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import PoolHandle
from radixkv.server.events.hub import BlockEvent, EventKind
from radixkv.server.rules.idempotency import request_key
from radixkv.server.rules.miss_reasons import MissExplanation, wire_reason
from radixkv.server.rules.service import KVService
from radixkv.server.rules.tenants import Tenant
from radixkv.server.wire.auth import current_caller
from radixkv.server.wire.decoding import Undecodable
from radixkv.server.wire.reads import KVReads
from radixkv.server.wire.session_stream import Observe, SessionStreams
from radixkv.server.wire.status import translating_errors, translating_stream
from radixkv.server.wire.step_wire import transfers
from radixkv.tree.block_hash import WIRE_MASK, HashContract
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

_PREEMPT_MODES = {pb.PREEMPT_MODE_SWAP: "swap", pb.PREEMPT_MODE_RECOMPUTE: "recompute"}
_EVENT_KINDS = {
    EventKind.BLOCKS_STORED: pb.KV_EVENT_KIND_BLOCKS_STORED,
    EventKind.BLOCKS_REMOVED: pb.KV_EVENT_KIND_BLOCKS_REMOVED,
}


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, service: KVService, session_streams: SessionStreams, observe: Observe) -> None:
        self._service = service
        self._reads = KVReads(service)
        self._session_streams = session_streams
        self._observe = observe

    @translating_errors
    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.OpenSessionResponse:
        if request.pool:
            self._service.pool(request.pool, current_caller())  # UnknownPool, PermissionDenied before a session
        session = self._service.open_session(current_caller(), request.ttl_seconds)
        return pb.OpenSessionResponse(session_id=session.session_id, ttl_seconds=session.ttl)

    @translating_errors
    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext) -> pb.KeepAliveResponse:
        return pb.KeepAliveResponse(ttl_seconds=self._service.keep_alive(current_caller(), request.session_id))

    @translating_errors
    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(
            num_released_sequences=self._service.close_session(current_caller(), request.session_id)
        )

    @translating_errors
    def OpenSequences(
        self, request: pb.OpenSequencesRequest, context: grpc.ServicerContext
    ) -> pb.OpenSequencesResponse:
        # The repeated fields go to the core as they are: numpy reads them in one pass, where a list
        # would cost a Python int per token (and memory to match) before any limit is checked.
        prompts = [(p.token_ids, p.namespace) for p in request.prompts]
        explanations: list[MissExplanation] | None = [] if request.explain else None
        budgets = [p.max_new_tokens for p in request.prompts]
        priorities = [p.priority for p in request.prompts]
        results = self._service.open_sequences(
            current_caller(), request.session_id, request.pool, prompts, request_key("OpenSequences", request),
            explanations,
            budgets if any(budgets) else None, priorities if any(priorities) else None,
        )  # fmt: skip
        response = pb.OpenSequencesResponse(
            sequences=[
                pb.OpenedSequence(
                    seq_id=r.seq_id,
                    num_cached_tokens=r.num_cached_tokens,
                    block_ids=r.block_table.tolist(),
                    slots=np.asarray(r.slots).tolist(),
                    num_host_hit_tokens=r.num_host_hit_tokens,
                )
                for r in results
            ],
            offloads=transfers(r.offloads for r in results),
            loads=transfers(r.loads for r in results),
        )
        for opened, why in zip(response.sequences, explanations or (), strict=False):
            opened.miss_reason = wire_reason(why)
            opened.miss_block_index, opened.evicted_at_unix_ns = why.block_index, why.evicted_at_unix_ns
            opened.other_namespace = why.other_namespace
        return response

    @translating_errors
    def AppendTokens(self, request: pb.AppendTokensRequest, context: grpc.ServicerContext) -> pb.AppendTokensResponse:
        batch = self._service.append_tokens(
            current_caller(),
            request.session_id,
            request.pool,
            list(request.seq_ids),
            list(request.num_token_ids),
            request.token_ids,
            request_key("AppendTokens", request),
        )
        return pb.AppendTokensResponse(
            num_tokens=batch.num_tokens,
            table_offsets=batch.table_offsets,
            num_block_ids=batch.num_block_ids,
            block_ids=batch.block_ids,
            slots=batch.slots.tolist(),
            copies=[pb.BlockCopy(src_block_id=s, dst_block_id=d, sequence_index=i) for s, d, i in batch.copies],
            offloads=transfers([batch.offloads]),
        )

    @translating_errors
    def ForkSequence(self, request: pb.ForkSequenceRequest, context: grpc.ServicerContext) -> pb.ForkSequenceResponse:
        key = request_key("ForkSequence", request)
        children = self._service.fork(
            current_caller(), request.session_id, request.pool, request.seq_id, request.num_children, key
        )
        return pb.ForkSequenceResponse(child_seq_ids=children)

    @translating_errors
    def CacheSequence(
        self, request: pb.CacheSequenceRequest, context: grpc.ServicerContext
    ) -> pb.CacheSequenceResponse:
        num_cached = self._service.cache_sequence(
            current_caller(), request.session_id, request.pool, request.seq_id, request_key("CacheSequence", request)
        )
        return pb.CacheSequenceResponse(num_cached_tokens=num_cached)

    @translating_errors
    def ReleaseSequences(
        self, request: pb.ReleaseSequencesRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseSequencesResponse:
        cache = request.cache if request.HasField("cache") else True
        key = request_key("ReleaseSequences", request)
        num = self._service.release(
            current_caller(), request.session_id, request.pool, list(request.seq_ids), cache, key
        )
        return pb.ReleaseSequencesResponse(num_released_sequences=num)

    @translating_errors
    def CommitTokens(self, request: pb.CommitTokensRequest, context: grpc.ServicerContext) -> pb.CommitTokensResponse:
        self._service.commit(
            current_caller(), request.session_id, request.pool, list(request.seq_ids), list(request.num_tokens)
        )
        return pb.CommitTokensResponse()

    @translating_errors
    def RecordBlockChecksums(
        self, request: pb.RecordBlockChecksumsRequest, context: grpc.ServicerContext
    ) -> pb.RecordBlockChecksumsResponse:
        num = self._service.record_block_checksums(
            current_caller(), request.session_id, request.pool, request.seq_id, request.first_block,
            list(request.digests), list(request.checksums),
        )  # fmt: skip
        return pb.RecordBlockChecksumsResponse(num_recorded=num)

    @translating_errors
    def GetBlockChecksums(
        self, request: pb.GetBlockChecksumsRequest, context: grpc.ServicerContext
    ) -> pb.GetBlockChecksumsResponse:
        digests = self._reads.block_checksums(
            current_caller(), request.session_id, request.pool, request.seq_id, request.first_block, request.num_blocks
        )
        return pb.GetBlockChecksumsResponse(digests=digests)

    @translating_errors
    def DescribeSequences(
        self, request: pb.DescribeSequencesRequest, context: grpc.ServicerContext
    ) -> pb.DescribeSequencesResponse:
        rows = self._reads.describe_sequences(current_caller(), request.session_id, request.pool, list(request.seq_ids))
        return pb.DescribeSequencesResponse(num_tokens=[n for n, _ in rows], num_computed_tokens=[c for _, c in rows])

    @translating_errors
    def CanAppend(self, request: pb.CanAppendRequest, context: grpc.ServicerContext) -> pb.CanAppendResponse:
        fits, available = self._reads.can_append(
            current_caller(), request.session_id, request.pool, list(request.seq_ids), list(request.num_token_ids)
        )
        return pb.CanAppendResponse(can_append=fits, num_available_blocks=available)

    @translating_errors
    def FreeableBlocks(
        self, request: pb.FreeableBlocksRequest, context: grpc.ServicerContext
    ) -> pb.FreeableBlocksResponse:
        num = self._reads.freeable_blocks(current_caller(), request.session_id, request.pool, list(request.seq_ids))
        return pb.FreeableBlocksResponse(num_freeable_blocks=num)

    @translating_errors
    def Preempt(self, request: pb.PreemptRequest, context: grpc.ServicerContext) -> pb.PreemptResponse:
        mode = _PREEMPT_MODES.get(request.mode, f"PreemptMode {request.mode}")  # the core refuses it, naming `mode`
        key = request_key("Preempt", request)
        result = self._service.preempt(
            current_caller(), request.session_id, request.pool, list(request.seq_ids), mode, key
        )
        return pb.PreemptResponse(
            offloads=transfers([result.offloads]),
            num_freed_blocks=result.num_freed_blocks,
            num_unreserved_blocks=result.num_unreserved_blocks,
        )

    @translating_errors
    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> pb.ResumeResponse:
        key = request_key("Resume", request)
        r = self._service.resume(current_caller(), request.session_id, request.pool, request.seq_id, key)
        return pb.ResumeResponse(
            seq_id=r.seq_id, num_cached_tokens=r.num_cached_tokens, block_ids=r.block_table.tolist(),
            slots=np.asarray(r.slots).tolist(), loads=transfers([r.loads]), offloads=transfers([r.offloads]),
            num_host_hit_tokens=r.num_host_hit_tokens,
        )  # fmt: skip

    @translating_errors
    def Victims(self, request: pb.VictimsRequest, context: grpc.ServicerContext) -> pb.VictimsResponse:
        seq_ids = self._reads.victims(current_caller(), request.session_id, request.pool, request.num_blocks)
        return pb.VictimsResponse(seq_ids=seq_ids)

    @translating_errors
    def Match(self, request: pb.MatchRequest, context: grpc.ServicerContext) -> pb.MatchResponse:
        if request.explain:
            num, num_host, num_disk, why = self._reads.explain_match(
                current_caller(), request.session_id, request.pool, request.token_ids, request.namespace
            )
            return pb.MatchResponse(
                num_cached_tokens=num, num_host_cached_tokens=num_host, num_disk_cached_tokens=num_disk,
                miss_reason=wire_reason(why),
                miss_block_index=why.block_index, evicted_at_unix_ns=why.evicted_at_unix_ns,
                other_namespace=why.other_namespace,
            )  # fmt: skip
        num, num_host, num_disk = self._reads.match(
            current_caller(), request.session_id, request.pool, request.token_ids, request.namespace
        )
        return pb.MatchResponse(num_cached_tokens=num, num_host_cached_tokens=num_host, num_disk_cached_tokens=num_disk)

    @translating_errors
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        key = request_key("Pin", request)
        num = self._service.pin(
            current_caller(), request.session_id, request.pool, request.token_ids, request.namespace, key
        )
        return pb.PinResponse(num_pinned_tokens=num)

    @translating_errors
    def Unpin(self, request: pb.UnpinRequest, context: grpc.ServicerContext) -> pb.UnpinResponse:
        key = request_key("Unpin", request)
        self._service.unpin(
            current_caller(), request.session_id, request.pool, request.token_ids, request.namespace, key
        )
        return pb.UnpinResponse()

    @translating_errors
    def Retain(self, request: pb.RetainRequest, context: grpc.ServicerContext) -> pb.RetainResponse:
        key, r = request_key("Retain", request), request.retention
        retention = (r.ttl_seconds, r.priority, r.refresh if r.HasField("refresh") else True, r.end_session)
        num = self._service.retain(
            current_caller(), request.session_id, request.pool, request.token_ids, request.namespace, retention, key
        )
        return pb.RetainResponse(num_retained_tokens=num)

    @translating_errors
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        stats, num_available, num_tombstones, tombstone_bytes = self._reads.stats(
            current_caller(), request.session_id, request.pool
        )
        fields = {f: getattr(stats, f) for f in pb.PoolStats.DESCRIPTOR.fields_by_name}
        return pb.StatsResponse(
            stats=pb.PoolStats(**fields),
            num_sessions=len(self._service.sessions),
            num_available_blocks=num_available,
            num_tombstones=num_tombstones,
            tombstone_bytes=tombstone_bytes,
        )

    @translating_errors
    def GetPool(self, request: pb.GetPoolRequest, context: grpc.ServicerContext) -> pb.GetPoolResponse:
        pool = self._reads.get_pool(current_caller(), request.session_id, request.pool)
        layout = pool.layout
        handle = pool.storage.export_handle()
        response = pb.GetPoolResponse(
            pool=pool.name,
            layout=_layout(layout),
            device=pool.device,
            handle_json=json.dumps(handle.to_dict()),  # deprecated, for v0.1 clients
            handle=_handle(handle),
            hash_contract=_hash_contract(layout.block_size),
        )
        if pool.host_storage is not None:
            response.host_layout.CopyFrom(_layout(pool.host_storage.layout))
            response.host_handle.CopyFrom(_handle(pool.host_storage.export_handle()))
        return response

    @translating_errors
    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        pool, digests, seq = self._reads.verify(current_caller(), request.session_id, request.pool)
        namespaces = [
            pb.NamespaceDigest(namespace=ns, digest=d, num_blocks=n) for ns, (d, n) in sorted(digests.items())
        ]
        return pb.VerifyResponse(
            namespaces=namespaces,
            digest=sum(d for d, _ in digests.values()) & WIRE_MASK,
            epoch=pool.events.epoch,
            seq=seq,
            hash_contract=_hash_contract(pool.layout.block_size),
        )

    @translating_errors
    def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchEventsResponse]:
        # Not a generator itself: the caller is read and the request validated before this returns.
        caller = current_caller()
        epoch = self._service.pool(request.pool, caller).events.epoch
        batches = self._reads.watch_events(
            caller,
            request.session_id,
            request.pool,
            list(request.namespaces),
            request.include_snapshot,
            context.is_active,
        )
        responses = (
            pb.WatchEventsResponse(
                events=[_event(caller, e) for e in events],
                snapshot=snapshot,
                epoch=epoch,
                seq=events[-1].pool_sequence_number if events else 0,
                digest=digest,
            )
            for events, snapshot, digest in batches
        )
        return translating_stream(context, "WatchEvents", responses)

    def Session(
        self, request_iterator: Iterator[pb.SessionRequest | Undecodable], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        # The caller is read now: the responses are produced after this returns (see session_stream).
        streams, caller = self._session_streams, current_caller()
        responses = streams.serve(self._service, caller, request_iterator, self._observe, context.is_active)
        return translating_stream(context, "Session", responses)

    @translating_errors
    def Upgrade(self, request: pb.UpgradeRequest, context: grpc.ServicerContext) -> pb.UpgradeResponse:
        written = self._service.upgrade(current_caller())
        return pb.UpgradeResponse(
            snapshots=[
                pb.PoolSnapshot(
                    pool=w.pool,
                    path=str(w.path),
                    num_bytes=w.num_bytes,
                    num_cached_blocks=w.num_cached_blocks,
                    num_live_sequences=w.num_live_sequences,
                    seconds=w.seconds,
                )
                for w in written
            ]  # fmt: skip
        )


def _event(caller: Tenant, event: BlockEvent) -> pb.KVEvent:
    return pb.KVEvent(
        sequence_number=event.sequence_number,
        namespace=caller.unscope(event.namespace),
        kind=_EVENT_KINDS[event.kind],
        block_ids=event.block_ids,
        token_ids=np.frombuffer(event.token_bytes, dtype="<i4").tolist(),
        parent_block_id=event.parent_block_id,
        block_hashes=event.block_hashes,
        parent_block_hash=event.parent_block_hash,
        namespace_digest=event.namespace_digest,
    )


def _layout(layout: PoolLayout) -> pb.PoolLayout:
    return pb.PoolLayout(
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        block_size=layout.block_size, num_blocks=layout.num_blocks, dtype=layout.dtype,
    )  # fmt: skip


def _handle(handle: PoolHandle) -> pb.PoolHandle:
    """The wire's typed handle (GetPoolResponse.handle); the layout travels beside it (`_layout`)."""
    if handle.kind == "shm":
        return pb.PoolHandle(shared_memory=pb.SharedMemoryHandle(name=handle.name))
    return pb.PoolHandle(cuda_ipc=pb.CudaIpcHandle(**{f: getattr(handle, f) for f in _CUDA_IPC_FIELDS}))


_CUDA_IPC_FIELDS = tuple(pb.CudaIpcHandle.DESCRIPTOR.fields_by_name)  # the same names as PoolHandle's fields


def _hash_contract(block_size: int) -> pb.HashContract:
    c = HashContract(block_size)
    return pb.HashContract(
        algorithm=c.algorithm, root_seed=c.root_seed, block_size=c.block_size, salt_rule=c.salt_rule,
        tenant_scope_rule=c.tenant_scope_rule, wire_form=c.wire_form, format_version=c.format_version,
    )  # fmt: skip
