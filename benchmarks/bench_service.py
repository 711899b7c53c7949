"""The RPC service against the in-process core, on loopback: what does going over gRPC cost?

Runs a real server process on 127.0.0.1 and measures, each both through `RadixKVClient` and
through an in-process `KVCache` doing the same operations:
  - a decode step: `append_batch` of one token to each of 256 sequences (p50/p99 ms per call);
  - open + release round trips per second with 1, 4 and 16 concurrent clients (processes);
  - batched admissions: `open_many` of 32 prompts + `release_many` per round trip (opens/s);
  - the transport floor: bare gRPC health checks per second, the most any unary RPC can reach here.
The server's own handling time (from its Prometheus histogram) splits each RPC into server and
transport + client. Prints a table; `--out FILE.json` writes the numbers; `--quick` finishes in < 30 s.

    python benchmarks/bench_service.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

from radixkv.kv_cache import KVCache
from radixkv.results import OpenResult

NUM_BLOCKS = 65536
BLOCK_SIZE = 16
POOL = f"default:num_layers=1,num_kv_heads=1,head_dim=8,block_size={BLOCK_SIZE},num_blocks={NUM_BLOCKS},dtype=float16"
PROMPT = list(range(10_000, 10_064))  # a 64-token shared prefix (4 blocks): opens hit it after the first
BATCH = 256
OPEN_BATCH = 32


def prompt(i: int) -> list[int]:
    return PROMPT + [i % 30_000, 7]


# -- the server ------------------------------------------------------------------------------------


def start_server() -> tuple[subprocess.Popen[bytes], str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.server.app", "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--pool", POOL, "--log-level", "warning", "--max-workers", "32"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    announcement = json.loads(proc.stdout.readline())
    return proc, f"127.0.0.1:{announcement['port']}", announcement["metrics_port"]


def server_seconds(metrics_port: int, method: str) -> tuple[float, int]:
    """(total seconds, calls) the server spent handling `method`, from its latency histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for kind in ("sum", "count"):
        m = re.search(
            rf'^radixkv_rpc_duration_seconds_{kind}{{method="{method}",pool="default"}} (\S+)$', text, re.MULTILINE
        )
        found[kind] = float(m.group(1)) if m else 0.0
    return found["sum"], int(found["count"])


class ServerTime:
    """Mean server-side handling time of some methods between `start` and `stop`."""

    def __init__(self, metrics_port: int, methods: tuple[str, ...]) -> None:
        self._port, self._methods = metrics_port, methods
        self._before = [server_seconds(metrics_port, m) for m in methods]

    def mean_ms(self) -> float:
        after = [server_seconds(self._port, m) for m in self._methods]
        seconds = sum(a[0] - b[0] for a, b in zip(after, self._before, strict=True))
        calls = sum(a[1] - b[1] for a, b in zip(after, self._before, strict=True))
        return 1e3 * seconds / calls if calls else float("nan")


# -- measurements -----------------------------------------------------------------------------------


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": 1e3 * float(np.percentile(samples, 50)),
        "p99_ms": 1e3 * float(np.percentile(samples, 99)),
        "mean_ms": 1e3 * float(np.mean(samples)),
    }


def time_steps(step: Callable[[int], object], num_steps: int) -> list[float]:
    for i in range(5):  # warm-up
        step(-1 - i)
    samples = []
    for i in range(num_steps):
        start = time.perf_counter()
        step(i)
        samples.append(time.perf_counter() - start)
    return samples


def append_step_core(num_steps: int) -> dict[str, float]:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    seq_ids = [
        r.seq_id for r in cache.open_many([(list(range(1000 * i, 1000 * i + 100)), "bench") for i in range(BATCH)])
    ]

    counts = [1] * BATCH
    return percentiles_ms(time_steps(lambda i: cache.append_batch(seq_ids, counts, np.full(BATCH, i % 1000, np.int32)), num_steps))


def append_step_rpc(address: str, metrics_port: int, num_steps: int) -> dict[str, float]:
    from radixkv.client import RadixKVClient

    with RadixKVClient(address) as client:
        seq_ids = [
            r.seq_id for r in client.open_many([(list(range(1000 * i, 1000 * i + 100)), "bench") for i in range(BATCH)])
        ]
        server = ServerTime(metrics_port, ("AppendTokens",))
        counts = [1] * BATCH
        result = percentiles_ms(time_steps(lambda i: client.append_batch(seq_ids, counts, [i % 1000] * BATCH), num_steps))
        result["server_mean_ms"] = server.mean_ms()
        client.release_many(seq_ids, cache=False)
    return result


def open_release_core(seconds: float, batch: int = 1) -> float:
    """Opens per second, opening `batch` prompts and releasing them per round."""
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    n, deadline = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        opened = cache.open_many([(prompt(n + j), "bench") for j in range(batch)])
        cache.release_many([o.seq_id for o in opened])
        n += batch
    return n / (time.perf_counter() - start)


