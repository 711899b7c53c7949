"""What a scheduler step costs over gRPC, unary against the Session stream, against the in-process core.

Runs a real server process on 127.0.0.1 and measures, in one run:
  - a decode step: one token appended to each of 256 sequences, in-process (`KVCache.append_batch`),
    as a unary AppendTokens call, and as a step on the Session stream (blocking and asyncio clients),
    beside each client kind's round trip of the same bytes over bare gRPC (`bare_grpc.py`: the
    transport's floor on grpcio's public stream API) and its bare health round trip (a unary call's);
    p50/p99 ms per step and the server's CPU per step. Every way runs a few steps in turn, round after
    round, at two cadences: back to back, and one step every 10 ms as a serving loop calls it between
    forward passes (service_decode.py says why both);
  - single open + release per second, one item per call or per step message, unary against the
    stream, with 1, 4 and 16 client processes, blocking and asyncio clients; on the stream once with
    one step in flight per client and once with PIPELINE open + release cycles in flight (steps
    queued together leave in one message, client/session/pipeline.py), each step still one item;
  - the wire encodings the stream uses: token ids and slots as packed bytes against repeated fields, and a
    decode step's append columns (ids, counts, results) packed against repeated.
Prints a table (ratios within this run); `--out FILE.json` writes the numbers; `--quick` finishes in
about 30 s on 2 loaded cores. Before and after: `--build DIR` measures the radixkv installed in DIR
(`pip install --no-deps --target DIR .` of an older commit) and then this one, each in its own process, and
prints this build's table with DIR's figures beside it; `--before FILE.json` prints an earlier run's figures
beside this run's. Runs minutes apart meet different loads on a shared machine; for
builds compared step by step in one interleaved run, see bench_step_ab.py.

Targets: a decode step's own work on the stream (the step less the in-process step and the same
client kind's bare stream round trip of its bytes: radixkv's client and server code, the core
aside) <= 0.5 ms back to back and <= 1.2 ms every 10 ms, each client kind (measured at 0.3-0.4 ms
and 0.7-0.95 ms on 2 shared cores: about two thirds the server's step path, a third the client's;
after an idle gap everything runs 2-4x slower, the bare round trip too). Issue 14's target (the
step <= in-process + one health round trip) was met with a private driver of gRPC's internals; on
the public API a stream round trip of the step's bytes costs about as much as the health call, so
it no longer holds and is not the target. Stream open/release with 4 clients, one item per step
message, >= 3x the unary rate (checked on the pipelined run; the run with one step in flight is
printed beside it).

    python benchmarks/bench_service.py [--quick] [--out results.json] [--build DIR] [--before old.json]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.sequences.step import Step

try:
    from radixkv.server.process.spawn import ServerProcess
except ImportError:  # a build from before the server's regrouping (--build DIR: the before of issue 41)
    from radixkv.server.process import ServerProcess  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builds  # noqa: E402 - sibling scripts, not a package
from service_decode import CADENCES, cpu_seconds  # noqa: E402
from service_decode import measure as measure_decode  # noqa: E402

NUM_BLOCKS = 65536
BLOCK_SIZE = 16
POOL = f"default:num_layers=1,num_kv_heads=1,head_dim=8,block_size={BLOCK_SIZE},num_blocks={NUM_BLOCKS},dtype=float16"
PROMPT = list(range(10_000, 10_064))  # a 64-token shared prefix (4 blocks): opens hit it after the first
CLIENTS = (1, 4, 16)
MODES = ("sync", "asyncio")
PIPELINE = 8  # open + release cycles each client keeps in flight on its stream, in the pipelined phases
Phase = tuple[str, str, int]  # (transport, mode, cycles in flight per client)
# A decode step's own work (the stream step less the in-process step and the bare stream round trip of its bytes)
# at most, per cadence: see the module docstring.
OWN_WORK_MS = {"back_to_back": 0.5, "every_10ms": 1.2}
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


def append_columns(repeat: int) -> dict[str, float]:
    """Microseconds for a decode step's append columns both ways (256 ids and counts in the request, four result
    columns in the response), built from lists, serialized, parsed and read back as lists: repeated fields
    against the packed ones (radixkv.sequences.packed)."""
    from radixkv.sequences.packed import pack, unpack
    from radixkv.v1 import kvcache_pb2 as pb

    ids, counts = list(range(10_000, 10_256)), [1] * 256
    columns = [list(range(500, 756)), [7] * 256, [0] * 255 + [1], [4242]]
    names = ("num_tokens", "table_offsets", "num_block_ids", "block_ids")

    def repeated() -> object:
        request = pb.StepAppend.FromString(pb.StepAppend(seq_ids=ids, num_token_ids=counts).SerializeToString())
        list(request.seq_ids), list(request.num_token_ids)
        response = pb.StepAppended()
        for name, column in zip(names, columns, strict=True):
            getattr(response, name).extend(column)
        parsed = pb.StepAppended.FromString(response.SerializeToString())
        return [list(getattr(parsed, name)) for name in names]

    def packed() -> object:
        request = pb.StepAppend.FromString(pb.StepAppend(packed_seq_ids=pack(ids, 8)).SerializeToString())
        unpack(request.packed_seq_ids, 8, "packed_seq_ids"), [1] * 256  # a decode step's counts: implied
        response = pb.StepAppended()
        for name, column in zip(names, columns, strict=True):
            setattr(response, f"packed_{name}", pack(column, 4))
        parsed = pb.StepAppended.FromString(response.SerializeToString())
        return [unpack(getattr(parsed, f"packed_{name}"), 4, name) for name in names]

    timings = {}
    for name, fn in (("repeated_us", repeated), ("packed_us", packed)):
        fn()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        timings[name] = 1e6 * (time.perf_counter() - start) / repeat
    return timings


# -- the run ----------------------------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    seconds = 0.4 if quick else 3.0
    server = start_server()
    address, proc = server.address, server.proc
    try:
        results: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "quick": quick,
        }
        results["decode_256"] = measure_decode(address, proc.pid, NUM_BLOCKS, BLOCK_SIZE, quick)
        results["open_release"] = {str(n): open_release(address, proc.pid, n, seconds) for n in CLIENTS}
        results["wire"] = wire_encodings(50 if quick else 500)
        results["append_columns"] = append_columns(200 if quick else 2000)
        return results
    finally:
        server.stop(timeout=30)


DECODE_ROWS = (
    ("in_process", "in-process"),
    ("unary", "unary AppendTokens"),
    ("stream", "stream step, sync"),
    ("stream_asyncio", "stream step, asyncio"),
    ("floor", "bare gRPC stream round trip of its bytes, sync"),
    ("floor_asyncio", "bare gRPC stream round trip of its bytes, asyncio"),
    ("health", "bare health round trip, sync"),
    ("health_asyncio", "bare health round trip, asyncio"),
)


def decode_rows(by_cadence: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per cadence: each way's step; for the streams, radixkv's own work (the step less the in-process step and the
    same client kind's bare stream round trip of the same bytes) against its target."""
    rows = []
    for cadence in CADENCES:
        d = by_cadence[cadence]
        local = d["in_process"]["p50_ms"]
        for key, label in DECODE_ROWS:
            if key not in d:  # an earlier run's results (--before) may lack a row
                continue
            x = d[key]
            note = ""
            floor_key = "floor_asyncio" if key.endswith("asyncio") else "floor"
            if key.startswith("stream") and floor_key in d:
                own, budget = x["p50_ms"] - local - d[floor_key]["p50_ms"], OWN_WORK_MS[cadence]
                note = f"own work {own:.2f} ms, target <= {budget:.2f}: {'met' if own <= budget else 'MISSED'}"
            elif key.startswith("floor"):
                note = "transport floor (grpcio's public stream API)"
            elif key.startswith("health"):
                note = "a unary call's transport"
            label = f"{label}, {cadence.replace('_', ' ')}"
            bare = key.startswith(("health", "floor"))
            ratio = "" if bare else f"{x['p50_ms'] / local:.1f}x"
            cpu = f"{x['server_cpu_ms']:.2f} ms/step" if "server_cpu_ms" in x else ""
            name = label if bare else f"decode step 256 seqs, {label}"
            rows.append((name, f"{x['p50_ms']:.2f} ms", f"{x['p99_ms']:.2f} ms", ratio, cpu, note))
    return rows


