"""What a Session step costs, build against build (old against new) and against bare gRPC, interleaved in one run.

Each build (a directory holding an installed `radixkv`: `pip install --no-deps --target DIR .` of a
commit; `.` for this checkout) gets its own server process and its own client process, both importing
that build; the build `bare` is the transport's floor, bare gRPC carrying the same bytes each way
(`bare_grpc.py`), always run. Every (way, build) pair takes `--per` steps in turn, round after round,
the builds' order rotating each round, so a slow spell of this shared machine falls on each alike. Per
step it records the caller's wall time; per turn, the on-CPU time of the client process and of the
server process (all their threads, from the kernel's per-process CPU clocks) and their context
switches, per step. The table shows medians; "over bare" is what radixkv adds to the transport.

Ways (each a step a scheduler sends, applied by the server; `_aio`: the asyncio client):
  - empty: `client.step(Step())`: the step path's fixed cost;
  - decode: one token appended to each of 256 sequences, on the Session stream;
  - empty_unary, decode_unary: the same step as one unary call (bare: a unary call of its bytes; radixkv:
    AppendTokens, a one-item step through the same `run_step`), what sending a lone step unary would cost;
  - piped: empty steps 8 in flight on the stream (`submit`), per step;
  - health: a gRPC health round trip (unary); core: the decode step in-process (`KVCache.append_batch`).

    python benchmarks/bench_step_ab.py [--build old=DIR] [--build new=.] [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bare_grpc import AsyncFloor, BareServer, BlockingFloor, timed  # noqa: E402 - a sibling script, not a package

WAYS = ("empty", "empty_aio", "empty_unary", "decode", "decode_aio", "decode_unary", "piped", "health", "core")
BATCH = 256
PIPELINE = 8
BARE = "bare"  # the build name (and path) of the transport's floor
MAX_DECODE = 1000  # tokens a decode batch grows by before it is opened again (untimed)
POOL = "default:num_layers=1,num_kv_heads=1,head_dim=8,block_size=16,num_blocks=65536,dtype=float16"


def cpu_clock(pid: int) -> int:
    """The kernel's CPU-time clock of process `pid` (all its threads, past ones included): Linux's
    MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED), readable with clock_gettime."""
    return ((~pid) << 3) | 2


def switches(pid: int) -> int:
    """Context switches (voluntary and not) of the live threads of process `pid`."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches" in line:
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


# -- the client process of one build ----------------------------------------------------------------------


def bare_worker() -> None:
    """The floor's client: each way's round trips carrying the same bytes over bare gRPC (`bare_grpc.py`)."""
    server = BareServer()
    blocking = BlockingFloor(server.address)
    runner = asyncio.Runner()
    floor = runner.run(_async_floor(server.address))

    async def aio(kind: str, n: int) -> list[float]:
        walls = []
        for _ in range(n):
            start = time.perf_counter()
            await floor.stream(kind)
            walls.append(time.perf_counter() - start)
        return walls

    ways = {
        "empty": lambda n: timed(lambda: blocking.stream("empty"), n),
        "decode": lambda n: timed(lambda: blocking.stream("decode"), n),
        "empty_unary": lambda n: timed(lambda: blocking.unary("empty"), n),
        "decode_unary": lambda n: timed(lambda: blocking.unary("decode"), n),
        "empty_aio": lambda n: runner.run(aio("empty", n)),
        "decode_aio": lambda n: runner.run(aio("decode", n)),
    }
    try:
        serve(ways, server.pid, "bare gRPC (benchmarks/bare_grpc.py)")
    finally:
        runner.run(floor.close())
        runner.close()
        blocking.close()
        server.stop()


async def _async_floor(address: str) -> AsyncFloor:
    return AsyncFloor(address)


