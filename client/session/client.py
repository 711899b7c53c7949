"""`RadixKVClient`: the core's API over gRPC, for orchestrators (schedulers, routers).

Methods mirror `radixkv.KVCache` and return its dataclasses (`OpenResult`, `AppendResult`,
`Stats`), so code moves between the in-process core and a server unchanged; refusals raise the
same exceptions. The client opens a session on construction, renews its lease in the background,
and keeps each sequence's block table from the deltas the server sends (`block_table(seq_id)`).
Thread-safe: share one client between a scheduler's threads.

Failures and restarts (the README's "Restarts" and "The keeper"): while the server is unreachable, calls
raise `grpc.RpcError` UNAVAILABLE (a mutating call is retried with its request id, a step re-sent on a new
stream). After a restart without a keeper, or a crash, every call on the old session raises
`ServerRestarted`; after the lease ran out, `UnknownSession` (its base class): `reopen()` recovers from both.
An upgrade that keeps the cache (a keeper holds the pools) refuses calls `ServerRestarting` (UNAVAILABLE)
until the next server has adopted the snapshot, with the session, its sequences and pins, the same memory.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import grpc

import radixkv.client.session.messages as m
import radixkv.client.session.retries as retries
import radixkv.client.session.step_messages as sm
from radixkv.client.fleet.events import EventStream
from radixkv.client.fleet.verify import VerifyResult, check_contract, verify_result
from radixkv.client.session.channels import channel_settings
from radixkv.client.session.lease import LeaseKeeper
from radixkv.client.session.match_explanation import MatchExplanation
from radixkv.client.session.step_stream import SessionSteps, StepFuture
from radixkv.client.worker.block_checksums import BlockChecksums
from radixkv.client.worker.block_tables import BlockTables
from radixkv.client.worker.pool_info import PoolInfo
from radixkv.errors import UnknownSession
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, AppendResult, OpenResult
from radixkv.sequences.step import Step, StepResult
from radixkv.stats import Stats
from radixkv.tree.block_hash import HashContract
from radixkv.tree.eviction import NO_RETENTION, Retention
from radixkv.tree.radix_tree import TokenIds
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

Response = TypeVar("Response")


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
        block_size: the block size this caller hashes prompts with (a router's, a scheduler's); when
            given, the pool's hash contract is checked on connect: `HashContractMismatch` if it differs.
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
        block_size: int | None = None,
    ) -> None:
        credentials, options = channel_settings(max_message_bytes, tls_root_cert, tls_server_name)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout
        self.pool = pool
        self._tables = BlockTables()
        self._steps = SessionSteps(self._stub, self._metadata, functools.partial(sm.settle, tables=self._tables))
        self._request_ids = itertools.count(1)
        self._requested_ttl = session_ttl
        self.address = address
        try:
            self._open_session()
        except BaseException:
            self._channel.close()
            raise
        if block_size is not None:
            try:
                check_contract(address, HashContract(block_size=block_size), self.verify().hash_contract)
            except BaseException:
                self.close()  # ends the session it opened: a refused client holds nothing
                raise

    def _open_session(self) -> None:
        request = pb.OpenSessionRequest(ttl_seconds=self._requested_ttl, pool=self.pool)
        session = self._call(self._stub.OpenSession, request)
        self.session_id: str = session.session_id
        self.session_ttl: float = session.ttl_seconds
        self._lease = LeaseKeeper(self.keep_alive, self.session_ttl / 3)
        self._lease.start()

    def _call(self, method: Callable[..., Response], request: Any) -> Response:
        return retries.call(method, request, self._metadata, self._timeout)

    def _apply(self, method: Callable[..., Response], request: Any) -> Response:
        """A mutating call, with a fresh request id: retried with it (`retries.apply`), so it applies once."""
        request.request_id = next(self._request_ids)
        return retries.apply(method, request, self._metadata, self._timeout)

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
        self._steps.close()
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
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise  # the server is gone, and its sessions with it; anything else is news
        finally:
            self._steps.close()
            self._tables.clear()
            self._channel.close()

    def __enter__(self) -> RadixKVClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- sequences --------------------------------------------------------------------------------

    @overload
    def open(
        self,
        token_ids: TokenIds,
        namespace: str = ...,
        *,
        max_new_tokens: int = ...,
        priority: int = ...,
        explain: Literal[False] = False,
    ) -> OpenResult: ...
    @overload
    def open(
        self,
        token_ids: TokenIds,
        namespace: str = ...,
        *,
        max_new_tokens: int = ...,
        priority: int = ...,
        explain: Literal[True],
    ) -> tuple[OpenResult, MatchExplanation]: ...

    def open(
        self,
        token_ids: TokenIds,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        max_new_tokens: int = 0,
        priority: int = 0,
        explain: bool = False,
    ) -> OpenResult | tuple[OpenResult, MatchExplanation]:
        """Start a sequence, reusing the longest cached prefix; see `KVCache.open` (`max_new_tokens`: admission
        by token budget, `NotAdmitted` or `TokenBudget` when refused).

        With `explain`, also why the cached prefix ends where it does (LAST_TOKEN for a fully cached prompt).
        """
        if not explain:
            return self.open_many([(token_ids, namespace)], max_new_tokens=[max_new_tokens], priorities=[priority])[0]
        request = m.open_request(self.pool, self.session_id, [(token_ids, namespace)], [max_new_tokens], [priority])
        request.explain = True
        response = self._apply(self._stub.OpenSequences, request)
        results = m.open_results(response)
        self._tables.opened(results)
        return results[0], MatchExplanation.from_response(response.sequences[0])

    def open_many(
        self,
        prompts: Sequence[tuple[TokenIds, str]],
        *,
        max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[OpenResult]:
        """Open several sequences, all or none; `max_new_tokens[i]`, `priorities[i]` per prompt (None: all 0)."""
        request = m.open_request(self.pool, self.session_id, prompts, max_new_tokens, priorities)
        results = m.open_results(self._apply(self._stub.OpenSequences, request))
        self._tables.opened(results)
        return results

    def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        """Reserve slots for new tokens; see `KVCache.append`."""
        return self.append_many([(seq_id, token_ids)])[0]

    def append_many(self, items: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        """Append to several sequences, all or none (one decode step)."""
        return self.append_batch(*m.append_items(items)).results()

    def append_batch(self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds) -> AppendBatch:
        """One decode step in columns, as the wire carries it; see `KVCache.append_batch`."""
        request = m.append_request(self.pool, self.session_id, seq_ids, num_token_ids, token_ids)
        batch = m.append_result(seq_ids, num_token_ids, self._apply(self._stub.AppendTokens, request))
        self._tables.appended(batch)
        return batch

    def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        """New sequences sharing every block of `seq_id`; returns their ids."""
        request = m.fork_request(self.pool, self.session_id, seq_id, num_children)
        children = list(self._apply(self._stub.ForkSequence, request).child_seq_ids)
        self._tables.forked(seq_id, children)
        return children

    def cache(self, seq_id: int) -> int:
        """Insert the sequence's full blocks into the prefix tree now; returns its tokens cached."""
        request = m.cache_request(self.pool, self.session_id, seq_id)
        return self._apply(self._stub.CacheSequence, request).num_cached_tokens

    def release(self, seq_id: int, cache: bool = True) -> None:
        """End a sequence; with `cache`, its full blocks stay cached for later prompts."""
        self.release_many([seq_id], cache)

    def release_many(self, seq_ids: Iterable[int], cache: bool = True) -> None:
        """End several sequences, all or none."""
        ids = list(seq_ids)
        self._apply(self._stub.ReleaseSequences, m.release_request(self.pool, self.session_id, ids, cache))
        self._tables.released(ids)

    def preempt(self, seq_ids: Sequence[int], mode: str) -> PreemptResult:
        """Take the device blocks of sequences back, all or none; see `KVCache.preempt`. Apply the result's
        `offloads` (swap) before any freed block is written again."""
        ids = list(seq_ids)
        response = self._apply(self._stub.Preempt, m.preempt_request(self.pool, self.session_id, ids, mode))
        self._tables.preempted(ids)
        return m.preempt_result(ids, mode, response)

    def resume(self, seq_id: int) -> ResumeResult:
        """Bring a preempted sequence back under its id; compute K/V for the result's slots (see `KVCache.resume`)."""
        result = m.resume_result(self._apply(self._stub.Resume, m.resume_request(self.pool, self.session_id, seq_id)))
        self._tables.opened([result])
        return result

    def victims(self, num_blocks: int) -> list[int]:
        """This session's sequences to preempt to give `num_blocks` back, in order; changes nothing."""
        request = m.victims_request(self.pool, self.session_id, num_blocks)
        return list(self._call(self._stub.Victims, request).seq_ids)

    def step(self, step: Step, *, request_id: int | None = None) -> StepResult:
        """One scheduler step in one round trip on the session's stream: all of it, or none (see `Step`).

        A step whose stream broke (UNAVAILABLE) is re-sent on a new stream with the same request id
        (sent at most 3 times, as a unary call), which the server answers without applying it twice.
        `request_id`: by default the next of this session's own.

        Raises:
            RadixKVError: the exception the unary call of the refused item would raise; nothing was applied.
        """
        return self.submit(step, request_id=request_id).result()

    def submit(self, step: Step, *, request_id: int | None = None) -> StepFuture:
        """Queue a step without waiting for it: several may be in flight on the stream, applied and answered
        in the order submitted. `result()` waits for one; steps queued while the stream writes leave together,
        in one message (client/session/step_stream.py). At most `MAX_IN_FLIGHT` steps are unanswered: a submit past
        it first reads the oldest's answers.

        A step submitted before an earlier one's result arrived cannot name what that one opens or
        forks; it sees everything else the earlier steps did. Block tables follow each result in order.
        """
        request = sm.step_request(
            self.pool, self.session_id, next(self._request_ids) if request_id is None else request_id, step
        )
        pending = StepFuture(step, request)
        self._steps.submit(pending)
        return pending

    # -- the computed watermark and scheduling queries ---------------------------------------------

    def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """The K/V of the first `num_tokens[i]` tokens of `seq_ids[i]` is written; see `KVCache.commit`.

        Call it after the worker has written a step, before `cache`, `fork` or `release(cache=True)`
        of a sequence whose last tokens it wrote: only full blocks below the watermark are cached.
        """
        request = m.commit_request(self.pool, self.session_id, list(seq_ids), list(num_tokens))
        self._call(self._stub.CommitTokens, request)

    def describe_sequences(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(num_tokens, num_computed_tokens) of each sequence, in one call."""
        request = m.seq_ids_request(pb.DescribeSequencesRequest, self.pool, self.session_id, list(seq_ids))
        return m.described(self._call(self._stub.DescribeSequences, request))

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence holds."""
        return self.describe_sequences([seq_id])[0][0]

    def num_computed_tokens(self, seq_id: int) -> int:
        """The sequence's computed watermark: leading tokens whose K/V is written."""
        return self.describe_sequences([seq_id])[0][1]

    def num_available_blocks(self) -> int:
        """Blocks an allocation could take now: free, or cached and evictable."""
        request = pb.StatsRequest(pool=self.pool, session_id=self.session_id)
        return self._call(self._stub.Stats, request).num_available_blocks

    def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Would `append_batch(seq_ids, num_tokens, ...)` fit the pool now? Changes nothing."""
        request = m.can_append_request(self.pool, self.session_id, list(seq_ids), list(num_tokens))
        return self._call(self._stub.CanAppend, request).can_append

    def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        """How many blocks releasing `seq_ids` together would make available (for choosing whom to preempt)."""
        request = m.seq_ids_request(pb.FreeableBlocksRequest, self.pool, self.session_id, list(seq_ids))
        return self._call(self._stub.FreeableBlocks, request).num_freeable_blocks

    @property
    def checksums(self) -> BlockChecksums:
        """The writers' K/V digests of this session's sequences' blocks (`radixkv.client.worker.block_checksums`)."""
        return BlockChecksums(self._call, self._stub, pool=self.pool, session_id=self.session_id)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table as the server's deltas built it here (no RPC)."""
        return self._tables.get(seq_id)

    # -- prefixes ---------------------------------------------------------------------------------

    @overload
    def match(self, token_ids: TokenIds, namespace: str = ..., *, explain: Literal[False] = False) -> int: ...
    @overload
    def match(self, token_ids: TokenIds, namespace: str = ..., *, explain: Literal[True]) -> MatchExplanation: ...

    def match(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, *, explain: bool = False
    ) -> int | MatchExplanation:
        """How many leading tokens are cached; changes nothing. With `explain`, also why the prefix ends there."""
        if not explain:
            request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace)
            return self._call(self._stub.Match, request).num_cached_tokens
        request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace, explain=True)
        return MatchExplanation.from_response(self._call(self._stub.Match, request))

    def match_tiers(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> tuple[int, int]:
        """(device tokens, host tokens): the leading tokens cached on the device, then how many more the pool's
        host tier holds (an open would load those back rather than compute them). Changes nothing."""
        request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace)
        response = self._call(self._stub.Match, request)
        return response.num_cached_tokens, response.num_host_cached_tokens

    def match_loadable(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Leading tokens an open would hold: cached on the device, then loaded back from the host tier and from the
        disk tier (one Match call; the disk's count assumes its read is worth it). Changes nothing."""
        request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace)
        response = self._call(self._stub.Match, request)
        return response.num_cached_tokens + response.num_host_cached_tokens + response.num_disk_cached_tokens

    def pin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Keep the cached prefix resident until `unpin` or this session's end; returns tokens pinned."""
        request = m.prefix_request(pb.PinRequest, self.pool, self.session_id, token_ids, namespace)
        return self._apply(self._stub.Pin, request).num_pinned_tokens

    def unpin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> None:
        request = m.prefix_request(pb.UnpinRequest, self.pool, self.session_id, token_ids, namespace)
        self._apply(self._stub.Unpin, request)

    def retain(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, retention: Retention = NO_RETENTION
    ) -> int:
        """A soft retention hint on the cached prefix (TTL, priority, end of session; see `KVCache.retain`)."""
        request = m.retain_request(self.pool, self.session_id, token_ids, namespace, retention)
        return self._apply(self._stub.Retain, request).num_retained_tokens

    # -- pool -------------------------------------------------------------------------------------

    def stats(self) -> Stats:
        return m.stats_result(self._call(self._stub.Stats, pb.StatsRequest(pool=self.pool, session_id=self.session_id)))

    def get_pool(self) -> PoolInfo:
        """The pool's layout and the handle a co-located worker maps it with (see `PoolView`)."""
        return m.pool_info(
            self._call(self._stub.GetPool, pb.GetPoolRequest(pool=self.pool, session_id=self.session_id))
        )

    def verify(self) -> VerifyResult:
        """The pool's hash contract and the digest of each of your namespaces' cached blocks (see `PrefixIndex`)."""
        return verify_result(
            self._call(self._stub.Verify, pb.VerifyRequest(pool=self.pool, session_id=self.session_id))
        )

    def watch_events(self, namespaces: Sequence[str] = (), *, include_snapshot: bool = False) -> EventStream:
        """Stream blocks stored into and removed from the prefix tree (all your namespaces when none named)."""
        request = pb.WatchEventsRequest(
            pool=self.pool, session_id=self.session_id, namespaces=list(namespaces), include_snapshot=include_snapshot
        )
        return EventStream(self._stub.WatchEvents(request, metadata=self._metadata))
