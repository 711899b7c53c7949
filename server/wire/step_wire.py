"""A Session step on the wire: a SessionRequest as a `Step`, a `StepResult` as its SessionResponse.

Only the fields a step sets are read, and only those its result has are written: protobuf costs
per field given, even an empty one. An append may carry its id and count columns packed
(`StepAppend.packed_seq_ids`, radixkv.sequences.packed); it is answered with its result columns in
the form it sent them. Slots always travel packed (8 bytes each, `sizes.py` bounds them so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc
import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, RadixKVError
from radixkv.sequences.packed import pack, unpack
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.rules.miss_reasons import wire_reason
from radixkv.server.wire.status import MAX_ECHO_CHARS, STATUS_BY_REASON, truncated
from radixkv.v1 import kvcache_pb2 as pb

_INT64 = np.dtype("<i8")
_NO_ITEMS = Step()  # a request with no items (a Step is immutable: one serves them all)


def step_of(request: pb.SessionRequest, unpack_ids: Callable[[bytes], list[int]]) -> Step:
    """The request as a Step; empty item lists are left at their defaults (a decode step reads one field).
    `unpack_ids`: packed seq ids as a list, never changed by the step."""
    if not (request.opens or request.forks or request.cache_seq_ids or request.releases or request.HasField("commit")):
        return Step(append=_append(request.append, unpack_ids)) if request.HasField("append") else _NO_ITEMS  # decode
    items: dict[str, object] = {}
    if request.HasField("commit"):
        items["commit"] = Commit(list(request.commit.seq_ids), list(request.commit.num_tokens))
    if request.opens:
        items["opens"] = [(o.token_ids, o.namespace) for o in request.opens]
        if any(o.max_new_tokens or o.priority for o in request.opens):
            items["max_new_tokens"] = [o.max_new_tokens for o in request.opens]
            items["priorities"] = [o.priority for o in request.opens]
        if any(o.explain for o in request.opens):
            items["explain"] = [o.explain for o in request.opens]
    if request.HasField("append"):
        items["append"] = _append(request.append, unpack_ids)
    if request.forks:
        items["forks"] = [(f.seq_id, f.num_children) for f in request.forks]
    if request.cache_seq_ids:
        items["caches"] = list(request.cache_seq_ids)
    if request.releases:
        items["releases"] = [(list(r.seq_ids), r.cache if r.HasField("cache") else True) for r in request.releases]
    return Step(**items)  # type: ignore[arg-type]


def _append(a: pb.StepAppend, unpack_ids: Callable[[bytes], list[int]]) -> Append:
    """The append item, from its repeated or its packed columns (see radixkv.sequences.packed)."""
    if not (a.packed_seq_ids or a.packed_num_token_ids):
        return Append(list(a.seq_ids), list(a.num_token_ids), a.token_ids)
    try:
        if a.seq_ids or a.num_token_ids:
            raise InvalidArgument("packed_seq_ids", "set seq_ids and num_token_ids or their packed forms, not both")
        seq_ids = unpack_ids(a.packed_seq_ids)
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