def measurements(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """A row per measurement: (name, p50 or rate, p99, ratio, server CPU, note)."""
    rows = decode_rows(r["decode_256"])
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
    c = r["append_columns"]
    rows.append(("wire: decode step's append columns, repeated", f"{c['repeated_us']:.1f} us", "", "", "", ""))
    speedup = f"{c['repeated_us'] / c['packed_us']:.1f}x faster"
    rows.append(("wire: decode step's append columns, packed", f"{c['packed_us']:.1f} us", "", speedup, "", ""))
    return rows


def table(r: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The measurements; with `before` (an earlier run's results: another build, say), its figure beside each."""
    header: tuple[str, ...] = ("measurement", "p50", "p99", "vs in-process", "server CPU", "note")
    rows = measurements(r)
    if before is not None:
        earlier = {row[0]: row[1] for row in measurements(before)}
        header = (*header[:2], "before", *header[2:])
        rows = [(*row[:2], earlier.get(row[0], ""), *row[2:]) for row in rows]
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--before", help="an earlier run's --out JSON: its figures are printed beside this run's")
    parser.add_argument("--build", help="also measure the radixkv installed in this directory: before and after")
    args = parser.parse_args(argv)
    if args.build is not None:  # again, in a process (and a server) that imports that build
        return _run_build(args.build, args.quick, args.out, args.before)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run(args.quick)
    results["load_before"] = load_before
    results["wall_seconds"] = time.perf_counter() - start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    print(table(results, before))
    load = f"load {results['load_before']:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"({results['machine']['cpus']} CPUs, {load}, {results['wall_seconds']:.1f} s)")
    return 0


def _run_build(build: str, quick: bool, out: str | None, before: str | None) -> int:
    """Before and after from one run: this script on `build`'s radixkv, then on this one, each in its own process
    (and server) started outside any checkout; this build's table with the other's figures beside it."""
    if before is not None:
        raise SystemExit("bench_service: --build measures the before figures itself; drop --before")
    names = (f"before ({Path(build).name})", "after (this)")
    runs = builds.run_alternately(Path(__file__), {names[0]: build, names[1]: None}, ["--quick"] if quick else [], 1)
    old, new = (runs[name][0] for name in names)
    print(f"bench_service after (this build) with before ({build}) beside it, one run each")
    print(table(new, old))
    if out:
        with open(out, "w") as f:
            json.dump({"before": old, "after": new, "build": build}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
