"""The decode-step part of bench_service.py: one 256-sequence decode step every way, measured in turns.

Each way (in-process, unary AppendTokens, the Session stream from the blocking and the asyncio
client, the bare health round trip of each client, and each client kind's round trip of the same
bytes over bare gRPC, `bare_grpc.py`) runs a few steps, then the next way does, round after round,
so a slow spell of this shared machine falls on every way alike. Two cadences:
  - back to back: the next step starts as soon as the last returned (what a hot loop shows);
  - every 10 ms: an idle gap before each step, as a serving loop calls it between forward passes.
On these 2 vCPUs a step after an idle gap costs 2-4x its back-to-back time, in-process as much as
on the server (caches and the idle vCPU go cold), so each target is checked at both cadences,
always against the in-process step and the health round trip of the same cadence.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from bare_grpc import AsyncFloor, BareServer, BlockingFloor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.kv_cache import KVCache
from radixkv.sequences.step import Append, Step

BATCH = 256
CADENCES = {"back_to_back": 0.0, "every_10ms": 0.010}
SyncWay = Callable[[int], object]
AsyncWay = Callable[[int], Awaitable[object]]


def prompts() -> list[tuple[list[int], str]]:
    return [(list(range(1000 * i, 1000 * i + 100)), "bench") for i in range(BATCH)]


def inputs(i: int) -> tuple[list[int], np.ndarray]:
    """One token for each sequence: a decode step."""
    return [1] * BATCH, np.full(BATCH, i % 1000, np.int32)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(samples: list[float], server_cpu: float | None) -> dict[str, float]:
    out = {"p50_ms": 1e3 * float(np.percentile(samples, 50)), "p99_ms": 1e3 * float(np.percentile(samples, 99))}
    if server_cpu is not None:
        out["server_cpu_ms"] = 1e3 * server_cpu / len(samples)
    return out


def measure(address: str, server_pid: int, num_blocks: int, block_size: int, quick: bool) -> dict[str, Any]:
    """{cadence: {way: p50/p99 ms, and the server's CPU per step where the way reaches the server}}."""
    bare = BareServer()  # the transport's floor, in a process of its own
    try:
        return _measure(address, server_pid, num_blocks, block_size, quick, bare.address)
    finally:
        bare.stop()


def _measure(
    address: str, server_pid: int, num_blocks: int, block_size: int, quick: bool, bare_address: str
) -> dict[str, Any]:
    from radixkv.client import RadixKVClient
    from radixkv.client.aio import AsyncRadixKVClient

    runner = asyncio.Runner()  # one loop for every asyncio turn; closing it settles the client's tasks
    floor = BlockingFloor(bare_address)
    cache = KVCache(num_blocks, block_size)
    local_ids = [r.seq_id for r in cache.open_many(prompts())]
    health_request = health_pb2.HealthCheckRequest()
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)

    async def open_async() -> tuple[Any, Any, list[int], AsyncFloor]:
        client = AsyncRadixKVClient(address)
        await client.__aenter__()
        aio_channel = grpc.aio.insecure_channel(address)
        ids = [r.seq_id for r in (await client.step(Step(opens=prompts()))).opened]
        return client, aio_channel, ids, AsyncFloor(bare_address)

    with RadixKVClient(address) as client:
        unary_ids = [r.seq_id for r in client.open_many(prompts())]
        stream_ids = [r.seq_id for r in client.step(Step(opens=prompts())).opened]
        aio_client, aio_channel, aio_ids, aio_floor = runner.run(open_async())
        aio_health = health_pb2_grpc.HealthStub(aio_channel)
        sync_ways: dict[str, SyncWay] = {
            "in_process": lambda i: cache.append_batch(local_ids, *inputs(i)).slots,  # the slots the RPCs send
            "unary": lambda i: client.append_batch(unary_ids, *inputs(i)),
            "stream": lambda i: client.step(Step(append=Append(stream_ids, *inputs(i)))),
            "health": lambda i: health.Check(health_request),
            "floor": lambda i: floor.stream("decode"),
        }
        async_ways: dict[str, AsyncWay] = {
            "stream_asyncio": lambda i: aio_client.step(Step(append=Append(aio_ids, *inputs(i)))),
            "health_asyncio": lambda i: aio_health.Check(health_request),
            "floor_asyncio": lambda i: aio_floor.stream("decode"),
        }
        reaches_server = {"unary", "stream", "stream_asyncio"}
        try:
            results = {}
            for cadence, gap in CADENCES.items():
                rounds, per = (6, 8) if quick else (20, 15)
                if gap:
                    rounds, per = (3, 5) if quick else (8, 8)
                samples, cpu = _interleaved(runner, sync_ways, async_ways, rounds, per, gap, server_pid)
                results[cadence] = {
                    way: summary(s, cpu[way] if way in reaches_server else None) for way, s in samples.items()
                }
        finally:
            runner.run(_close_async(aio_client, aio_channel, aio_ids, aio_floor))
            runner.close()
            floor.close()
            client.release_many(unary_ids + stream_ids, cache=False)
            channel.close()
    return results


async def _close_async(client: Any, channel: Any, ids: list[int], floor: AsyncFloor) -> None:
    await client.step(Step(releases=[(ids, False)]))
    await client.__aexit__(None, None, None)
    await channel.close()
    await floor.close()


def _interleaved(
    runner: asyncio.Runner,
    sync_ways: dict[str, SyncWay],
    async_ways: dict[str, AsyncWay],
    rounds: int,
    per: int,
    gap: float,
    server_pid: int,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """`per` steps of each way in turn, `rounds` times (alternating the order); `gap` idle before each step."""
    names = [*sync_ways, *async_ways]
    samples: dict[str, list[float]] = {name: [] for name in names}
    cpu = dict.fromkeys(names, 0.0)
    counter = 0

    def run_sync(step: SyncWay, out: list[float]) -> None:
        nonlocal counter
        for _ in range(per):
            if gap:
                time.sleep(gap)
            start = time.perf_counter()
            step(counter)
            out.append(time.perf_counter() - start)
            counter += 1

    async def run_async(step: AsyncWay, out: list[float]) -> None:
        nonlocal counter
        for _ in range(per):
            if gap:
                await asyncio.sleep(gap)
            start = time.perf_counter()
            await step(counter)
            out.append(time.perf_counter() - start)
            counter += 1

    async def warm(step: AsyncWay) -> None:
        for i in range(3):
            await step(-1 - i)

    for name in names:
        if name in sync_ways:
            for i in range(3):
                sync_ways[name](-1 - i)
        else:
            runner.run(warm(async_ways[name]))
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            before = cpu_seconds(server_pid)
            if name in sync_ways:
                run_sync(sync_ways[name], samples[name])
            else:
                runner.run(run_async(async_ways[name], samples[name]))
            cpu[name] += cpu_seconds(server_pid) - before
    return samples, cpu
