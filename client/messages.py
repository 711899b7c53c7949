"""Requests built and responses read for both clients: `RadixKVClient` (blocking) and `AsyncRadixKVClient`.

The two clients differ only in how they wait; everything they send and every record they return
is made here, so they cannot drift apart. A value protobuf refuses (a negative id, a token id past
uint32) raises `InvalidArgument` naming its field, as the server would.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor

from radixkv.client.match_explanation import MatchExplanation
from radixkv.client.pool_view import HostTierInfo, PoolInfo
from radixkv.errors import ERRORS_BY_REASON, InvalidArgument, RadixKVError, UnknownSequence
from radixkv.memory.layout import PoolLayout
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.packed import all_ones, pack, unpack
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.sequences.step import Append, Step, StepResult
from radixkv.stats import Stats
from radixkv.tree.token_ids import TokenIds
from radixkv.v1 import kvcache_pb2 as pb

_STATS_FIELDS = [f for f in pb.PoolStats.DESCRIPTOR.fields_by_name if f in {g.name for g in dataclasses.fields(Stats)}]
_TOKEN_BOUND = 2**32  # what uint32 carries; the server refuses ids >= 2^31 itself
_INT32 = np.dtype("<i4")
_INT64 = np.dtype("<i8")

Request = TypeVar("Request")

# Mutating calls carry a request id, so these failures, after which the client cannot know whether
# the call was applied, are retried with the same id (the server answers a repeat with its first result).
RETRIED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
MAX_ATTEMPTS = 3


def retry_delay(attempt: int) -> float:
    """Seconds before re-sending after failed attempt `attempt` (0-based): 0.1, 0.2, ..."""
    return 0.1 * 2**attempt


class BlockTables:
    """Each open sequence's block table as the server's deltas built it here; thread-safe."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def get(self, seq_id: int) -> list[int]:
        with self._lock:
            table = self._tables.get(seq_id)
            if table is None:
                raise UnknownSequence(seq_id)
            return list(table)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()

    def opened(self, results: Iterable[OpenResult]) -> None:
        with self._lock:
            for result in results:
                self._tables[result.seq_id] = result.block_table.tolist()

    def appended(self, batch: AppendBatch) -> None:
        # Only sequences that got blocks changed (about 1 in block_size per decode step): visit just those.
        if not batch.block_ids:
            return
        changed = itertools.compress(range(len(batch.num_block_ids)), batch.num_block_ids)
        with self._lock:
            start = 0
            for i in changed:
                num_blocks = batch.num_block_ids[i]
                table = self._tables.get(batch.seq_ids[i])
                if table is not None:
                    table[batch.table_offsets[i] :] = batch.block_ids[start : start + num_blocks]
                start += num_blocks

    def forked(self, parent: int, children: Iterable[int]) -> None:
        with self._lock:
            table = self._tables.get(parent, [])
            for child in children:
                self._tables[child] = list(table)

    def preempted(self, seq_ids: Iterable[int]) -> None:
        """Preempted sequences hold no block until resumed (`opened` with the resume's result)."""
        with self._lock:
            for seq_id in seq_ids:
                if seq_id in self._tables:
                    self._tables[seq_id] = []

    def released(self, seq_ids: Iterable[int]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._tables.pop(seq_id, None)

    def stepped(self, step: Step, result: StepResult) -> None:
        """A step's changes, in the order the server applied them."""
        self.opened(result.opened)
        if result.appended is not None:
            self.appended(result.appended)
        for (parent, _), children in zip(step.forks, result.forked, strict=True):
            self.forked(parent, children)
        for seq_ids, _ in step.releases:
            self.released(seq_ids)


# -- unary requests and their results ------------------------------------------------------------


def open_request(
    pool: str,
    session_id: str,
    prompts: Sequence[tuple[TokenIds, str]],
    max_new_tokens: Sequence[int] | None = None,
    priorities: Sequence[int] | None = None,
) -> pb.OpenSequencesRequest:
    batch = len(prompts) > 1
    budgets = _per_prompt("max_new_tokens", max_new_tokens, len(prompts))
    ranks = _per_prompt("priorities", priorities, len(prompts))
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
            )  # fmt: skip
            for i, ((t, ns), budget, rank) in enumerate(zip(prompts, budgets, ranks, strict=True))
        ],
    )