def _client_process(address: str, seconds: float, batch: int, ready: Any, go: Any, out: Any) -> None:
    from radixkv.client import RadixKVClient

    with RadixKVClient(address) as client:
        for i in range(3):  # warm-up
            client.release(_written(client, client.open(prompt(i))))
        ready.put(os.getpid())
        go.wait()
        n, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            opened = client.open_many([(prompt(os.getpid() + n + j), "default") for j in range(batch)])
            client.release_many([o.seq_id for o in opened])
            n += batch
    out.put(n / seconds)


def open_release_rpc(
    address: str, metrics_port: int, num_clients: int, seconds: float, batch: int = 1
) -> dict[str, float]:
    """Opens per second summed over `num_clients` client processes, each opening `batch` per round trip."""
    ctx = mp.get_context("spawn")  # no grpc state crosses a fork
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_client_process, args=(address, seconds, batch, ready, go, out)) for _ in range(num_clients)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every client connected and warm before the clock starts
        ready.get(timeout=120)
    server = ServerTime(metrics_port, ("OpenSequences", "ReleaseSequences"))
    go.set()
    rates = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return {"opens_per_s": float(sum(rates)), "server_mean_ms": server.mean_ms()}


def health_checks_per_s(address: str, seconds: float) -> float:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        for _ in range(20):
            stub.Check(request)
        n, deadline = 0, time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < deadline:
            stub.Check(request)
            n += 1
        return n / (time.perf_counter() - start)


# -- the run ------------------------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    steps = 40 if quick else 300
    seconds = 1.0 if quick else 4.0
    clients = (1, 4, 16)
    proc, address, metrics_port = start_server()
    try:
        results: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "quick": quick,
        }
        results["append_256"] = {"core": append_step_core(steps), "rpc": append_step_rpc(address, metrics_port, steps)}
        core_rate = open_release_core(seconds)
        results["open_release"] = {"core_opens_per_s": core_rate}
        for n in clients:
            results["open_release"][f"rpc_{n}_clients"] = open_release_rpc(address, metrics_port, n, seconds)
        results["open_many_32"] = {
            "core_opens_per_s": open_release_core(seconds, OPEN_BATCH),
            "rpc_4_clients": open_release_rpc(address, metrics_port, 4, seconds, OPEN_BATCH),
        }
        results["health_check_per_s"] = health_checks_per_s(address, seconds)
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def table(r: dict[str, Any]) -> str:
    a_core, a_rpc = r["append_256"]["core"], r["append_256"]["rpc"]
    rows = [("operation", "in-process core", "over gRPC", "rpc / core", "server handling")]
    for stat in ("p50", "p99", "mean"):
        core_ms, rpc_ms = a_core[f"{stat}_ms"], a_rpc[f"{stat}_ms"]
        server = f"{a_rpc['server_mean_ms']:.2f} ms" if stat == "mean" else ""
        rows.append(
            (
                f"append_batch 256 seqs, {stat}",
                f"{core_ms:.2f} ms",
                f"{rpc_ms:.2f} ms",
                f"{rpc_ms / core_ms:.1f}x",
                server,
            )
        )
    core = r["open_release"]["core_opens_per_s"]
    for key, value in r["open_release"].items():
        if key.startswith("rpc_"):
            n = key.split("_")[1]
            rows.append(
                (
                    f"open+release, {n} client(s)",
                    f"{core:,.0f} /s",
                    f"{value['opens_per_s']:,.0f} /s",
                    f"{core / value['opens_per_s']:.1f}x slower",
                    f"{value['server_mean_ms']:.3f} ms/RPC",
                )
            )
    om = r["open_many_32"]
    rows.append(
        (
            "open_many 32 + release, 4 clients",
            f"{om['core_opens_per_s']:,.0f} opens/s",
            f"{om['rpc_4_clients']['opens_per_s']:,.0f} opens/s",
            f"{om['core_opens_per_s'] / om['rpc_4_clients']['opens_per_s']:.1f}x slower",
            f"{om['rpc_4_clients']['server_mean_ms']:.3f} ms/RPC",
        )
    )
    rows.append(("bare gRPC health check, 1 client", "", f"{r['health_check_per_s']:,.0f} /s", "", "transport floor"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (< 30 s in all)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(args.quick)
    results["wall_seconds"] = time.perf_counter() - start
    print(table(results))
    print(f"({results['machine']['cpus']} CPUs, {results['wall_seconds']:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _written(client: Any, opened: OpenResult) -> int:
    """As a worker that wrote every token of `opened` would: commit them (only written blocks are cached)."""
    client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
    return opened.seq_id
