"""A KV-aware router over a fleet of radixkv instances: send each request where its prefix is cached.

Per instance, background threads keep three things current, so `route` makes no RPC:
- a `PrefixIndex` of the instance's cached block hashes, fed by its WatchEvents stream (a snapshot
  first; a gap resyncs from a new snapshot; a new epoch, after a restart, rebuilds it);
- its health, from the standard gRPC health service every `health_interval` seconds: an instance
  that fails a check (or whose stream breaks) leaves the candidates at once and its index is dropped;
- its load, in blocks held by running sequences, from `Stats` every `load_interval`, plus the blocks
  routed to it since that reading.

Before indexing an instance, the router reads its hash contract (`Verify`): an instance that hashes
blocks otherwise (another block size, scheme or version) is never mixed in; `route` and `wait_ready`
raise `HashContractMismatch` naming it, rather than routing on lookups that would all miss. Each
index checks itself against the digests in the stream; a divergence resyncs from a snapshot.

`route` hashes the request's full blocks once (vLLM's scheme, as the servers do) and picks the
healthy instance with the lowest Dynamo cost, `prefill_weight * uncached_blocks + load_blocks`.
With `Balance` (SGLang's thresholds) a fleet whose loads drift too far apart routes to the least
loaded instance instead, until it evens out.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType

import grpc

from radixkv.client.errors import HashContractMismatch
from radixkv.client.fleet.events import EventStream
from radixkv.client.fleet.prefix_index import PrefixIndex, Verdict
from radixkv.client.fleet.verify import check_contract, verify_result
from radixkv.errors import RadixKVError
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.tree.block_hash import HashContract, chain_hashes, wire_hash
from radixkv.tree.radix_tree import TokenIds
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

# grpc.health.v1 by hand, so the client needs no grpcio-health-checking: an empty
# HealthCheckRequest (service "" = the whole server) and the SERVING response (field 1 = 1).
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = b"\x08\x01"


class NoInstanceAvailable(RuntimeError):
    """Every instance of the fleet is unhealthy or not yet indexed (raised by the router, never on the wire)."""

    def __init__(self, num_instances: int) -> None:
        super().__init__(f"none of the {num_instances} instances is healthy and indexed")


@dataclasses.dataclass(frozen=True, slots=True)
class Balance:
    """SGLang's cache-aware router thresholds: the fleet is imbalanced when the most loaded instance
    carries more than `abs_threshold` blocks over the least and more than `rel_threshold` times it."""

    abs_threshold: int = 32
    rel_threshold: float = 1.5


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class InstanceStatus:
    endpoint: str
    healthy: bool
    epoch: int
    num_indexed_blocks: int
    load_blocks: int
    num_resyncs: int
    num_rebuilds: int
    num_divergences: int
    digest: int  # of the index: equal to the instance's `Verify` digest once the stream is caught up
    unhealthy_since: float | None  # time.monotonic() of the failed check, while unhealthy


class _Instance:
    """One endpoint: its channel, index, health and load; two daemon threads keep them current."""

    def __init__(self, endpoint: str, pool: str, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self.metadata = metadata
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.health = self.channel.unary_unary(_HEALTH_CHECK, lambda b: b, lambda b: b)
        self.index = PrefixIndex()
        self.healthy = False
        self.unhealthy_since: float | None = time.monotonic()
        self.stats_blocks = 0
        self.pending_blocks = 0  # routed here since the last Stats reading
        self.stream: EventStream | None = None
        self.contract_error: HashContractMismatch | None = None  # set while its contract differs from ours

    @property
    def candidate(self) -> bool:
        return self.healthy and self.index.ready and self.contract_error is None

    @property
    def load_blocks(self) -> int:
        return self.stats_blocks + self.pending_blocks

    def mark_unhealthy(self) -> None:
        if self.healthy:
            self.healthy = False
            self.unhealthy_since = time.monotonic()
        self.index.reset()
        stream = self.stream
        if stream is not None:
            stream.cancel()


class Router:
    """Routes token prompts across radixkv instances by cached prefix against load.

    Args:
        endpoints: "host:port" of each instance's gRPC server.
        pool: the pool whose cache each instance's index mirrors.
        block_size: the fleet's block size (hashes are per full block).
        prefill_weight: Dynamo's overlap weight: how many blocks of load one uncached block is worth.
        health_interval: seconds between health checks; a dead instance leaves within one interval.
        load_interval: seconds between Stats readings.
        balance: SGLang's balance thresholds; None: always by cost.
        token: bearer token, for servers with auth on.
        tenant: the token's tenant: with auth on, a server salts a tenant's namespace `chat` as
            `<tenant>/chat`, so the router must hash the same name to find anything.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        pool: str = "default",
        block_size: int = 16,
        prefill_weight: float = 1.0,
        health_interval: float = 1.0,
        load_interval: float = 0.25,
        balance: Balance | None = None,
        token: str | None = None,
        tenant: str = "",
        seed: int | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a router needs at least one endpoint")
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.block_size = block_size
        self.hash_contract = HashContract(block_size=block_size)
        self.namespace_prefix = f"{tenant}/" if tenant else ""
        self.prefill_weight = prefill_weight
        self.health_interval = health_interval
        self.load_interval = load_interval
        self.balance = balance
        self._instances = [_Instance(e, pool, metadata) for e in endpoints]
        self._by_endpoint = {i.endpoint: i for i in self._instances}
        self._rng = random.Random(seed)
        self._decision_seconds: deque[float] = deque(maxlen=100_000)
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=loop, args=(inst,), name=f"radixkv-router-{name}", daemon=True)
            for inst in self._instances
            for name, loop in (("watch", self._watch_loop), ("health", self._health_loop))
        ]
        for thread in self._threads:
            thread.start()

    # -- routing -----------------------------------------------------------------------------------

    def chain(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> list[int]:
        """The wire hashes of a prompt's full blocks, as every instance computes them."""
        scoped = self.namespace_prefix + (namespace or DEFAULT_NAMESPACE)
        return [wire_hash(h) for h in chain_hashes(list(token_ids), self.block_size, scoped)]

    def route(self, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> str:
        """The endpoint to serve this prompt: no RPC, only the local indexes.

        Raises:
            HashContractMismatch: an instance hashes blocks otherwise than this router.
            NoInstanceAvailable: no instance is healthy and indexed.
        """
        self._refuse_mixed_contracts()
        start = time.perf_counter()
        chain = self.chain(token_ids, namespace)
        candidates = [i for i in self._instances if i.candidate]
        if not candidates:
            raise NoInstanceAvailable(len(self._instances))
        num_blocks = -(-len(token_ids) // self.block_size)
        loads = [i.load_blocks for i in candidates]
        if self.balance is not None and _imbalanced(loads, self.balance):
            best = min(loads)
            chosen = self._rng.choice([i for i, load in zip(candidates, loads, strict=True) if load == best])
        else:
            costs = [
                self.prefill_weight * (len(chain) - i.index.num_cached_blocks(chain)) + load
                for i, load in zip(candidates, loads, strict=True)
            ]
            lowest = min(costs)
            chosen = self._rng.choice([i for i, cost in zip(candidates, costs, strict=True) if cost == lowest])
        chosen.pending_blocks += num_blocks
        self._decision_seconds.append(time.perf_counter() - start)
        return chosen.endpoint

    def num_cached_blocks(self, endpoint: str, token_ids: TokenIds, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many of the prompt's full blocks the router believes `endpoint` holds."""
        return self._by_endpoint[endpoint].index.num_cached_blocks(self.chain(token_ids, namespace))

    def index(self, endpoint: str) -> PrefixIndex:
        """The live index of `endpoint` (read-only use; its test hook `num_events_to_drop` aside)."""
        return self._by_endpoint[endpoint].index

    def decision_seconds(self) -> list[float]:
        """The time each `route` call took, most recent last."""
        return list(self._decision_seconds)

    def status(self) -> list[InstanceStatus]:
        return [
            InstanceStatus(
                endpoint=i.endpoint,
                healthy=i.healthy,
                epoch=i.index.epoch,
                num_indexed_blocks=len(i.index.hashes),
                load_blocks=i.load_blocks,
                num_resyncs=i.index.num_resyncs,
                num_rebuilds=i.index.num_rebuilds,
                num_divergences=i.index.num_divergences,
                digest=i.index.digest,
                unhealthy_since=i.unhealthy_since if not i.healthy else None,
            )
            for i in self._instances
        ]

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until every instance is healthy and indexed.

        Raises:
            HashContractMismatch: an instance hashes blocks otherwise than this router.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._refuse_mixed_contracts()
            if all(i.candidate for i in self._instances):
                return True
            time.sleep(0.01)
        return False

    def _refuse_mixed_contracts(self) -> None:
        for inst in self._instances:
            if inst.contract_error is not None:
                raise inst.contract_error

    # -- background --------------------------------------------------------------------------------

    def _watch_loop(self, inst: _Instance) -> None:
        """Keep `inst.index` current: a snapshot, then events; start over on a gap, a new epoch, or an error."""
        while not self._closed.is_set():
            if not inst.healthy:
                self._closed.wait(0.02)
                continue
            try:
                self._check_contract(inst)
            except HashContractMismatch as e:
                inst.contract_error = e
                self._closed.wait(self.health_interval)  # checked again: the instance may come back fixed
                continue
            except (RadixKVError, grpc.RpcError):
                self._closed.wait(0.05)
                continue
            inst.contract_error = None
            request = pb.WatchEventsRequest(pool=inst.pool, include_snapshot=True)
            stream = inst.stream = EventStream(inst.stub.WatchEvents(request, metadata=inst.metadata))
            try:
                for batch in stream.batches():
                    if inst.index.apply(batch) is not Verdict.APPLIED:
                        break  # reopen: the next stream starts with a snapshot
            except (RadixKVError, grpc.RpcError):
                pass  # the server went away or refused: the health loop decides, the next stream retries
            finally:
                stream.cancel()
                inst.stream = None
            if not self._closed.is_set():
                inst.index.reset()
                self._closed.wait(0.05)

    def _check_contract(self, inst: _Instance) -> None:
        """Before indexing `inst` (each time its stream opens): does it hash blocks as this router does?"""
        request = pb.VerifyRequest(pool=inst.pool)
        response = inst.stub.Verify(request, timeout=self.health_interval, metadata=inst.metadata)
        check_contract(inst.endpoint, self.hash_contract, verify_result(response).hash_contract)

    def _health_loop(self, inst: _Instance) -> None:
        next_load = 0.0
        while not self._closed.is_set():
            started = time.monotonic()
            try:
                serving = inst.health(b"", timeout=self.health_interval / 2, metadata=inst.metadata) == _SERVING
            except grpc.RpcError:
                serving = False
            if not serving:
                inst.mark_unhealthy()
            elif not inst.healthy:
                inst.healthy, inst.unhealthy_since = True, None
            if inst.healthy and started >= next_load:
                next_load = started + self.load_interval
                self._read_load(inst)
            self._closed.wait(max(0.0, min(self.health_interval, self.load_interval) - (time.monotonic() - started)))

    def _read_load(self, inst: _Instance) -> None:
        try:
            response = inst.stub.Stats(
                pb.StatsRequest(pool=inst.pool), timeout=self.health_interval / 2, metadata=inst.metadata
            )
        except grpc.RpcError:
            return
        inst.stats_blocks, inst.pending_blocks = int(response.stats.num_blocks_in_use), 0

    def close(self) -> None:
        self._closed.set()
        for inst in self._instances:
            if inst.stream is not None:
                inst.stream.cancel()
        for thread in self._threads:
            thread.join(timeout=5)
        for inst in self._instances:
            inst.channel.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _imbalanced(loads: list[int], balance: Balance) -> bool:
    high, low = max(loads), min(loads)
    return high - low > balance.abs_threshold and high > balance.rel_threshold * low
