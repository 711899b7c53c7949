"""What a scheduler step costs over gRPC, unary against the Session stream, against the in-process core.

Runs a real server process on 127.0.0.1 and measures, in one run:
  - a decode step: one token appended to each of 256 sequences, in-process (`KVCache.append_batch`),
    as a unary AppendTokens call, and as a step on the Session stream (blocking and asyncio clients);
    p50/p99 ms per step, and the server's CPU per step (its process CPU time over the steps);
  - the transport floor: one bare gRPC health check round trip (blocking and asyncio);
  - single open + release per second, one item per call or per step message, unary against the
    stream, with 1, 4 and 16 client processes, blocking and asyncio clients; on the stream once with
    one step in flight per client and once with PIPELINE open + release cycles in flight (steps
    queued together leave in one message, client/step_stream.py), each step still one item;
  - the wire encodings the stream uses: token ids and slots as packed bytes against repeated fields.
Prints a table (ratios within this run); `--out FILE.json` writes the numbers; `--quick` finishes in
well under a minute on 2 loaded cores (the targets below hold on the ratios, not the absolute times).

Targets (issue 14): stream step <= in-process step + one health round trip; stream open/release
with 4 clients, one item per step message, >= 3x the unary rate (checked on the pipelined run; the
run with one step in flight is printed beside it).

    python benchmarks/bench_service.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from radixkv.kv_cache import KVCache
from radixkv.server.process import ServerProcess
from radixkv.step import Append, Step

NUM_BLOCKS = 65536
BLOCK_SIZE = 16
POOL = f"default:num_layers=1,num_kv_heads=1,head_dim=8,block_size={BLOCK_SIZE},num_blocks={NUM_BLOCKS},dtype=float16"
BATCH = 256
PROMPT = list(range(10_000, 10_064))  # a 64-token shared prefix (4 blocks): opens hit it after the first
CLIENTS = (1, 4, 16)
MODES = ("sync", "asyncio")
PIPELINE = 8  # open + release cycles each client keeps in flight on its stream, in the pipelined phases
Phase = tuple[str, str, int]  # (transport, mode, cycles in flight per client)
PHASES: list[Phase] = [(t, m, w) for m in MODES for t, w in (("unary", 1), ("stream", 1), ("stream", PIPELINE))]


def phase_name(phase: Phase) -> str:
    transport, mode, window = phase
    return f"{transport}_{mode}" if window == 1 else f"{transport}_x{window}_{mode}"


def prompt(i: int) -> list[int]:
    return PROMPT + [i % 30_000, 7]


def start_server() -> ServerProcess:
    return ServerProcess(
        ["--pool", POOL, "--log-level", "warning", "--max-workers", "48", "--max-session-streams", "20",
         "--max-watch-streams", "2"],
    )  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": 1e3 * float(np.percentile(samples, 50)),
        "p99_ms": 1e3 * float(np.percentile(samples, 99)),
        "mean_ms": 1e3 * float(np.mean(samples)),
    }


# -- the decode step ----------------------------------------------------------------------------------


def prompts_for_decode() -> list[tuple[list[int], str]]:
    return [(list(range(1000 * i, 1000 * i + 100)), "bench") for i in range(BATCH)]


def decode_inputs(i: int) -> tuple[list[int], np.ndarray]:
    return [1] * BATCH, np.full(BATCH, i % 1000, np.int32)


def time_sync(step: Callable[[int], object], num_steps: int) -> list[float]:
    for i in range(5):
        step(-1 - i)
    samples = []
    for i in range(num_steps):
        start = time.perf_counter()
        step(i)
        samples.append(time.perf_counter() - start)
    return samples


async def time_async(step: Callable[[int], Awaitable[object]], num_steps: int) -> list[float]:
    for i in range(5):
        await step(-1 - i)
    samples = []
    for i in range(num_steps):
        start = time.perf_counter()
        await step(i)
        samples.append(time.perf_counter() - start)
    return samples


def decode_in_process(num_steps: int) -> dict[str, float]:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    seq_ids = [r.seq_id for r in cache.open_many(prompts_for_decode())]
    # .slots: the step's slot mapping, which the RPCs compute and send (the core computes it when read)
    return summary(time_sync(lambda i: cache.append_batch(seq_ids, *decode_inputs(i)).slots, num_steps))


def decode_over_grpc(address: str, server_pid: int, num_steps: int) -> dict[str, dict[str, float]]:
    from radixkv.client import RadixKVClient

    results = {}
    with RadixKVClient(address) as client:
        seq_ids = [r.seq_id for r in client.open_many(prompts_for_decode())]
        ways: dict[str, Callable[[int], object]] = {
            "unary": lambda i: client.append_batch(seq_ids, *decode_inputs(i)),
            "stream": lambda i: client.step(Step(append=Append(seq_ids, *decode_inputs(i)))),
        }
        for name, step in ways.items():
            cpu = cpu_seconds(server_pid)
            results[name] = summary(time_sync(step, num_steps))
            results[name]["server_cpu_ms"] = 1e3 * (cpu_seconds(server_pid) - cpu) / (num_steps + 5)
        client.release_many(seq_ids, cache=False)
    results["stream_asyncio"] = asyncio.run(decode_async(address, server_pid, num_steps))
    return results


async def decode_async(address: str, server_pid: int, num_steps: int) -> dict[str, float]:
    from radixkv.client.aio import AsyncRadixKVClient

    async with AsyncRadixKVClient(address) as client:
        seq_ids = [r.seq_id for r in (await client.step(Step(opens=prompts_for_decode()))).opened]
        cpu = cpu_seconds(server_pid)
        result = summary(
            await time_async(lambda i: client.step(Step(append=Append(seq_ids, *decode_inputs(i)))), num_steps)
        )
        result["server_cpu_ms"] = 1e3 * (cpu_seconds(server_pid) - cpu) / (num_steps + 5)
        await client.step(Step(releases=[(seq_ids, False)]))
    return result


# -- the transport floor -------------------------------------------------------------------------------


def health_round_trip(address: str, num_calls: int) -> dict[str, dict[str, float]]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        sync = summary(time_sync(lambda i: stub.Check(request), num_calls))

    async def run() -> dict[str, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return summary(await time_async(lambda i: stub.Check(request), num_calls))

    return {"sync": sync, "asyncio": asyncio.run(run())}


# -- open + release, many clients ----------------------------------------------------------------------


def _sync_cycles(c: Any, transport: str, window: int, pid: int, seconds: float, ready: Any, go: Any) -> int:
    """Open + release cycles for `seconds` after `go`, `window` of them in flight (the stream pipelines them)."""
    if transport == "unary":
        for n in range(3):
            c.release(c.open(prompt(pid + n)).seq_id)
        ready()
        go.wait()
        n, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            c.release(c.open(prompt(pid + n)).seq_id)
            n += 1
        return n

    def opening(k: int) -> tuple[bool, Any]:
        return True, c.submit(Step(opens=[(prompt(pid + k), "default")]))

    for k in range(3):
        c.step(Step(releases=[([c.step(Step(opens=[(prompt(pid + k), "default")])).opened[0].seq_id], True)]))
    ready()
    go.wait()
    in_flight = collections.deque(opening(k) for k in range(window))
    n, started, deadline = 0, window, time.perf_counter() + seconds
    while in_flight:
        is_open, future = in_flight.popleft()
        result = future.result()
        if is_open:
            in_flight.append((False, c.submit(Step(releases=[([result.opened[0].seq_id], True)]))))
            continue
        if time.perf_counter() < deadline:
            n += 1
            in_flight.append(opening(started))
            started += 1
    return n


async def _async_cycles(c: Any, transport: str, window: int, pid: int, seconds: float, ready: Any, go: Any) -> int:
    """As `_sync_cycles`: `window` coroutines, each opening and releasing in turn (their steps pipelined)."""

    async def cycle(k: int) -> None:
        if transport == "unary":
            await c.release((await c.open(prompt(pid + k))).seq_id)
        else:
            opened = (await c.step(Step(opens=[(prompt(pid + k), "default")]))).opened[0]
            await c.step(Step(releases=[([opened.seq_id], True)]))

    for k in range(3):
        await cycle(k)
    ready()
    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    deadline = time.perf_counter() + seconds

    async def chain(first: int) -> int:
        n = 0
        while time.perf_counter() < deadline:
            await cycle(first + n * window)
            n += 1
        return n

    return sum(await asyncio.gather(*(chain(k) for k in range(window))))


def _open_release_worker(address: str, phases: list[Phase], seconds: float, ready: Any, go: Any, out: Any) -> None:
    """One client process: for each phase, open + release single prompts for `seconds`."""
    from radixkv.client import RadixKVClient
    from radixkv.client.aio import AsyncRadixKVClient

    pid = os.getpid()
    for index, (transport, mode, window) in enumerate(phases):
        announce = functools.partial(ready.put, index)
        if mode == "sync":
            with RadixKVClient(address) as c:
                n = _sync_cycles(c, transport, window, pid, seconds, announce, go[index])
        else:

            async def run(
                transport: str = transport, window: int = window, ready: Any = announce, go: Any = go[index]
            ) -> int:
                async with AsyncRadixKVClient(address) as c:
                    return await _async_cycles(c, transport, window, pid, seconds, ready, go)

            n = asyncio.run(run())
        out.put((index, n / seconds))


def open_release(address: str, server_pid: int, num_clients: int, seconds: float) -> dict[str, dict[str, float]]:
    """Opens per second summed over `num_clients` processes, for every phase."""
    ctx = mp.get_context("spawn")  # no grpc state crosses a fork
    ready, go, out = ctx.Queue(), [ctx.Event() for _ in PHASES], ctx.Queue()
    procs = [
        ctx.Process(target=_open_release_worker, args=(address, PHASES, seconds, ready, go, out))
        for _ in range(num_clients)
    ]
    for p in procs:
        p.start()
    results: dict[str, dict[str, float]] = {}
    for index, phase in enumerate(PHASES):
        for _ in procs:  # every client connected and warm before the clock starts
            ready.get(timeout=120)
        cpu = cpu_seconds(server_pid)
        go[index].set()
        rates = [out.get(timeout=seconds + 120) for _ in procs]
        total = sum(rate for _, rate in rates)
        results[phase_name(phase)] = {
            "opens_per_s": total,
            "server_cpu_us_per_open": 1e6 * (cpu_seconds(server_pid) - cpu) / max(1.0, total * seconds),
        }
    for p in procs:
        p.join(timeout=60)
    return results


# -- wire encodings -------------------------------------------------------------------------------------


def wire_encodings(repeat: int) -> dict[str, dict[str, float]]:
    """Microseconds to build, serialize, parse and read back as numpy: repeated fields against packed bytes."""
    from radixkv.v1 import kvcache_pb2 as pb

    def per_call_us(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return 1e6 * (time.perf_counter() - start) / repeat

    results = {}
    for n in (256, 8192):
        tokens = np.arange(n, dtype=np.int32) % 32000
        slots = np.arange(n, dtype=np.int64) * 3

        def repeated(tokens: np.ndarray = tokens, slots: np.ndarray = slots) -> object:
            request = pb.AppendTokensRequest.FromString(
                pb.AppendTokensRequest(token_ids=tokens.tolist()).SerializeToString()
            )
            np.array(request.token_ids, dtype=np.uint32).view(np.int32)
            response = pb.AppendTokensResponse.FromString(
                pb.AppendTokensResponse(slots=slots.tolist()).SerializeToString()
            )
            return np.array(response.slots, dtype=np.int64)

        def packed(tokens: np.ndarray = tokens, slots: np.ndarray = slots) -> object:
            request = pb.StepAppend.FromString(pb.StepAppend(token_ids=tokens.tobytes()).SerializeToString())
            np.frombuffer(request.token_ids, dtype="<i4")
            response = pb.StepAppended.FromString(
                pb.StepAppended(slots=slots.astype("<i8").tobytes()).SerializeToString()
            )
            return np.frombuffer(response.slots, dtype="<i8")

        results[str(n)] = {"repeated_us": per_call_us(repeated), "packed_us": per_call_us(packed)}
    return results


# -- the run ----------------------------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    steps = 40 if quick else 300
    seconds = 0.4 if quick else 3.0
    server = start_server()
    address, proc = server.address, server.proc
    try:
        results: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "quick": quick,
        }
        results["decode_256"] = {"in_process": decode_in_process(steps), **decode_over_grpc(address, proc.pid, steps)}
        results["health"] = health_round_trip(address, steps * 5)
        results["open_release"] = {str(n): open_release(address, proc.pid, n, seconds) for n in CLIENTS}
        results["wire"] = wire_encodings(50 if quick else 500)
        return results
    finally:
        server.stop(timeout=30)


def table(r: dict[str, Any]) -> str:
    d, health = r["decode_256"], r["health"]
    floor = d["in_process"]["p50_ms"] + health["sync"]["p50_ms"]
    rows = [("measurement", "p50", "p99", "vs in-process", "server CPU", "note")]
    rows.append(
        (
            "decode step 256 seqs, in-process",
            f"{d['in_process']['p50_ms']:.2f} ms",
            f"{d['in_process']['p99_ms']:.2f} ms",
            "1.0x",
            "",
            "",
        )
    )
    for key, label in (
        ("unary", "unary AppendTokens"),
        ("stream", "stream step, sync"),
        ("stream_asyncio", "stream step, asyncio"),
    ):
        x = d[key]
        note = (
            f"target <= {floor:.2f} ms: {'met' if x['p50_ms'] <= floor else 'MISSED'}"
            if key.startswith("stream")
            else ""
        )
        rows.append((f"decode step 256 seqs, {label}", f"{x['p50_ms']:.2f} ms", f"{x['p99_ms']:.2f} ms",
                     f"{x['p50_ms'] / d['in_process']['p50_ms']:.1f}x", f"{x['server_cpu_ms']:.2f} ms/step",
                     note))  # fmt: skip
    for mode in MODES:
        h = health[mode]
        rows.append(
            (
                f"bare health round trip, {mode}",
                f"{h['p50_ms']:.2f} ms",
                f"{h['p99_ms']:.2f} ms",
                "",
                "",
                "transport floor",
            )
        )
    for n, by_way in r["open_release"].items():
        for mode in MODES:
            unary = by_way[f"unary_{mode}"]
            rows.append((f"open+release x{n} clients, {mode}: unary", f"{unary['opens_per_s']:,.0f}/s", "", "",
                         f"{unary['server_cpu_us_per_open']:.0f} us/open", ""))  # fmt: skip
            for window in (1, PIPELINE):
                stream = by_way[phase_name(("stream", mode, window))]
                ratio = stream["opens_per_s"] / unary["opens_per_s"]
                label = "stream" if window == 1 else f"stream, {window} in flight"
                note = ""
                if n == "4" and window > 1:
                    note = f"target >= 3x: {'met' if ratio >= 3 else 'MISSED'}"
                cpu = f"{stream['server_cpu_us_per_open']:.0f} us/open"
                rows.append((f"open+release x{n} clients, {mode}: {label}", f"{stream['opens_per_s']:,.0f}/s", "",
                             f"{ratio:.2f}x unary", cpu, note))  # fmt: skip
    for n, w in r["wire"].items():
        rows.append((f"wire: {n} token ids + slots, repeated", f"{w['repeated_us']:.1f} us", "", "", "", ""))
        rows.append(
            (
                f"wire: {n} token ids + slots, packed bytes",
                f"{w['packed_us']:.1f} us",
                "",
                f"{w['repeated_us'] / w['packed_us']:.1f}x faster",
                "",
                "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run(args.quick)
    results["load_before"] = load_before
    results["wall_seconds"] = time.perf_counter() - start
    print(table(results))
    load = f"load {results['load_before']:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"({results['machine']['cpus']} CPUs, {load}, {results['wall_seconds']:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
