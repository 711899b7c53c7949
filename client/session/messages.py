"""Requests built and responses read for both clients: `RadixKVClient` (blocking) and `AsyncRadixKVClient`.

The two clients differ only in how they wait; everything they send and every record they return
is made here, so they cannot drift apart. A value protobuf refuses (a negative id, a token id past
uint32) raises `InvalidArgument` naming its field, as the server would.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor

from radixkv.client.worker.pool_info import HostTierInfo, PoolInfo
from radixkv.errors import InvalidArgument
from radixkv.memory.layout import PoolLayout
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.stats import Stats
from radixkv.tree.eviction import Retention
from radixkv.tree.radix_tree import TokenIds
from radixkv.v1 import kvcache_pb2 as pb

_STATS_FIELDS = [f for f in pb.PoolStats.DESCRIPTOR.fields_by_name if f in {g.name for g in dataclasses.fields(Stats)}]
_TOKEN_BOUND = 2**32  # what uint32 carries; the server refuses ids >= 2^31 itself
_INT32 = np.dtype("<i4")
_INT64 = np.dtype("<i8")

Request = TypeVar("Request")

# -- unary requests and their results ------------------------------------------------------------


def open_request(
    pool: str,
    session_id: str,
    prompts: Sequence[tuple[TokenIds, str]],
    max_new_tokens: Sequence[int] | None = None,
    priorities: Sequence[int] | None = None,
) -> pb.OpenSequencesRequest:
    batch = len(prompts) > 1
    budgets = per_prompt("max_new_tokens", max_new_tokens, len(prompts))
    ranks = per_prompt("priorities", priorities, len(prompts))
    return build(
        pb.OpenSequencesRequest,
        pool=pool,
        session_id=session_id,
        prompts=[
            build(
                pb.Prompt,
                field_prefix=f"prompts[{i}]." if batch else "",
                token_ids=token_list(t),
                namespace=ns,
                max_new_tokens=budget,
                priority=rank,
            )
            for i, ((t, ns), budget, rank) in enumerate(zip(prompts, budgets, ranks, strict=True))
        ],
    )


def int32(block_ids: Iterable[int]) -> np.ndarray:
    """A block table from the wire as the core returns it: a read-only int32 array."""
    table = np.fromiter(block_ids, dtype=np.int32)
    table.flags.writeable = False
    return table


def per_prompt(name: str, values: Sequence[int] | None, num_prompts: int) -> list[int]:
    """A per-prompt column (None: all 0); InvalidArgument naming it when its length is wrong."""
    if values is None:
        return [0] * num_prompts
    if len(values) != num_prompts:
        raise InvalidArgument(name, f"needs one entry per prompt ({num_prompts}), got {len(values)}")
    return list(values)


def open_results(response: pb.OpenSequencesResponse) -> list[OpenResult]:
    """The batch's host-tier transfers come on its first result (the worker applies each result's in turn)."""
    results = [
        OpenResult(
            seq_id=s.seq_id,
            num_cached_tokens=s.num_cached_tokens,
            block_table=int32(s.block_ids),
            slot_source=np.array(s.slots, dtype=np.int64),
            num_host_hit_tokens=s.num_host_hit_tokens,
        )
        for s in response.sequences
    ]
    if results:
        results[0].offloads, results[0].loads = transfer_pairs(response.offloads), transfer_pairs(response.loads)
    return results


def transfer_pairs(transfers: Sequence[pb.BlockTransfer]) -> npt.NDArray[np.int64]:
    """Wire transfers as int64 `[n, 2]` (src_block, dst_block): `kernels.swap_blocks`' pairs."""
    return np.array([(t.src_block_id, t.dst_block_id) for t in transfers], dtype=np.int64).reshape(-1, 2)


def append_request(
    pool: str, session_id: str, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds
) -> pb.AppendTokensRequest:
    return build(
        pb.AppendTokensRequest,
        pool=pool,
        session_id=session_id,
        seq_ids=seq_ids,
        num_token_ids=num_token_ids,
        token_ids=token_list(token_ids),
    )


