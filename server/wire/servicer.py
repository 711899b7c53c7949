"""`radixkv.v1.KVCache` on the wire, the unary methods and the Session stream: each turns its request into one
`KVService` call and the result into its response (the step's wire form, both ways, is here too).

Nothing here decides anything: sessions, ownership, quotas, namespaces and locking live in
`KVService`; refusals become statuses in `status.translating_errors`.

The caller (the tenant every call is made on behalf of) is `auth.current_caller()`: the auth
interceptor maps the call's bearer token to its tenant and sets it for the call's thread before the
method runs (without auth every caller is `ANONYMOUS`). The interceptors and their order are in
`interceptors.py`; the call's deadline, which the service checks after waiting for a pool's lock,
is recorded by `translating_errors` (`checks.py`: `call_deadline`).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, LimitExceeded, RadixKVError
from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import PoolHandle
from radixkv.sequences.packed import pack, unpack
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.events.hub import BlockEvent, EventKind
from radixkv.server.rules.checks import DEFAULT_MAX_STEPS_PER_FRAME, Reply
from radixkv.server.rules.miss_reasons import wire_reason
from radixkv.server.rules.service import KVService, run_step
from radixkv.server.rules.sessions import NO_REQUEST, Session, request_key
from radixkv.server.rules.tenants import Tenant
from radixkv.server.wire.auth import current_caller
from radixkv.server.wire.reads import KVReads
from radixkv.server.wire.status import (
    MAX_ECHO_CHARS,
    STATUS_BY_REASON,
    Undecodable,
    translating_errors,
    translating_stream,
    truncated,
)
from radixkv.tree.block_hash import WIRE_MASK, HashContract
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

# -- from wire/step_wire.py (merged, issue 41: one concept, one module):
# A Session step on the wire: a SessionRequest as a `Step`, a `StepResult` as its SessionResponse.
#
# Only the fields a step sets are read, and only those its result has are written: protobuf costs
# per field given, even an empty one. An append may carry its id and count columns packed
# (`StepAppend.packed_seq_ids`, radixkv.sequences.packed); it is answered with its result columns in
# the form it sent them. Slots always travel packed (8 bytes each, `sizes.py` bounds them so).

_INT64 = np.dtype("<i8")
_NO_ITEMS = Step()  # a request with no items (a Step is immutable: one serves them all)


def step_of(request: pb.SessionRequest) -> Step:
    """The request as a Step; empty item lists are left at their defaults (a decode step reads one field)."""
    if not (request.opens or request.forks or request.cache_seq_ids or request.releases or request.HasField("commit")):
        return Step(append=_append(request.append)) if request.HasField("append") else _NO_ITEMS  # decode
    items: dict[str, object] = {}
    if request.HasField("commit"):
        items["commit"] = Commit(list(request.commit.seq_ids), list(request.commit.num_tokens))
    if request.opens:
        items["opens"] = [(o.token_ids, o.namespace) for o in request.opens]
        items.update(budget_items(request.opens))
        if any(o.explain for o in request.opens):
            items["explain"] = [o.explain for o in request.opens]
    if request.HasField("append"):
        items["append"] = _append(request.append)
    if request.forks:
        items["forks"] = [(f.seq_id, f.num_children) for f in request.forks]
    if request.cache_seq_ids:
        items["caches"] = list(request.cache_seq_ids)
    if request.releases:
        items["releases"] = [(list(r.seq_ids), r.cache if r.HasField("cache") else True) for r in request.releases]
    return Step(**items)  # type: ignore[arg-type]


def budget_items(opens: Sequence[pb.StepOpen] | Sequence[pb.Prompt]) -> dict[str, list[int]]:
    """A step's `max_new_tokens` and `priorities` from its opens: both lists when any open sets either, else
    neither (the Step's default, no budget). The one conversion, for the Session stream and OpenSequences."""
    if not any(o.max_new_tokens or o.priority for o in opens):
        return {}
    return {"max_new_tokens": [o.max_new_tokens for o in opens], "priorities": [o.priority for o in opens]}


def _append(a: pb.StepAppend) -> Append:
    """The append item, from its repeated or its packed columns (see radixkv.sequences.packed)."""
    if not (a.packed_seq_ids or a.packed_num_token_ids):
        return Append(list(a.seq_ids), list(a.num_token_ids), a.token_ids)
    try:
        if a.seq_ids or a.num_token_ids:
            raise InvalidArgument("packed_seq_ids", "set seq_ids and num_token_ids or their packed forms, not both")
        seq_ids = unpack(a.packed_seq_ids, 8, "packed_seq_ids")
        if not a.packed_num_token_ids:
            return Append(seq_ids, [1] * len(seq_ids), a.token_ids)  # a decode step: one token each
        counts = unpack(a.packed_num_token_ids, 4, "packed_num_token_ids")
        if len(counts) != len(seq_ids):
            raise InvalidArgument(
                "packed_num_token_ids", f"needs one entry per sequence ({len(seq_ids)}), got {len(counts)}"
            )
    except InvalidArgument as e:
        e.metadata["item"] = "append"
        raise
    return Append(seq_ids, counts, a.token_ids)


def response_of(request_id: int, session_id: str, result: StepResult, packed: bool) -> pb.SessionResponse:
    """Only the fields the step has results for are set, in place (protobuf costs per field given, even an
    empty one, and a submessage passed to a constructor is copied again). `packed`: the append's columns
    as the request sent its own."""
    response = pb.SessionResponse(request_id=request_id, session_id=session_id)
    for r in result.opened:
        response.opened.add(
            seq_id=r.seq_id,
            num_cached_tokens=r.num_cached_tokens,
            block_ids=r.block_table.tolist(),
            slots=r.slots.astype(_INT64, copy=False).tobytes(),
            num_host_hit_tokens=r.num_host_hit_tokens,
        )
    if result.explanations:  # explained opens: as OpenSequences
        for item, why in zip(response.opened, result.explanations, strict=False):
            if why is not None:
                item.miss_reason = wire_reason(why)
                item.miss_block_index, item.evicted_at_unix_ns = why.block_index, why.evicted_at_unix_ns
                item.other_namespace = why.other_namespace
    b = result.appended
    if b is not None:
        appended = response.appended
        appended.SetInParent()  # an append of no sequences still answers with an (empty) `appended`
        if packed:
            appended.packed_num_tokens = pack(b.num_tokens, 4)
            appended.packed_table_offsets = pack(b.table_offsets, 4)
            appended.packed_num_block_ids = pack(b.num_block_ids, 4)
            appended.packed_block_ids = pack(b.block_ids, 4)
        else:
            appended.num_tokens.extend(b.num_tokens)
            appended.table_offsets.extend(b.table_offsets)
            appended.num_block_ids.extend(b.num_block_ids)
            if b.block_ids:
                appended.block_ids.extend(b.block_ids)
        appended.slots = b.slots.astype(_INT64, copy=False).tobytes()
        for s, d, i in b.copies:
            appended.copies.add(src_block_id=s, dst_block_id=d, sequence_index=i)
    if len(result.offloads):
        response.offloads.extend(transfers([result.offloads]))
    if len(result.loads):
        response.loads.extend(transfers([result.loads]))
    for children in result.forked:
        response.forked.add(child_seq_ids=children)
    if result.num_cached_tokens:
        response.num_cached_tokens.extend(result.num_cached_tokens)
    if result.num_released_sequences:
        response.num_released_sequences = result.num_released_sequences
    return response


def transfers(runs: Iterable[npt.NDArray[np.int64]]) -> list[pb.BlockTransfer]:
    """Host-tier pairs `(src_block, dst_block)`, run after run in order, as wire messages."""
    return [pb.BlockTransfer(src_block_id=s, dst_block_id=d) for run in runs for s, d in run.tolist()]


def step_error(error: RadixKVError) -> pb.StepError:
    """A refusal in-band, as `status.to_status` would send it: its echoed values cut to a bounded size."""
    code = STATUS_BY_REASON.get(error.reason, grpc.StatusCode.INTERNAL)
    metadata = {truncated(k, 64): truncated(v) for k, v in error.metadata.items()}
    return pb.StepError(
        code=code.value[0], message=truncated(error.message, 4 * MAX_ECHO_CHARS), reason=error.reason, metadata=metadata
    )


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

    def _step(self, request: Any, step: Step, method: str | None) -> StepResult:
        """A unary call as the step of one item it is (`KVService.step`, the Session stream's path); `method`
        names it for its request id (None: a call without one)."""
        key = request_key(method, request) if method else NO_REQUEST
        return self._service.step(current_caller(), request.session_id, request.pool, step, key)

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
        explain = [True] * len(prompts) if request.explain else ()
        step = Step(opens=prompts, explain=explain, **budget_items(request.prompts))  # type: ignore[arg-type]
        result = self._step(request, step, "OpenSequences")
        results = result.opened
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
        for opened, why in zip(response.sequences, result.explanations if request.explain else (), strict=False):
            opened.miss_reason = wire_reason(why)
            opened.miss_block_index, opened.evicted_at_unix_ns = why.block_index, why.evicted_at_unix_ns
            opened.other_namespace = why.other_namespace
        return response

    @translating_errors
    def AppendTokens(self, request: pb.AppendTokensRequest, context: grpc.ServicerContext) -> pb.AppendTokensResponse:
        append = Append(list(request.seq_ids), list(request.num_token_ids), request.token_ids)
        batch = self._step(request, Step(append=append), "AppendTokens").appended
        assert batch is not None, "a step with an append answers it"
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
        step = Step(forks=[(request.seq_id, request.num_children)])
        return pb.ForkSequenceResponse(child_seq_ids=self._step(request, step, "ForkSequence").forked[0])

    @translating_errors
    def CacheSequence(
        self, request: pb.CacheSequenceRequest, context: grpc.ServicerContext
    ) -> pb.CacheSequenceResponse:
        result = self._step(request, Step(caches=[request.seq_id]), "CacheSequence")
        return pb.CacheSequenceResponse(num_cached_tokens=result.num_cached_tokens[0])

    @translating_errors
    def ReleaseSequences(
        self, request: pb.ReleaseSequencesRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseSequencesResponse:
        cache = request.cache if request.HasField("cache") else True
        result = self._step(request, Step(releases=[(list(request.seq_ids), cache)]), "ReleaseSequences")
        return pb.ReleaseSequencesResponse(num_released_sequences=result.num_released_sequences)

    @translating_errors
    def CommitTokens(self, request: pb.CommitTokensRequest, context: grpc.ServicerContext) -> pb.CommitTokensResponse:
        # No request id: committing the same watermark again changes nothing.
        self._step(request, Step(commit=Commit(list(request.seq_ids), list(request.num_tokens))), None)
        return pb.CommitTokensResponse()

    @translating_errors
    def RecordBlockChecksums(
        self, request: pb.RecordBlockChecksumsRequest, context: grpc.ServicerContext
    ) -> pb.RecordBlockChecksumsResponse:
        num = self._service.record_block_checksums(
            current_caller(),
            request.session_id,
            request.pool,
            request.seq_id,
            request.first_block,
            list(request.digests),
            list(request.checksums),
        )
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
            seq_id=r.seq_id,
            num_cached_tokens=r.num_cached_tokens,
            block_ids=r.block_table.tolist(),
            slots=np.asarray(r.slots).tolist(),
            loads=transfers([r.loads]),
            offloads=transfers([r.offloads]),
            num_host_hit_tokens=r.num_host_hit_tokens,
        )

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
                num_cached_tokens=num,
                num_host_cached_tokens=num_host,
                num_disk_cached_tokens=num_disk,
                miss_reason=wire_reason(why),
                miss_block_index=why.block_index,
                evicted_at_unix_ns=why.evicted_at_unix_ns,
                other_namespace=why.other_namespace,
            )
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
            ]
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
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        dtype=layout.dtype,
    )