def _int32(block_ids: Iterable[int]) -> np.ndarray:
    """A block table from the wire as the core returns it: a read-only int32 array."""
    table = np.fromiter(block_ids, dtype=np.int32)
    table.flags.writeable = False
    return table


def _per_prompt(name: str, values: Sequence[int] | None, num_prompts: int) -> list[int]:
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
            s.seq_id,
            s.num_cached_tokens,
            _int32(s.block_ids),
            np.array(s.slots, dtype=np.int64),
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
        list(seq_ids),
        list(num_token_ids),
        list(response.num_tokens),
        list(response.table_offsets),
        list(response.num_block_ids),
        list(response.block_ids),
        [(c.src_block_id, c.dst_block_id, c.sequence_index) for c in response.copies],
        np.array(response.slots, dtype=np.int64),
        transfer_pairs(response.offloads),
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
    return PreemptResult(seq_ids, mode, offloads, response.num_freed_blocks, response.num_unreserved_blocks)


def resume_request(pool: str, session_id: str, seq_id: int) -> pb.ResumeRequest:
    return build(pb.ResumeRequest, pool=pool, session_id=session_id, seq_id=seq_id)


def resume_result(r: pb.ResumeResponse) -> ResumeResult:
    slots = np.array(r.slots, dtype=np.int64)
    return ResumeResult(
        r.seq_id, r.num_cached_tokens, _int32(r.block_ids), slots, r.num_host_hit_tokens, transfer_pairs(r.offloads),
        transfer_pairs(r.loads),
    )  # fmt: skip


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


def stats_result(response: pb.StatsResponse) -> Stats:
    return Stats(**{f: getattr(response.stats, f) for f in _STATS_FIELDS})  # derived ones (pressure) recomputed


def pool_info(r: pb.GetPoolResponse) -> PoolInfo:
    host = HostTierInfo(pool_layout(r.host_layout), r.host_handle) if r.HasField("host_handle") else None
    return PoolInfo(r.pool, pool_layout(r.layout), r.device, r.handle, host)


def pool_layout(layout: pb.PoolLayout) -> PoolLayout:
    return PoolLayout(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.num_blocks, layout.dtype
    )


# -- steps on the Session stream -----------------------------------------------------------------


def step_request(pool: str, session_id: str, request_id: int, step: Step) -> pb.SessionRequest:
    """The step as one SessionRequest: token ids packed as int32 bytes, ids checked as the unary builders do."""
    request = pb.SessionRequest(session_id=session_id, pool=pool, request_id=request_id)
    if step.commit is not None:
        request.commit.CopyFrom(build(pb.StepCommit, seq_ids=step.commit.seq_ids, num_tokens=step.commit.num_tokens))
    if step.opens or step.max_new_tokens or step.priorities or step.explain:  # a decode step skips the opens
        budgets = _per_prompt("max_new_tokens", step.max_new_tokens or None, len(step.opens))
        ranks = _per_prompt("priorities", step.priorities or None, len(step.opens))
        explain = _per_prompt("explain", [int(bool(e)) for e in step.explain] or None, len(step.opens))
        columns = zip(step.opens, budgets, ranks, explain, strict=True)
        for i, ((token_ids, namespace), budget, rank, why) in enumerate(columns):
            field = f"prompts[{i}]." if len(step.opens) > 1 else ""
            opened = build(
                pb.StepOpen, field, namespace=namespace, max_new_tokens=budget, priority=rank, explain=bool(why)
            )
            opened.token_ids = packed_tokens(token_ids, field + "token_ids")
            request.opens.append(opened)
    if step.append is not None:
        a = step.append
        appended = request.append
        try:
            packed = _packed_columns(a) if len(a.seq_ids) == len(a.num_token_ids) else None
        except (TypeError, OverflowError):
            packed = None
        if packed is not None:
            appended.packed_seq_ids, appended.packed_num_token_ids = packed
        else:  # a bad entry (named here) or a short column (named by the server), as the unary call says it
            appended.CopyFrom(build(pb.StepAppend, seq_ids=a.seq_ids, num_token_ids=a.num_token_ids))
        appended.token_ids = packed_tokens(a.token_ids, "token_ids")
    if step.forks:
        request.forks.extend(build(pb.StepFork, seq_id=s, num_children=n) for s, n in step.forks)
    if step.caches:
        request.MergeFrom(build(pb.SessionRequest, cache_seq_ids=step.caches))
    if step.releases:
        request.releases.extend(build(pb.StepRelease, seq_ids=list(ids), cache=cache) for ids, cache in step.releases)
    return request


