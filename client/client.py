"""`RadixKVClient`: the core's API over gRPC, for orchestrators (schedulers, routers).

Methods mirror `radixkv.KVCache` and return its dataclasses (`OpenResult`, `AppendResult`,
`Stats`), so code moves between the in-process core and a server unchanged; refusals raise the
same exceptions. The client opens a session on construction, renews its lease in the background,
and keeps each sequence's block table from the deltas the server sends (`block_table(seq_id)`).
Thread-safe: share one client between a scheduler's threads.

Failures and restarts:
  - The server unreachable (down, restarting, a network fault): calls raise `grpc.RpcError` with
    UNAVAILABLE. Retry; the session and its sequences survive as long as the server does and the
    lease (renewals keep retrying) has not run out.
  - The server restarted: nothing survives a restart (sessions, sequences, pins, the prefix cache,
    the pool memory itself). Session ids carry the id of the server run that issued them, so every
    call on the old session raises `ServerRestarted`, one exception whatever the call. Recover with
    `reopen()` (a new session; the old block tables are forgotten) and open new sequences; workers
    map the pool again (`PoolView.from_client`), since the restarted server has new memory.
  - The lease ran out (the client stalled past its ttl): `UnknownSession`, the base class of
    `ServerRestarted`, so `except UnknownSession` handles both; the same `reopen()` recovers.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from radixkv.client.errors import error_from_rpc
from radixkv.client.events import EventStream
from radixkv.client.lease import LeaseKeeper
from radixkv.client.pool_view import PoolInfo
from radixkv.errors import InvalidArgument, UnknownSequence, UnknownSession
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.layout import PoolLayout
from radixkv.results import AppendBatch, AppendResult, OpenResult
from radixkv.stats import Stats
from radixkv.token_ids import TokenIds
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

Response = TypeVar("Response")
_STATS_FIELDS = [f for f in pb.PoolStats.DESCRIPTOR.fields_by_name]


class RadixKVClient:
    """A session on one radixkv server, bound to one pool.

    Args:
        address: "host:port".
        pool: the pool every call names; checked when the session opens (`UnknownPool` at construction).
        token: bearer token, for a server with auth on.
        tls_root_cert: PEM bytes (or a path) of the CA that signed the server's certificate: use TLS.
        tls_server_name: the name the certificate was issued for, when it differs from `address`'s host.
        session_ttl: lease seconds; renewed every third of it while the client lives.
        timeout: seconds per unary call.
    """

    def __init__(
        self,
        address: str,
        *,
        pool: str = "default",
        token: str | None = None,
        tls_root_cert: bytes | str | None = None,
        tls_server_name: str | None = None,
        session_ttl: float = 30.0,
        timeout: float = 30.0,
        max_message_bytes: int = 64 * 2**20,
    ) -> None:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_root_cert is not None:
            if isinstance(tls_root_cert, str):
                with open(tls_root_cert, "rb") as f:
                    tls_root_cert = f.read()
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_root_cert), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout
        self.pool = pool
        self._tables: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._requested_ttl = session_ttl
        try:
            self._open_session()
        except BaseException:
            self._channel.close()
            raise

    def _open_session(self) -> None:
        request = pb.OpenSessionRequest(ttl_seconds=self._requested_ttl, pool=self.pool)
        session = self._call(self._stub.OpenSession, request)
        self.session_id: str = session.session_id
        self.session_ttl: float = session.ttl_seconds
        self._lease = LeaseKeeper(self.keep_alive, self.session_ttl / 3)
        self._lease.start()

    def _call(self, method: Callable[..., Response], request: Any) -> Response:
        try:
            return method(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e

    # -- session ----------------------------------------------------------------------------------

    def keep_alive(self) -> float:
        """Renew the lease now (the background thread does this on its own); returns its ttl."""
        return self._call(self._stub.KeepAlive, pb.KeepAliveRequest(session_id=self.session_id)).ttl_seconds

    def reopen(self) -> None:
        """Replace the session with a new one: after `ServerRestarted`, or `UnknownSession` (lease expired).

        The old session's sequences are gone with it: their block tables are forgotten here and
        their ids must not be used again. If the server still has the old session, it is closed.

        Raises:
            grpc.RpcError: UNAVAILABLE while the server is unreachable; call again later.
        """
        self._lease.stop()
        try:
            self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=self.session_id))
        except UnknownSession:  # ServerRestarted included: nothing of it is left to close
            pass
        with self._lock:
            self._tables.clear()
        self._open_session()

    def close(self) -> None:
        """Stop renewing, end the session (the server releases any sequence still open), close the channel."""
        self._lease.stop()
        try:
            self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=self.session_id))
        except UnknownSession:
            pass  # expired, or the server restarted (ServerRestarted): it released everything then
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                raise  # the server is gone, and its sessions with it; anything else is news
        finally:
            with self._lock:
                self._tables.clear()
            self._channel.close()

    def __enter__(self) -> RadixKVClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- sequences --------------------------------------------------------------------------------

    def open(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> OpenResult:
        """Start a sequence, reusing the longest cached prefix; see `KVCache.open`."""
        return self.open_many([(token_ids, namespace)])[0]

    def open_many(self, prompts: Sequence[tuple[TokenIds, str]]) -> list[OpenResult]:
        """Open several sequences, all or none."""
        lists = [_token_list(t) for t, _ in prompts]
        request = _checked(
            lambda: pb.OpenSequencesRequest(
                pool=self.pool,
                session_id=self.session_id,
                prompts=[pb.Prompt(token_ids=t, namespace=ns) for t, (_, ns) in zip(lists, prompts, strict=True)],
            ),
            lambda: [
                (f"prompts[{i}].token_ids" if len(lists) > 1 else "token_ids", t, _TOKEN_BOUND)
                for i, t in enumerate(lists)
            ],
        )
        response = self._call(self._stub.OpenSequences, request)
        results = [
            OpenResult(s.seq_id, s.num_cached_tokens, list(s.block_ids), np.array(s.slots, dtype=np.int64))
            for s in response.sequences
        ]
        with self._lock:
            for result in results:
                self._tables[result.seq_id] = list(result.block_table)
        return results

    def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        """Reserve slots for new tokens; see `KVCache.append`."""
        return self.append_many([(seq_id, token_ids)])[0]

    def append_many(self, items: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        """Append to several sequences, all or none (one decode step)."""
        lists = [_token_list(t) for _, t in items]
        return self.append_batch(
            [seq_id for seq_id, _ in items], [len(t) for t in lists], list(itertools.chain.from_iterable(lists))
        ).results()

    def append_batch(self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> AppendBatch:
        """One decode step in columns, as the wire carries it; see `KVCache.append_batch`."""
        tokens = _token_list(token_ids)
        request = _checked(
            lambda: pb.AppendTokensRequest(
                pool=self.pool, session_id=self.session_id, seq_ids=seq_ids, num_token_ids=num_token_ids, token_ids=tokens
            ),
            lambda: [
                ("seq_ids", seq_ids, _SEQ_ID_BOUND),
                ("num_token_ids", num_token_ids, _TOKEN_BOUND),
                ("token_ids", tokens, _TOKEN_BOUND),
            ],
        )
        response = self._call(self._stub.AppendTokens, request)
        batch = AppendBatch(
            list(seq_ids),
            list(num_token_ids),
            list(response.num_tokens),
            list(response.table_offsets),
            list(response.num_block_ids),
            list(response.block_ids),
            [(c.src_block_id, c.dst_block_id, c.sequence_index) for c in response.copies],
            np.array(response.slots, dtype=np.int64),
        )
        with self._lock:
            start = 0
            for seq_id, offset, num_blocks in zip(batch.seq_ids, batch.table_offsets, batch.num_block_ids, strict=True):
                table = self._tables.get(seq_id)
                if table is not None:
                    table[offset:] = batch.block_ids[start : start + num_blocks]
                start += num_blocks
        return batch

    def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        """New sequences sharing every block of `seq_id`; returns their ids."""
        request = _checked(
            lambda: pb.ForkSequenceRequest(
                pool=self.pool, session_id=self.session_id, seq_id=seq_id, num_children=num_children
            ),
            lambda: [("seq_id", [seq_id], _SEQ_ID_BOUND), ("num_children", [num_children], _TOKEN_BOUND)],
        )
        children = list(self._call(self._stub.ForkSequence, request).child_seq_ids)
        with self._lock:
            parent = self._tables.get(seq_id, [])
            for child in children:
                self._tables[child] = list(parent)
        return children

    def cache(self, seq_id: int) -> int:
        """Insert the sequence's full blocks into the prefix tree now; returns its tokens cached."""
        request = _checked(
            lambda: pb.CacheSequenceRequest(pool=self.pool, session_id=self.session_id, seq_id=seq_id),
            lambda: [("seq_id", [seq_id], _SEQ_ID_BOUND)],
        )
        return self._call(self._stub.CacheSequence, request).num_cached_tokens

    def release(self, seq_id: int, cache: bool = True) -> None:
        """End a sequence; with `cache`, its full blocks stay cached for later prompts."""
        self.release_many([seq_id], cache)

    def release_many(self, seq_ids: Iterable[int], cache: bool = True) -> None:
        """End several sequences, all or none."""
        ids = list(seq_ids)
        request = _checked(
            lambda: pb.ReleaseSequencesRequest(pool=self.pool, session_id=self.session_id, seq_ids=ids, cache=cache),
            lambda: [(f"seq_ids[{i}]", [s], _SEQ_ID_BOUND) for i, s in enumerate(ids)],
        )
        self._call(self._stub.ReleaseSequences, request)
        with self._lock:
            for seq_id in ids:
                self._tables.pop(seq_id, None)

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """The K/V of the first `num_tokens[i]` tokens of `seq_ids[i]` is written; see `KVCache.commit`.

        Call it after the worker has written a step, before `cache`, `fork` or `release(cache=True)`
        of a sequence whose last tokens it wrote: only full blocks below the watermark are cached.
        """
        ids, counts = list(seq_ids), list(num_tokens)
        request = _checked(
            lambda: pb.CommitTokensRequest(pool=self.pool, session_id=self.session_id, seq_ids=ids, num_tokens=counts),
            lambda: [("seq_ids", ids, _SEQ_ID_BOUND), ("num_tokens", counts, _TOKEN_BOUND)],
        )
        self._call(self._stub.CommitTokens, request)

    def describe_sequences(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(num_tokens, num_computed_tokens) of each sequence, in one call."""
        ids = list(seq_ids)
        request = _checked(
            lambda: pb.DescribeSequencesRequest(pool=self.pool, session_id=self.session_id, seq_ids=ids),
            lambda: [("seq_ids", ids, _SEQ_ID_BOUND)],
        )
        response = self._call(self._stub.DescribeSequences, request)
        return list(zip(response.num_tokens, response.num_computed_tokens, strict=True))

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence holds."""
        return self.describe_sequences([seq_id])[0][0]

    def num_computed_tokens(self, seq_id: int) -> int:
        """The sequence's computed watermark: leading tokens whose K/V is written."""
        return self.describe_sequences([seq_id])[0][1]

    def num_available_blocks(self) -> int:
        """Blocks an allocation could take now: free, or cached and evictable."""
        return self._call(self._stub.Stats, pb.StatsRequest(pool=self.pool, session_id=self.session_id)).num_available_blocks

    def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Would `append_batch(seq_ids, num_tokens, ...)` fit the pool now? Changes nothing."""
        ids, counts = list(seq_ids), list(num_tokens)
        request = _checked(
            lambda: pb.CanAppendRequest(pool=self.pool, session_id=self.session_id, seq_ids=ids, num_token_ids=counts),
            lambda: [("seq_ids", ids, _SEQ_ID_BOUND), ("num_tokens", counts, _TOKEN_BOUND)],
        )
        return self._call(self._stub.CanAppend, request).can_append

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How many blocks releasing `seq_ids` together would make available (for choosing whom to preempt)."""
        ids = list(seq_ids)
        request = _checked(
            lambda: pb.FreeableBlocksRequest(pool=self.pool, session_id=self.session_id, seq_ids=ids),
            lambda: [("seq_ids", ids, _SEQ_ID_BOUND)],
        )
        return self._call(self._stub.FreeableBlocks, request).num_freeable_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table as the server's deltas built it here (no RPC)."""
        with self._lock:
            table = self._tables.get(seq_id)
            if table is None:
                raise UnknownSequence(seq_id)
            return list(table)

    # -- prefixes ---------------------------------------------------------------------------------

    def match(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many leading tokens are cached; changes nothing."""
        tokens = _token_list(token_ids)
        request = _checked(
            lambda: pb.MatchRequest(pool=self.pool, session_id=self.session_id, token_ids=tokens, namespace=namespace),
            lambda: [("token_ids", tokens, _TOKEN_BOUND)],
        )
        return self._call(self._stub.Match, request).num_cached_tokens

    def pin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Keep the cached prefix resident until `unpin` or this session's end; returns tokens pinned."""
        tokens = _token_list(token_ids)
        request = _checked(
            lambda: pb.PinRequest(pool=self.pool, session_id=self.session_id, token_ids=tokens, namespace=namespace),
            lambda: [("token_ids", tokens, _TOKEN_BOUND)],
        )
        return self._call(self._stub.Pin, request).num_pinned_tokens

    def unpin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> None:
        tokens = _token_list(token_ids)
        request = _checked(
            lambda: pb.UnpinRequest(pool=self.pool, session_id=self.session_id, token_ids=tokens, namespace=namespace),
            lambda: [("token_ids", tokens, _TOKEN_BOUND)],
        )
        self._call(self._stub.Unpin, request)

    # -- pool -------------------------------------------------------------------------------------

    def stats(self) -> Stats:
        response = self._call(self._stub.Stats, pb.StatsRequest(pool=self.pool, session_id=self.session_id))
        return Stats(**{f: getattr(response.stats, f) for f in _STATS_FIELDS})

    def get_pool(self) -> PoolInfo:
        """The pool's layout and the handle a co-located worker maps it with (see `PoolView`)."""
        r = self._call(self._stub.GetPool, pb.GetPoolRequest(pool=self.pool, session_id=self.session_id))
        layout = PoolLayout(
            r.layout.num_layers,
            r.layout.num_kv_heads,
            r.layout.head_dim,
            r.layout.block_size,
            r.layout.num_blocks,
            r.layout.dtype,
        )
        return PoolInfo(r.pool, layout, r.device, json.loads(r.handle_json))

    def watch_events(self, namespaces: Sequence[str] = (), *, include_snapshot: bool = False) -> EventStream:
        """Stream blocks stored into and removed from the prefix tree (all your namespaces when none named)."""
        request = pb.WatchEventsRequest(
            pool=self.pool, session_id=self.session_id, namespaces=list(namespaces), include_snapshot=include_snapshot
        )
        return EventStream(self._stub.WatchEvents(request, metadata=self._metadata))


def _token_list(token_ids: TokenIds) -> Sequence[int]:
    if isinstance(token_ids, bytes):
        return np.frombuffer(token_ids, dtype="<i4").tolist()
    if isinstance(token_ids, np.ndarray):
        return token_ids.tolist()
    if not isinstance(token_ids, Sequence):
        raise InvalidArgument(
            "token_ids", f"must be a list, a numpy array or packed int32 bytes, got {type(token_ids).__name__}"
        )
    return token_ids


Request = TypeVar("Request")
_TOKEN_BOUND = 2**32  # what uint32 carries; the server refuses ids >= 2^31 itself
_SEQ_ID_BOUND = 2**63  # sequence ids are int64 end to end (uint64 on the wire, issued below 2^63)


def _checked(
    build: Callable[[], Request], fields: Callable[[], Iterable[tuple[str, Sequence[object], int]]]
) -> Request:
    """Build a request; if protobuf refuses a value, raise InvalidArgument naming its field, as the server would.

    `fields` lists (field name, values, exclusive upper bound); it is only called on failure.
    """
    try:
        return build()
    except (TypeError, ValueError):
        for field, values, bound in fields():
            if not isinstance(values, Sequence) or any(
                not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < bound for v in values
            ):
                raise InvalidArgument(field, f"must be integers in [0, {bound})") from None
        raise