def _handle(handle: PoolHandle) -> pb.PoolHandle:
    """The wire's typed handle (GetPoolResponse.handle); the layout travels beside it (`_layout`)."""
    if handle.kind == "shm":
        return pb.PoolHandle(shared_memory=pb.SharedMemoryHandle(name=handle.name))
    return pb.PoolHandle(cuda_ipc=pb.CudaIpcHandle(**{f: getattr(handle, f) for f in _CUDA_IPC_FIELDS}))


_CUDA_IPC_FIELDS = tuple(pb.CudaIpcHandle.DESCRIPTOR.fields_by_name)  # the same names as PoolHandle's fields


def _hash_contract(block_size: int) -> pb.HashContract:
    c = HashContract(block_size=block_size)
    return pb.HashContract(
        algorithm=c.algorithm,
        root_seed=c.root_seed,
        block_size=c.block_size,
        salt_rule=c.salt_rule,
        tenant_scope_rule=c.tenant_scope_rule,
        wire_form=c.wire_form,
        format_version=c.format_version,
    )


# -- from wire/session_stream.py (merged, issue 41: one concept, one module):
# The Session stream: one session's scheduler steps, a request and a response each, on one open stream.
#
# Errors: a refused step is answered in-band, and the stream stays open. Its response carries a
# `StepError` with the code, reason and metadata the unary call for the refused item would have
# ended with (plus `item`), so the clients raise the same exception class; nothing of the step was
# applied. A scheduler refused for lack of blocks retries a smaller step on the same stream, with no
# reconnect (which would cost more than the step). Bytes that do not parse as a SessionRequest are a
# refused step too (INVALID_ARGUMENT naming `request`). Only what concerns the stream itself ends it
# with a status, as a unary call ends: no valid token (UNAUTHENTICATED, before the stream starts),
# too many streams open (LIMIT_EXCEEDED when it starts), a server bug (INTERNAL), shutdown.
#
# The stream serves the session its first request names; later requests may leave `session_id`
# empty. While the stream is open the session's lease does not run out (`SessionRegistry.hold`), and
# the server's keepalive pings end the streams of peers that vanished. A step with a `request_id`
# that this session already answered (re-sent after a reconnect) is answered with its first result or
# refused, never applied again (`RequestWindow`, sessions.py).
#
# Each stream is served by gRPC's handler thread for it, from the server's RPC pool: it reads a
# request, answers it and sends the response, in order; no pool work runs on gRPC's own threads, so
# a step that waits for its pool's lock holds back only the calls that need that lock. A step's
# metrics are kept once its response has been sent, off the step's round trip.
#
# A client with several steps queued sends them as one frame (`SessionRequest.steps`, see
# client/session/step_stream.py): each is answered exactly as if it came alone, in order, and the answers go
# back in one message, so gRPC's per-message cost is paid once for them. The answers share that
# message's room: each step's response is bounded against what the answers before it left, less
# room for a short refusal of each step after it, before it applies; a refusal that does not fit
# is cut to its code and reason. The wire form of a step and its answer is above (`step_of`, `response_of`).
#
# A frame's work is what its caller pays for, and no more: at most `max_steps_per_frame` steps (a
# larger frame is refused whole, LIMIT_EXCEEDED, before any step applies); each answer is measured
# once, as it joins the response (the room left is a running sum: O(steps) for the frame, not
# O(steps^2)); and a caller that leaves (cancelled, deadline, connection gone) stops its frame
# between two steps, so the steps after are never applied. Counters: the bytes measured, and the
# steps left unapplied because their caller left.