_APPENDED_COLUMNS = ("num_tokens", "table_offsets", "num_block_ids", "block_ids")  # StepAppended's, in order
_PACKED_APPENDED_COLUMNS = tuple(f"packed_{name}" for name in _APPENDED_COLUMNS)


def _packed_columns(append: Append) -> tuple[bytes, bytes]:
    """An append's ids and counts as the stream packs them (radixkv.sequences.packed): a decode step's ones are left
    implied. Raises TypeError or OverflowError for an entry that is not an unsigned integer."""
    counts = b"" if all_ones(append.num_token_ids) else pack(append.num_token_ids, 4)
    return pack(append.seq_ids, 8), counts


def step_result(step: Step, response: pb.SessionResponse) -> StepResult:
    """The step's results, or its refusal raised as the exception the unary call would have raised."""
    if response.HasField("error"):
        raise step_error(response.error)
    opened = [
        OpenResult(
            o.seq_id,
            o.num_cached_tokens,
            _int32(o.block_ids),
            np.frombuffer(o.slots, dtype=_INT64),
            num_host_hit_tokens=o.num_host_hit_tokens,
        )
        for o in response.opened
    ]
    appended = None
    if step.append is not None:
        a, r = step.append, response.appended
        if r.packed_num_tokens:  # the server answers packed columns to a packed append
            num_tokens, offsets, num_blocks, blocks = (
                unpack(getattr(r, name), 4, name) for name in _PACKED_APPENDED_COLUMNS
            )
        else:
            num_tokens, offsets, num_blocks, blocks = (list(getattr(r, name)) for name in _APPENDED_COLUMNS)
        appended = AppendBatch(
            list(a.seq_ids),
            list(a.num_token_ids) if isinstance(a.num_token_ids, list) else list(map(int, a.num_token_ids)),
            num_tokens,
            offsets,
            num_blocks,
            blocks,
            [(c.src_block_id, c.dst_block_id, c.sequence_index) for c in r.copies],
            np.frombuffer(r.slots, dtype=_INT64),
        )
    if not (response.forked or response.offloads or response.loads or response.num_cached_tokens or any(step.explain)):
        return StepResult(opened, appended, [], [], response.num_released_sequences)  # a decode step: the common case
    forked = [list(f.child_seq_ids) for f in response.forked]
    explained: Sequence[MatchExplanation | None] = ()
    if any(step.explain):  # a step retried from the window is answered with its first result, explanations too
        pairs = zip(response.opened, step.explain, strict=True)
        explained = [MatchExplanation.from_response(o) if e else None for o, e in pairs]
    return StepResult(
        opened,
        appended,
        forked,
        list(response.num_cached_tokens),
        response.num_released_sequences,
        explained,
        transfer_pairs(response.offloads),
        transfer_pairs(response.loads),
    )


def step_error(error: pb.StepError) -> RadixKVError:
    cls = ERRORS_BY_REASON.get(error.reason, RadixKVError)
    return cls.from_wire(error.message, dict(error.metadata))


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


def packed_tokens(token_ids: TokenIds, field: str) -> bytes:
    """Token ids as the stream carries them: little-endian int32 bytes (the server checks their range)."""
    if isinstance(token_ids, bytes):
        return token_ids
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == _INT32:
        return token_ids.tobytes()
    array = np.asarray(token_list(token_ids))
    if array.ndim != 1 or (
        array.size and (array.dtype.kind not in "iu" or array.min() < 0 or array.max() >= _TOKEN_BOUND)
    ):
        raise InvalidArgument(field, f"must be integers in [0, {_TOKEN_BOUND})")
    return array.astype(_INT32).tobytes()  # ids >= 2^31 wrap negative: the server refuses them, as uint32 on unary


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