def worker() -> None:
    """One build's client: starts the build's server, then answers `{"way", "n"}` lines on stdin with the
    turn's figures on stdout."""
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from radixkv.client import RadixKVClient
    from radixkv.client.aio import AsyncRadixKVClient
    from radixkv.kv_cache import KVCache
    from radixkv.sequences.step import Append, Step

    try:
        from radixkv.server.process.spawn import ServerProcess
    except ImportError:  # a build from before the server's regrouping (issue 41)
        from radixkv.server.process import ServerProcess  # type: ignore[no-redef]

    server = ServerProcess(["--pool", POOL, "--log-level", "warning"])
    prompts = [(list(range(1000 * i, 1000 * i + 100)), "bench") for i in range(BATCH)]
    counts = [1] * BATCH
    runner = asyncio.Runner()
    client = RadixKVClient(server.address)
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    health_request = health_pb2.HealthCheckRequest()
    cache = KVCache(65536, 16)
    counter = [0]

    def tokens() -> Any:
        counter[0] += 1
        return np.full(BATCH, counter[0] % 1000, np.int32)

    class Batch:
        """256 sequences decoding, opened again (untimed) before they grow past MAX_DECODE tokens."""

        def __init__(self, open_many: Any, release_many: Any) -> None:
            self.open_many, self.release_many = open_many, release_many
            self.ids: list[int] = []
            self.length = 0

        def ready(self, n: int) -> list[int]:
            if not self.ids or self.length + n > MAX_DECODE:
                if self.ids:
                    self.release_many(self.ids)
                self.ids, self.length = self.open_many(), 0
            self.length += n
            return self.ids

    def aio_run(coroutine: Any) -> Any:
        return runner.run(coroutine)

    async def open_aio() -> Any:
        c = AsyncRadixKVClient(server.address)
        await c.__aenter__()
        return c

    aio = aio_run(open_aio())
    batches = {
        "decode": Batch(
            lambda: [r.seq_id for r in client.step(Step(opens=prompts)).opened],
            lambda ids: client.step(Step(releases=[(ids, False)])),
        ),
        "decode_unary": Batch(
            lambda: [r.seq_id for r in client.step(Step(opens=prompts)).opened],
            lambda ids: client.step(Step(releases=[(ids, False)])),
        ),
        "decode_aio": Batch(
            lambda: [r.seq_id for r in aio_run(aio.step(Step(opens=prompts))).opened],
            lambda ids: aio_run(aio.step(Step(releases=[(ids, False)]))),
        ),
        "core": Batch(lambda: [r.seq_id for r in cache.open_many(prompts)], lambda ids: cache.release_many(ids, False)),
    }

    async def aio_loop(one: Any, n: int) -> list[float]:
        walls = []
        for _ in range(n):
            start = time.perf_counter()
            await one()
            walls.append(time.perf_counter() - start)
        return walls

    def decode(n: int) -> list[float]:
        ids = batches["decode"].ready(n)
        return timed(lambda: client.step(Step(append=Append(ids, counts, tokens()))), n)

    def decode_unary(n: int) -> list[float]:
        """The same decode step as a unary AppendTokens call: a one-item step through the same `run_step`."""
        ids = batches["decode_unary"].ready(n)
        return timed(lambda: client.append_batch(ids, counts, tokens()), n)

    def decode_aio(n: int) -> list[float]:
        ids = batches["decode_aio"].ready(n)
        return aio_run(aio_loop(lambda: aio.step(Step(append=Append(ids, counts, tokens()))), n))

    def core(n: int) -> list[float]:
        ids = batches["core"].ready(n)
        return timed(lambda: cache.append_batch(ids, counts, tokens()).slots, n)  # the slots the RPC sends

    def piped(n: int) -> list[float]:
        start = time.perf_counter()
        futures = [client.submit(Step()) for _ in range(PIPELINE)]
        for _ in range(n - PIPELINE):
            futures.pop(0).result()
            futures.append(client.submit(Step()))
        for f in futures:
            f.result()
        return [(time.perf_counter() - start) / n] * n

    ways = {
        "health": lambda n: timed(lambda: health.Check(health_request), n),
        "empty": lambda n: timed(lambda: client.step(Step()), n),
        "decode": decode,
        "decode_unary": decode_unary,
        "empty_aio": lambda n: aio_run(aio_loop(lambda: aio.step(Step()), n)),
        "decode_aio": decode_aio,
        "piped": piped,
        "core": core,
    }
    import radixkv

    try:
        serve(ways, server.pid, radixkv.__file__)  # which build this worker imported
    finally:
        runner.run(aio.__aexit__(None, None, None))
        runner.close()
        client.close()
        channel.close()
        server.stop(timeout=30)