log = logging.getLogger(__name__)

# A refusal cut to its code and reason, with its request id, as one answer of a frame: the room each step of a frame
# keeps for the steps after it, so that whatever they answer, the frame's response fits its message.
SHORT_REFUSAL_BYTES = 128
_FRAMING_BYTES = 8  # an answer's tag and length inside the frame's response
Observe = Callable[[str, str, grpc.StatusCode, float], None]  # (method, pool, code, seconds), as the metrics take


class SessionStreams:
    """Counts the open Session streams of a server: each holds an RPC thread while open. Their bounds
    (`max_session_streams` and a tenant's share of it) are the stream gate's (server/wire/stream_gate.py). Bounds each
    frame's steps (`max_steps_per_frame`), and counts the work frames took."""

    def __init__(self, max_steps_per_frame: int = DEFAULT_MAX_STEPS_PER_FRAME) -> None:
        self.max_steps_per_frame = max_steps_per_frame
        self._num_open = 0
        self.num_bytes_measured = 0  # answers' bytes measured to fit frames' responses: linear in what they answer
        self.num_steps_abandoned = 0  # steps of frames whose caller left before they applied: never applied
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._num_open

    def count_frame(self, num_bytes_measured: int, num_steps_abandoned: int) -> None:
        """A frame's work, for the counters: the bytes its answers were measured for, the steps it left unapplied."""
        with self._lock:
            self.num_bytes_measured += num_bytes_measured
            self.num_steps_abandoned += num_steps_abandoned

    def serve(
        self,
        service: KVService,
        caller: Tenant,
        requests: Iterable[pb.SessionRequest | Undecodable],
        observe: Observe,
        is_active: Callable[[], bool] = lambda: True,
    ) -> Iterator[pb.SessionResponse]:
        """A response per request until the client half-closes, on the stream's handler thread; `is_active`: whether
        the caller is still there (gRPC's context). A generator: it counts as open once it starts."""
        with self._lock:
            self._num_open += 1
        stream = _Stream(service, caller, observe=observe, streams=self, is_active=is_active)
        try:
            incoming = iter(requests)
            while True:
                try:
                    request = next(incoming)
                except (StopIteration, grpc.RpcError):  # the client half-closed, cancelled or went away
                    return
                response, timings = stream.respond(request)
                try:
                    yield response
                finally:
                    stream.keep_timings(timings)
        finally:
            stream.close()
            with self._lock:
                self._num_open -= 1


