"""`AsyncRadixKVClient`: `RadixKVClient` for asyncio orchestrators, on `grpc.aio`.

The same methods (awaited), the same records and the same exceptions as the blocking client, plus
`step(...)` on the session's stream. It runs inside the caller's event loop: no thread of its own
(the lease is renewed by a task), so a scheduler's coroutines await it like any other I/O.

    async with AsyncRadixKVClient("127.0.0.1:50051") as client:
        opened = await client.open(prompt_ids)
        result = await client.step(Step(append=Append([opened.seq_id], [1], [next_token])))
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import grpc
import grpc.aio

import radixkv.client.session.messages as m
import radixkv.client.session.retries as retries
import radixkv.client.session.step_messages as sm
from radixkv.client.errors import error_from_rpc
from radixkv.client.fleet.events import KVEvent, event_batch
from radixkv.client.session.aio_stream import AsyncPending, AsyncSessionSteps
from radixkv.client.session.channels import channel_settings
from radixkv.client.session.match_explanation import MatchExplanation
from radixkv.client.worker.block_tables import BlockTables
from radixkv.client.worker.pool_info import PoolInfo
from radixkv.errors import RadixKVError, UnknownSession
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.pressure.preemption import PreemptResult, ResumeResult
from radixkv.sequences.results import AppendBatch, AppendResult, OpenResult
from radixkv.sequences.step import Step, StepResult
from radixkv.stats import Stats
from radixkv.tree.eviction import NO_RETENTION, Retention
from radixkv.tree.radix_tree import TokenIds
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

log = logging.getLogger(__name__)
Response = TypeVar("Response")


class AsyncRadixKVClient:
    """A session on one radixkv server, bound to one pool; `async with` it, or `await connect()` then `close()`.

    Arguments as `RadixKVClient`'s.
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
        credentials, options = channel_settings(max_message_bytes, tls_root_cert, tls_server_name)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout
        self.pool = pool
        self._requested_ttl = session_ttl
        self._tables = BlockTables()
        self._steps = AsyncSessionSteps(self._stub, self._metadata, functools.partial(sm.settle, tables=self._tables))
        self._request_ids = itertools.count(1)
        self._lease: asyncio.Task[None] | None = None
        self.session_id = ""
        self.session_ttl = 0.0

    async def connect(self) -> AsyncRadixKVClient:
        """Open the session and start renewing its lease; returns self."""
        try:
            await self._open_session()
        except BaseException:
            await self._channel.close()
            raise
        return self

    async def _open_session(self) -> None:
        session = await self._call(self._stub.OpenSession, pb.OpenSessionRequest(ttl_seconds=self._requested_ttl))
        self.session_id = session.session_id
        self.session_ttl = session.ttl_seconds
        self._lease = asyncio.get_running_loop().create_task(self._renew_forever(self.session_ttl / 3))

    async def _call(self, method: Callable[..., Awaitable[Response]], request: Any) -> Response:
        return await retries.call_async(method, request, self._metadata, self._timeout)

    async def _apply(self, method: Callable[..., Awaitable[Response]], request: Any) -> Response:
        """A mutating call with a request id, retried as `RadixKVClient._apply` retries it."""
        request.request_id = next(self._request_ids)
        return await retries.apply_async(method, request, self._metadata, self._timeout)

    # -- session ----------------------------------------------------------------------------------

    async def keep_alive(self) -> float:
        """Renew the lease now (a task does this on its own); returns its ttl."""
        return (await self._call(self._stub.KeepAlive, pb.KeepAliveRequest(session_id=self.session_id))).ttl_seconds

    async def _renew_forever(self, interval: float) -> None:
        """As `LeaseKeeper`: retry transient failures, stop once the session is gone."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.keep_alive()
            except UnknownSession as e:
                log.warning("session lease lost", extra={"reason": e.reason})
                return
            except (RadixKVError, grpc.RpcError) as e:
                log.warning("lease renewal failed; retrying", extra={"error": repr(e)})

    async def _stop_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease
            self._lease = None

    async def reopen(self) -> None:
        """Replace the session with a new one (after `ServerRestarted` or `UnknownSession`).

        See `RadixKVClient.reopen`."""
        await self._stop_lease()
        with contextlib.suppress(UnknownSession):
            await self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=self.session_id))
        self._steps.close()
        self._tables.clear()
        await self._open_session()

    async def close(self) -> None:
        """Stop renewing, end the session (the server releases any sequence still open), close the channel."""
        await self._stop_lease()
        try:
            await self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=self.session_id))
        except UnknownSession:
            pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        finally:
            self._steps.close()
            self._tables.clear()
            await self._channel.close()

    async def __aenter__(self) -> AsyncRadixKVClient:
        return await self.connect()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- sequences --------------------------------------------------------------------------------

    async def open(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, *, max_new_tokens: int = 0, priority: int = 0
    ) -> OpenResult:
        opened = await self.open_many([(token_ids, namespace)], max_new_tokens=[max_new_tokens], priorities=[priority])
        return opened[0]

    async def open_many(
        self,
        prompts: Sequence[tuple[TokenIds, str]],
        *,
        max_new_tokens: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[OpenResult]:
        request = m.open_request(self.pool, self.session_id, prompts, max_new_tokens, priorities)
        results = m.open_results(await self._apply(self._stub.OpenSequences, request))
        self._tables.opened(results)
        return results

    async def append(self, seq_id: int, token_ids: TokenIds) -> AppendResult:
        return (await self.append_many([(seq_id, token_ids)]))[0]

    async def append_many(self, items: Sequence[tuple[int, TokenIds]]) -> list[AppendResult]:
        return (await self.append_batch(*m.append_items(items))).results()

    async def append_batch(
        self, seq_ids: Sequence[int], num_token_ids: Sequence[int], token_ids: TokenIds
    ) -> AppendBatch:
        request = m.append_request(self.pool, self.session_id, seq_ids, num_token_ids, token_ids)
        batch = m.append_result(seq_ids, num_token_ids, await self._apply(self._stub.AppendTokens, request))
        self._tables.appended(batch)
        return batch

    async def fork(self, seq_id: int, num_children: int = 1) -> list[int]:
        request = m.fork_request(self.pool, self.session_id, seq_id, num_children)
        children = list((await self._apply(self._stub.ForkSequence, request)).child_seq_ids)
        self._tables.forked(seq_id, children)
        return children

    async def cache(self, seq_id: int) -> int:
        request = m.cache_request(self.pool, self.session_id, seq_id)
        return (await self._apply(self._stub.CacheSequence, request)).num_cached_tokens

    async def release(self, seq_id: int, cache: bool = True) -> None:
        await self.release_many([seq_id], cache)

    async def release_many(self, seq_ids: Iterable[int], cache: bool = True) -> None:
        ids = list(seq_ids)
        await self._apply(self._stub.ReleaseSequences, m.release_request(self.pool, self.session_id, ids, cache))
        self._tables.released(ids)

    async def preempt(self, seq_ids: Sequence[int], mode: str) -> PreemptResult:
        """See `RadixKVClient.preempt`."""
        ids = list(seq_ids)
        response = await self._apply(self._stub.Preempt, m.preempt_request(self.pool, self.session_id, ids, mode))
        self._tables.preempted(ids)
        return m.preempt_result(ids, mode, response)

    async def resume(self, seq_id: int) -> ResumeResult:
        """See `RadixKVClient.resume`."""
        request = m.resume_request(self.pool, self.session_id, seq_id)
        result = m.resume_result(await self._apply(self._stub.Resume, request))
        self._tables.opened([result])
        return result

    async def victims(self, num_blocks: int) -> list[int]:
        """See `RadixKVClient.victims`."""
        request = m.victims_request(self.pool, self.session_id, num_blocks)
        return list((await self._call(self._stub.Victims, request)).seq_ids)

    async def step(self, step: Step, *, request_id: int | None = None) -> StepResult:
        """One scheduler step in one round trip on the session's stream; see `RadixKVClient.step`.

        Coroutines may await steps concurrently: they are pipelined on the one stream (as
        `RadixKVClient.submit`), applied and answered in the order `step` was called.
        """
        request = sm.step_request(
            self.pool, self.session_id, next(self._request_ids) if request_id is None else request_id, step
        )
        return await self._steps.step(AsyncPending(step, request))

    # -- the computed watermark and scheduling queries (see `RadixKVClient`) -------------------------

    async def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        request = m.commit_request(self.pool, self.session_id, list(seq_ids), list(num_tokens))
        await self._call(self._stub.CommitTokens, request)

    async def describe_sequences(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        request = m.seq_ids_request(pb.DescribeSequencesRequest, self.pool, self.session_id, list(seq_ids))
        return m.described(await self._call(self._stub.DescribeSequences, request))

    async def num_tokens(self, seq_id: int) -> int:
        return (await self.describe_sequences([seq_id]))[0][0]

    async def num_computed_tokens(self, seq_id: int) -> int:
        return (await self.describe_sequences([seq_id]))[0][1]

    async def num_available_blocks(self) -> int:
        request = pb.StatsRequest(pool=self.pool, session_id=self.session_id)
        return (await self._call(self._stub.Stats, request)).num_available_blocks

    async def can_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        request = m.can_append_request(self.pool, self.session_id, list(seq_ids), list(num_tokens))
        return (await self._call(self._stub.CanAppend, request)).can_append

    async def freeable_blocks(self, seq_ids: Sequence[int]) -> int:
        request = m.seq_ids_request(pb.FreeableBlocksRequest, self.pool, self.session_id, list(seq_ids))
        return (await self._call(self._stub.FreeableBlocks, request)).num_freeable_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table as the server's deltas built it here (no RPC)."""
        return self._tables.get(seq_id)

    # -- prefixes ---------------------------------------------------------------------------------

    @overload
    async def match(self, token_ids: TokenIds, namespace: str = ..., *, explain: Literal[False] = False) -> int: ...
    @overload
    async def match(self, token_ids: TokenIds, namespace: str = ..., *, explain: Literal[True]) -> MatchExplanation: ...

    async def match(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, *, explain: bool = False
    ) -> int | MatchExplanation:
        request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace, explain=explain)
        response = await self._call(self._stub.Match, request)
        return MatchExplanation.from_response(response) if explain else response.num_cached_tokens

    async def match_tiers(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> tuple[int, int]:
        """(device tokens, host tokens), as `RadixKVClient.match_tiers`."""
        request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace)
        response = await self._call(self._stub.Match, request)
        return response.num_cached_tokens, response.num_host_cached_tokens

    async def match_loadable(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """As `RadixKVClient.match_loadable`."""
        request = m.prefix_request(pb.MatchRequest, self.pool, self.session_id, token_ids, namespace)
        response = await self._call(self._stub.Match, request)
        return response.num_cached_tokens + response.num_host_cached_tokens + response.num_disk_cached_tokens

    async def pin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        request = m.prefix_request(pb.PinRequest, self.pool, self.session_id, token_ids, namespace)
        return (await self._apply(self._stub.Pin, request)).num_pinned_tokens

    async def unpin(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> None:
        request = m.prefix_request(pb.UnpinRequest, self.pool, self.session_id, token_ids, namespace)
        await self._apply(self._stub.Unpin, request)

    async def retain(
        self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE, retention: Retention = NO_RETENTION
    ) -> int:
        """As `RadixKVClient.retain`."""
        request = m.retain_request(self.pool, self.session_id, token_ids, namespace, retention)
        return (await self._apply(self._stub.Retain, request)).num_retained_tokens

    # -- pool -------------------------------------------------------------------------------------

    async def stats(self) -> Stats:
        request = pb.StatsRequest(pool=self.pool, session_id=self.session_id)
        return m.stats_result(await self._call(self._stub.Stats, request))

    async def get_pool(self) -> PoolInfo:
        request = pb.GetPoolRequest(pool=self.pool, session_id=self.session_id)
        return m.pool_info(await self._call(self._stub.GetPool, request))

    async def watch_events(
        self, namespaces: Sequence[str] = (), *, include_snapshot: bool = False
    ) -> AsyncIterator[KVEvent]:
        """Blocks stored into and removed from the prefix tree, until the caller stops iterating."""
        request = pb.WatchEventsRequest(
            pool=self.pool, session_id=self.session_id, namespaces=list(namespaces), include_snapshot=include_snapshot
        )
        call = self._stub.WatchEvents(request, metadata=self._metadata)
        try:
            async for response in call:
                for event in event_batch(response).events:
                    yield event
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise error_from_rpc(e) from e
        finally:
            call.cancel()