def append_result(
    seq_ids: Sequence[int], num_token_ids: Sequence[int], response: pb.AppendTokensResponse
) -> AppendBatch:
    return AppendBatch(
        seq_ids=list(seq_ids),
        num_appended=list(num_token_ids),
        num_tokens=list(response.num_tokens),
        table_offsets=list(response.table_offsets),
        num_block_ids=list(response.num_block_ids),
        block_ids=list(response.block_ids),
        copies=[(c.src_block_id, c.dst_block_id, c.sequence_index) for c in response.copies],
        slot_source=np.array(response.slots, dtype=np.int64),
        offloads=transfer_pairs(response.offloads),
    )


def append_items(items: Sequence[tuple[int, TokenIds]]) -> tuple[list[int], list[int], list[int]]:
    """`append_many`'s (seq_id, tokens) pairs as `append_batch`'s columns."""
    lists = [token_list(t) for _, t in items]
    return [seq_id for seq_id, _ in items], [len(t) for t in lists], list(itertools.chain.from_iterable(lists))


def fork_request(pool: str, session_id: str, seq_id: int, num_children: int) -> pb.ForkSequenceRequest:
    return build(pb.ForkSequenceRequest, pool=pool, session_id=session_id, seq_id=seq_id, num_children=num_children)


def cache_request(pool: str, session_id: str, seq_id: int) -> pb.CacheSequenceRequest:
    return build(pb.CacheSequenceRequest, pool=pool, session_id=session_id, seq_id=seq_id)


def release_request(pool: str, session_id: str, seq_ids: list[int], cache: bool) -> pb.ReleaseSequencesRequest:
    return build(pb.ReleaseSequencesRequest, pool=pool, session_id=session_id, seq_ids=seq_ids, cache=cache)


def commit_request(pool: str, session_id: str, seq_ids: list[int], num_tokens: list[int]) -> pb.CommitTokensRequest:
    return build(pb.CommitTokensRequest, pool=pool, session_id=session_id, seq_ids=seq_ids, num_tokens=num_tokens)


def seq_ids_request(message: Callable[..., Request], pool: str, session_id: str, seq_ids: list[int]) -> Request:
    """A DescribeSequences or FreeableBlocks request."""
    return build(message, pool=pool, session_id=session_id, seq_ids=seq_ids)


def can_append_request(pool: str, session_id: str, seq_ids: list[int], num_tokens: list[int]) -> pb.CanAppendRequest:
    return build(pb.CanAppendRequest, pool=pool, session_id=session_id, seq_ids=seq_ids, num_token_ids=num_tokens)


def preempt_request(pool: str, session_id: str, seq_ids: list[int], mode: str) -> pb.PreemptRequest:
    modes = {"swap": pb.PREEMPT_MODE_SWAP, "recompute": pb.PREEMPT_MODE_RECOMPUTE}
    if mode not in modes:
        raise InvalidArgument("mode", f"must be 'swap' or 'recompute', got {mode!r}")
    return build(pb.PreemptRequest, pool=pool, session_id=session_id, seq_ids=seq_ids, mode=modes[mode])


def preempt_result(seq_ids: list[int], mode: str, response: pb.PreemptResponse) -> PreemptResult:
    offloads = transfer_pairs(response.offloads)
    return PreemptResult(
        seq_ids=seq_ids,
        mode=mode,
        offloads=offloads,
        num_freed_blocks=response.num_freed_blocks,
        num_unreserved_blocks=response.num_unreserved_blocks,
    )


def resume_request(pool: str, session_id: str, seq_id: int) -> pb.ResumeRequest:
    return build(pb.ResumeRequest, pool=pool, session_id=session_id, seq_id=seq_id)