Timing = tuple[str, grpc.StatusCode, float]  # a step's (pool, code, seconds), as the metrics take them


def _answer_frame(stream: _Stream, frame: pb.SessionRequest) -> tuple[pb.SessionResponse, list[Timing]]:
    """A frame's steps, each answered as if it came alone, in order; their responses in one message, each step
    bounded by the room the ones before it left (less a short refusal's room for each one after it). A frame of
    too many steps is refused whole; a caller that left stops its frame between steps."""
    response = pb.SessionResponse()
    timings: list[Timing] = []
    num_steps, streams = len(frame.steps), stream.streams
    if num_steps > streams.max_steps_per_frame:
        too_many = LimitExceeded("max_steps_per_frame", num_steps, streams.max_steps_per_frame)
        return pb.SessionResponse(error=step_error(too_many)), timings  # the clients refuse each step alike
    if len(frame.ListFields()) > 1:  # `steps` and something else
        refusal = step_error(InvalidArgument("steps", "a frame of steps sets no other field"))
        for _ in frame.steps:
            response.steps.add(error=refusal)
        return response, timings
    max_bytes = stream.max_message_bytes
    used = 0  # the response's bytes so far: each answer measured once, with its tag and length
    abandoned = 0
    for i, step in enumerate(frame.steps):
        if not stream.is_active():  # the caller left: the rest of its frame would be answered to no one
            abandoned = num_steps - i
            break
        room = max_bytes - used - (num_steps - i - 1) * SHORT_REFUSAL_BYTES - _FRAMING_BYTES
        if step.steps:
            refused = step_error(InvalidArgument(f"steps[{i}].steps", "a step inside a frame is not a frame"))
            answer = pb.SessionResponse(request_id=step.request_id, error=refused)
        else:
            answer, timing = stream.answer(step, room)
            timings.append(timing)
        size = answer.ByteSize()
        if answer.HasField("error") and size > room:  # cut to the room left for it
            answer.error.message = "(cut to fit the frame's response)"
            answer.error.ClearField("metadata")
            size = answer.ByteSize()
        response.steps.append(answer)
        used += size + _FRAMING_BYTES
    streams.count_frame(used, abandoned)
    return response, timings


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Stream:
    """One stream's state: the session it serves (held alive while the stream is open)."""

    def __init__(
        self,
        service: KVService,
        caller: Tenant,
        *,
        observe: Observe,
        streams: SessionStreams,
        is_active: Callable[[], bool],
    ) -> None:
        self._service, self._caller, self._observe = service, caller, observe
        self.streams, self.is_active = streams, is_active
        self.max_message_bytes = service.max_message_bytes or sys.maxsize  # None: no limit
        self._reply = Reply(self.max_message_bytes)  # a lone step's: the whole message is its room
        self._session: Session | None = None

    def close(self) -> None:
        if self._session is not None:
            self._service.sessions.unhold(self._session)

    def respond(self, request: pb.SessionRequest | Undecodable) -> tuple[pb.SessionResponse, list[Timing]]:
        """The response to one message (a step or a frame of them), and its steps' timings: kept with
        `keep_timings` once the response has been sent, off the step's round trip."""
        if isinstance(request, Undecodable) or not request.steps:
            response, timing = self.answer(request, self.max_message_bytes)
            return response, [timing]
        return _answer_frame(self, request)

    def keep_timings(self, timings: list[Timing]) -> None:
        for pool, code, seconds in timings:
            self._observe("Session", pool, code, seconds)

    def answer(self, request: pb.SessionRequest | Undecodable, max_bytes: int) -> tuple[pb.SessionResponse, Timing]:
        """The step's response (its results, or the refusal) in at most `max_bytes`, and its timing."""
        start = time.perf_counter()
        if isinstance(request, Undecodable):
            undecodable = InvalidArgument("request", f"not a valid SessionRequest: {request.error}")
            refused = pb.SessionResponse(error=step_error(undecodable))
            return refused, ("", grpc.StatusCode.INVALID_ARGUMENT, time.perf_counter() - start)
        pool = request.pool
        try:
            session = self._bind(request.session_id)
            step = step_of(request)
            service = self._service
            reply = self._reply if max_bytes == self.max_message_bytes else Reply(max_bytes)
            result = run_step(
                service.checks,
                service.pool(pool, session.tenant),
                session,
                step,
                reply,
                request_key("Session", request),
            )
        except RadixKVError as e:
            log.debug("step refused", extra={"method": "Session", "reason": e.reason, **e.metadata})
            bound = self._session.session_id if self._session is not None else ""
            error = step_error(e)
            refused = pb.SessionResponse(request_id=request.request_id, session_id=bound, error=error)
            return refused, (pool, _CODES[error.code], time.perf_counter() - start)
        packed = step.append is not None and bool(request.append.packed_seq_ids or request.append.packed_num_token_ids)
        response = response_of(request.request_id, session.session_id, result, packed)
        return response, (pool, grpc.StatusCode.OK, time.perf_counter() - start)

    def _bind(self, session_id: str) -> Session:
        """The stream's session: the first request names it; later ones leave it empty or repeat it."""
        bound = self._session
        if bound is not None and session_id in ("", bound.session_id):
            return self._service.sessions.get(bound.session_id, self._caller)  # live, and renewed
        if bound is not None:
            raise InvalidArgument(
                "session_id", f"this stream serves session {bound.session_id!r}: one stream per session"
            )
        session = self._service.sessions.get(session_id, self._caller)
        self._service.sessions.hold(session)
        self._session = session
        return session
