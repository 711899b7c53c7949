"""A step as the Session stream carries it, for both clients: the SessionRequest built, the SessionResponse read.

Token ids and slots travel packed (int32 and int64 bytes); a decode step's append columns too
(radixkv.sequences.packed), its counts left implied when every sequence appends one token. Ids are
checked as the unary builders check them (`messages.build`), so a bad value names its field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from radixkv.client.session.match_explanation import MatchExplanation
from radixkv.client.session.messages import build, int32, per_prompt, token_list, transfer_pairs
from radixkv.client.session.pipeline import Pending
from radixkv.client.worker.block_tables import BlockTables
from radixkv.errors import ERRORS_BY_REASON, InvalidArgument, RadixKVError
from radixkv.sequences.packed import all_ones, pack, unpack
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.sequences.step import Append, Step, StepResult
from radixkv.tree.radix_tree import TokenIds
from radixkv.v1 import kvcache_pb2 as pb

_TOKEN_BOUND = 2**32  # what uint32 carries; the server refuses ids >= 2^31 itself
_INT32 = np.dtype("<i4")
_INT64 = np.dtype("<i8")


def step_request(pool: str, session_id: str, request_id: int, step: Step) -> pb.SessionRequest:
    """The step as one SessionRequest: token ids packed as int32 bytes, ids checked as the unary builders do."""
    request = pb.SessionRequest(session_id=session_id, pool=pool, request_id=request_id)
    if step.commit is not None:
        request.commit.CopyFrom(build(pb.StepCommit, seq_ids=step.commit.seq_ids, num_tokens=step.commit.num_tokens))
    if step.opens or step.max_new_tokens or step.priorities or step.explain:  # a decode step skips the opens
        budgets = per_prompt("max_new_tokens", step.max_new_tokens or None, len(step.opens))
        ranks = per_prompt("priorities", step.priorities or None, len(step.opens))
        explain = per_prompt("explain", [int(bool(e)) for e in step.explain] or None, len(step.opens))
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
            seq_id=o.seq_id,
            num_cached_tokens=o.num_cached_tokens,
            block_table=int32(o.block_ids),
            slot_source=np.frombuffer(o.slots, dtype=_INT64),
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
            seq_ids=list(a.seq_ids),
            num_appended=list(a.num_token_ids)
            if isinstance(a.num_token_ids, list)
            else list(map(int, a.num_token_ids)),
            num_tokens=num_tokens,
            table_offsets=offsets,
            num_block_ids=num_blocks,
            block_ids=blocks,
            copies=[(c.src_block_id, c.dst_block_id, c.sequence_index) for c in r.copies],
            slot_source=np.frombuffer(r.slots, dtype=_INT64),
        )
    if not (response.forked or response.offloads or response.loads or response.num_cached_tokens or any(step.explain)):
        return StepResult(
            opened=opened,
            appended=appended,
            forked=[],
            num_cached_tokens=[],
            num_released_sequences=response.num_released_sequences,
        )  # a decode step: the common case
    forked = [list(f.child_seq_ids) for f in response.forked]
    explained: Sequence[MatchExplanation | None] = ()
    if any(step.explain):  # a step retried from the window is answered with its first result, explanations too
        pairs = zip(response.opened, step.explain, strict=True)
        explained = [MatchExplanation.from_response(o) if e else None for o, e in pairs]
    return StepResult(
        opened=opened,
        appended=appended,
        forked=forked,
        num_cached_tokens=list(response.num_cached_tokens),
        num_released_sequences=response.num_released_sequences,
        explanations=explained,
        offloads=transfer_pairs(response.offloads),
        loads=transfer_pairs(response.loads),
    )


def step_error(error: pb.StepError) -> RadixKVError:
    cls = ERRORS_BY_REASON.get(error.reason, RadixKVError)
    return cls.from_wire(error.message, dict(error.metadata))


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


def settle(pending: Pending[Any], response: pb.SessionResponse, tables: BlockTables) -> None:
    """Settle a step with its result, the block tables following it (steps settle in stream order), or with
    its refusal."""
    try:
        result = step_result(pending.step, response)
    except RadixKVError as e:
        pending.settle(None, e)
        return
    tables.stepped(pending.step, result)
    pending.settle(result, None)