def resume_result(r: pb.ResumeResponse) -> ResumeResult:
    slots = np.array(r.slots, dtype=np.int64)
    return ResumeResult(
        seq_id=r.seq_id,
        num_cached_tokens=r.num_cached_tokens,
        block_table=int32(r.block_ids),
        slot_source=slots,
        num_host_hit_tokens=r.num_host_hit_tokens,
        offloads=transfer_pairs(r.offloads),
        loads=transfer_pairs(r.loads),
    )


def victims_request(pool: str, session_id: str, num_blocks: int) -> pb.VictimsRequest:
    return build(pb.VictimsRequest, pool=pool, session_id=session_id, num_blocks=num_blocks)


def described(response: pb.DescribeSequencesResponse) -> list[tuple[int, int]]:
    """(num_tokens, num_computed_tokens) per sequence."""
    return list(zip(response.num_tokens, response.num_computed_tokens, strict=True))


def prefix_request(
    message: Callable[..., Request], pool: str, session_id: str, token_ids: TokenIds, namespace: str, **extra: object
) -> Request:
    """A Match, Pin or Unpin request (`extra`: e.g. Match's explain)."""
    fields = dict(pool=pool, session_id=session_id, token_ids=token_list(token_ids), namespace=namespace, **extra)
    return build(message, "", **fields)


def retain_request(
    pool: str, session_id: str, token_ids: TokenIds, namespace: str, retention: Retention
) -> pb.RetainRequest:
    """A Retain request carrying `retention` (checked here, as the server checks it)."""
    hint = pb.Retention(
        ttl_seconds=retention.ttl_s,
        priority=retention.priority,
        refresh=retention.refresh,
        end_session=retention.end_session,
    )
    return prefix_request(pb.RetainRequest, pool, session_id, token_ids, namespace, retention=hint)


def stats_result(response: pb.StatsResponse) -> Stats:
    return Stats(**{f: getattr(response.stats, f) for f in _STATS_FIELDS})  # derived ones (pressure) recomputed


def pool_info(r: pb.GetPoolResponse) -> PoolInfo:
    host = HostTierInfo(pool_layout(r.host_layout), r.host_handle) if r.HasField("host_handle") else None
    return PoolInfo(name=r.pool, layout=pool_layout(r.layout), device=r.device, handle=r.handle, host=host)


def pool_layout(layout: pb.PoolLayout) -> PoolLayout:
    return PoolLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        dtype=layout.dtype,
    )


# -- values ---------------------------------------------------------------------------------------


def token_list(token_ids: TokenIds) -> Sequence[int]:
    if isinstance(token_ids, bytes):
        return np.frombuffer(token_ids, dtype=_INT32).tolist()
    if isinstance(token_ids, np.ndarray):
        return token_ids.tolist()
    if not isinstance(token_ids, Sequence):
        raise InvalidArgument(
            "token_ids", f"must be a list, a numpy array or packed int32 bytes, got {type(token_ids).__name__}"
        )
    return token_ids


_INTEGER_BOUNDS = {
    FieldDescriptor.TYPE_UINT32: 2**32,
    FieldDescriptor.TYPE_UINT64: 2**64,
    FieldDescriptor.TYPE_INT32: 2**31,
    FieldDescriptor.TYPE_INT64: 2**63,
}


def build(message_cls: Callable[..., Request], field_prefix: str = "", **fields: object) -> Request:
    """`message_cls(**fields)`; a value protobuf refuses raises InvalidArgument naming its field, as the server would.

    `field_prefix` names where the message sits in its request (`prompts[2].`), for the error.
    """
    try:
        return message_cls(**fields)
    except (TypeError, ValueError):
        pass
    descriptor = message_cls.DESCRIPTOR  # type: ignore[attr-defined]
    for name, value in fields.items():
        try:
            message_cls(**{name: value})
        except (TypeError, ValueError):
            bound = _INTEGER_BOUNDS.get(descriptor.fields_by_name[name].type)
            why = f"must be integers in [0, {bound})" if bound is not None else f"not a valid {name}"
            raise InvalidArgument(field_prefix + name, why) from None
    return message_cls(**fields)  # each field alone was fine: raise protobuf's own error