def serve(ways: dict[str, Any], server_pid: int, source: str) -> None:
    """Answer the runner's turns: `{"way", "n"}` in, the turn's figures out."""
    me, server_clock = os.getpid(), cpu_clock(server_pid)
    print(json.dumps({"ready": source}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        way, n = command["way"], command["n"]
        if way not in ways:
            print(json.dumps({"skip": True}), flush=True)
            continue
        usage = resource.getrusage(resource.RUSAGE_SELF)
        csw = usage.ru_nvcsw + usage.ru_nivcsw
        server_csw = switches(server_pid)
        cpu, server_cpu = time.process_time(), time.clock_gettime(server_clock)
        walls = ways[way](n)
        cpu, server_cpu = time.process_time() - cpu, time.clock_gettime(server_clock) - server_cpu
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out = {
            "wall": walls,
            "client_cpu": cpu / n,
            "server_cpu": server_cpu / n,
            "client_csw": (usage.ru_nvcsw + usage.ru_nivcsw - csw) / n,
            "server_csw": (switches(server_pid) - server_csw) / n,
            "pid": me,
        }
        print(json.dumps(out), flush=True)


# -- the runner ----------------------------------------------------------------------------------------------


class Build:
    def __init__(self, name: str, path: str) -> None:
        self.name = name
        env = dict(os.environ)
        if path not in (".", BARE):  # ".": this checkout, the environment's own radixkv
            env["PYTHONPATH"] = os.path.abspath(path)
        # From a neutral directory: `python -m` puts the working directory first on the server's path.
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", *(["--bare"] if path == BARE else [])],
            env=env, cwd="/", text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self.source = json.loads(self.read())["ready"]

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"build {self.name}'s worker exited ({self.proc.wait()})")
        return line

    def turn(self, way: str, n: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"way": way, "n": n}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.read())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(builds: dict[str, str], ways: list[str], rounds: int, per: int) -> dict[str, Any]:
    started = [Build(name, path) for name, path in builds.items()]
    turns: dict[str, dict[str, list[dict[str, Any]]]] = {w: {b.name: [] for b in started} for w in ways}
    loads = [os.getloadavg()[0]]
    try:
        for b in started:  # warm every way
            for way in ways:
                b.turn(way, PIPELINE * 2)
        for r in range(rounds):
            for way in ways:
                k = r % len(started)
                for b in started[k:] + started[:k]:
                    turn = b.turn(way, per)
                    if "skip" not in turn:
                        turns[way][b.name].append(turn)
            loads.append(os.getloadavg()[0])
    finally:
        for b in started:
            b.close()
    results: dict[str, Any] = {
        "load": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "sources": {b.name: b.source for b in started},
    }
    for way, by_build in turns.items():
        results[way] = {}
        for name, ts in by_build.items():
            if not ts:
                continue
            walls = [w for t in ts for w in t["wall"]]
            results[way][name] = {
                "wall_p50_us": 1e6 * statistics.median(walls),
                "wall_turn_median_us": 1e6 * statistics.median(statistics.median(t["wall"]) for t in ts),
                "client_cpu_us": 1e6 * statistics.median(t["client_cpu"] for t in ts),
                "server_cpu_us": 1e6 * statistics.median(t["server_cpu"] for t in ts),
                "client_csw": statistics.median(t["client_csw"] for t in ts),
                "server_csw": statistics.median(t["server_csw"] for t in ts),
            }
    return results


def table(results: dict[str, Any], names: list[str], ways: list[str]) -> str:
    """A row per (way, build): its wall time against the first build's and against the bare floor's (same way)."""
    header = ("way", "build", "wall p50 us", "vs first", "over bare", "client CPU us", "server CPU us", "switches c/s")
    rows = [header]
    for way in ways:
        by_build = results[way]
        first = next((by_build[n]["wall_p50_us"] for n in names if n in by_build and n != BARE), None)
        floor = by_build.get(BARE, {}).get("wall_p50_us")
        for name in names:
            if name not in by_build:
                continue
            x = by_build[name]
            wall = x["wall_p50_us"]
            vs_first = f"{wall - first:+.0f}" if first is not None and name != BARE else ""
            over_bare = f"{wall - floor:+.0f}" if floor is not None and name != BARE else ""
            rows.append((
                way, name, f"{wall:.0f}", vs_first, over_bare, f"{x['client_cpu_us']:.0f}",
                f"{x['server_cpu_us']:.0f}", f"{x['client_csw']:.1f}/{x['server_csw']:.1f}",
            ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", default=[], help="NAME=DIR (an installed radixkv; '.': this one)")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of: " + ", ".join(WAYS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--per", type=int, default=100, help="steps per turn")
    parser.add_argument("--quick", action="store_true", help="4 rounds of 30 steps")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        bare_worker() if args.bare else worker()
        return 0
    builds = dict(b.split("=", 1) for b in args.build) or {"this": "."}
    builds.setdefault(BARE, BARE)
    ways = args.ways.split(",")
    rounds, per = (4, 30) if args.quick else (args.rounds, args.per)
    start = time.perf_counter()
    results = run(builds, ways, rounds, per)
    print(table(results, list(builds), ways))
    for name, source in results["sources"].items():
        print(f"{name}: {source}")
    load = results["load"]
    print(
        f"({os.cpu_count()} CPUs, load {load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f}), "
        f"{rounds} rounds x {per} steps, {time.perf_counter() - start:.0f} s)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"builds": builds, "rounds": rounds, "per": per, **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
