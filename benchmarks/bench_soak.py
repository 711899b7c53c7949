"""Soak: many client processes mixing every operation, some SIGKILLed mid-call; afterwards nothing may be left.

Starts a server (a 2048-block pool, short leases, the Debug service), keeps `--clients` processes
(benchmarks/soak_client.py) running against it for `--duration` seconds, and every `--kill-every`
seconds SIGKILLs one at random (wherever it is, usually inside a call) and starts a replacement.
The killed clients' sessions are left to expire. Then it waits for every lease to run out and asks
the server: every block free or cached, no sequence, no session, no pin, invariants intact. It
samples the server's RSS throughout (VmRSS from /proc) and stops it with SIGTERM (exit status 0).

Prints a table of requests served, outcomes by code and reason, clients killed, blocks leaked
(must be 0), latency percentiles under load and RSS at start, after warm-up and at the end;
`--out FILE.json` writes them. `--quick` runs 12 s (under 30 s in all); the default is 5 minutes.

    python benchmarks/bench_soak.py [--quick] [--duration 300] [--clients 16] [--out soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from radixkv.server.process.spawn import ServerProcess
from radixkv.v1 import debug_pb2, debug_pb2_grpc, kvcache_pb2_grpc
from radixkv.v1 import kvcache_pb2 as pb

CLIENT = Path(__file__).with_name("soak_client.py")
# Small enough that the cache fills within seconds: after that the tree only evicts and refills, so
# the server's memory has reached its working size and further growth would be a leak.
POOL = "default:num_layers=1,num_kv_heads=1,head_dim=8,block_size=16,num_blocks=2048,dtype=float16,max_fork_children=8"


class Server:
    """The server process, its address, and a sampler of its RSS."""

    def __init__(self, ttl: float, log_path: Path) -> None:
        self.server = ServerProcess(
            ["--pool", POOL, "--session-ttl", str(ttl), "--max-session-ttl", str(ttl), "--debug-rpc",
             "--log-level", "warning", "--max-workers", "32"],
            log_path,
        )  # fmt: skip
        self.proc, self.address = self.server.proc, self.server.address
        self.rss: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self._stop_sampling = threading.Event()
        self._start = time.monotonic()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def _sample(self) -> None:
        while not self._stop_sampling.wait(0.25) and self.proc.poll() is None:
            self.rss.append((time.monotonic() - self._start, self.rss_bytes()))

    def stop(self) -> int:
        """SIGTERM: a graceful stop exits 0."""
        self._stop_sampling.set()
        return self.server.stop(timeout=60)


def start_client(
    address: str, out_dir: Path, index: int, seed: int, deadline: float, ttl: float
) -> subprocess.Popen[bytes]:
    """A soak client that runs until `deadline` (seconds since the epoch) or until `out_dir/stop` exists."""
    err = open(out_dir / f"client{index}.err", "wb")  # noqa: SIM115 -- the child holds it
    proc = subprocess.Popen(
        [sys.executable, str(CLIENT), address, str(out_dir / f"client{index}.jsonl"), str(seed), str(deadline),
         str(ttl), str(out_dir / "stop")],
        stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    err.close()
    return proc


def served_ops(out_dir: Path) -> set[str]:
    """The operations served (answered OK) at least once so far, by what the clients have flushed."""
    return {key.split(" ", 1)[0] for key, n in read_outcomes(out_dir)[0].items() if key.endswith(" OK") and n}


def drive(
    server: Server,
    out_dir: Path,
    clients: int,
    duration: float,
    kill_every: float,
    ttl: float,
    seed: int,
    until_served: frozenset[str] = frozenset(),
    max_duration: float | None = None,
) -> dict[str, float]:
    """Keep `clients` running for `duration` seconds, SIGKILLing one every `kill_every` seconds; with
    `until_served`, go on past `duration` until each of those operations has been served at least once
    (a run's length then follows the machine's speed, not a wall-clock window), but never past `max_duration`.
    Then the clients are told to stop (`out_dir/stop`), and they close their sessions."""
    rng = random.Random(seed)
    start = time.monotonic()
    max_duration = max(duration, max_duration or duration)
    deadline = time.time() + max_duration + 60  # the clients' own limit, should this process die first
    running = {i: start_client(server.address, out_dir, i, seed * 1000 + i, deadline, ttl) for i in range(clients)}
    started, killed, failed = clients, 0, 0
    next_kill, next_check = start + kill_every, start + duration
    while (now := time.monotonic()) - start < max_duration:
        if now >= next_check:
            if not until_served - served_ops(out_dir):
                break
            next_check = now + 0.5
        time.sleep(0.05)
        for i, proc in list(running.items()):
            if proc.poll() is not None:  # a client exited on its own before the deadline: a failure
                failed += 1
                del running[i]
        if time.monotonic() >= next_kill:
            victim = rng.choice(sorted(running))
            running.pop(victim).kill()  # SIGKILL: no cleanup, wherever it was
            killed += 1
            running[started] = start_client(server.address, out_dir, started, seed * 1000 + started, deadline, ttl)
            started += 1
            next_kill += kill_every
    (out_dir / "stop").touch()
    hung = 0
    for proc in running.values():
        try:
            failed += proc.wait(timeout=60) != 0
        except subprocess.TimeoutExpired:
            proc.kill()
            hung += 1
    load_seconds = time.monotonic() - start
    return {"clients_started": started, "clients_killed": killed, "client_failures": failed, "clients_hung": hung,
            "load_seconds": round(load_seconds, 1)}  # fmt: skip


def read_outcomes(out_dir: Path) -> tuple[dict[str, int], dict[str, list[float]]]:
    outcomes: dict[str, int] = {}
    latencies: dict[str, list[float]] = {}
    for path in sorted(out_dir.glob("client*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed client, cut short
                continue
            for key, n in record["outcomes"].items():
                outcomes[key] = outcomes.get(key, 0) + n
            for op, values in record["latencies_ms"].items():
                latencies.setdefault(op, []).extend(values)
    return outcomes, latencies


def settle(address: str, ttl: float) -> dict[str, Any]:
    """Wait for every lease to run out, then the server's own account of what is left."""
    with grpc.insecure_channel(address) as channel:
        debug = debug_pb2_grpc.DebugStub(channel)
        deadline = time.monotonic() + ttl + 30
        while True:
            check = debug.CheckInvariants(debug_pb2.CheckInvariantsRequest(), timeout=30)
            if check.num_sessions == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        stats = kvcache_pb2_grpc.KVCacheStub(channel).Stats(pb.StatsRequest(), timeout=30).stats
    return {
        "invariant_violation": check.violation,
        "sessions_left": check.num_sessions,
        "live_sequences": check.num_live_sequences,
        "blocks_total": stats.num_blocks_total,
        "blocks_free": stats.num_blocks_free,
        "blocks_cached": stats.num_blocks_cached,
        "blocks_pinned": stats.num_blocks_pinned,
        "blocks_leaked": stats.num_blocks_total - stats.num_blocks_free - stats.num_blocks_evictable,
        "hit_ratio": stats.num_hit_tokens / max(1, stats.num_requested_tokens),
        "evicted_blocks": stats.num_evicted_blocks,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) if values else np.zeros(1)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def run(
    duration: float,
    clients: int,
    kill_every: float,
    ttl: float,
    seed: int = 0,
    until_served: frozenset[str] = frozenset(),
    max_duration: float | None = None,
) -> dict[str, Any]:
    """The whole soak; returns every figure the table shows (see `table`). `until_served`, `max_duration`:
    see `drive` (the test's way to ask for enough traffic without a throughput bound)."""
    with tempfile.TemporaryDirectory(prefix="radixkv-soak-") as tmp:
        out_dir = Path(tmp)
        server = Server(ttl, out_dir / "server.log")
        try:
            rss_start = server.rss_bytes()
            load = drive(server, out_dir, clients, duration, kill_every, ttl, seed, until_served, max_duration)
            left = settle(server.address, ttl)
            rss_end = server.rss_bytes()
        finally:
            exit_code = server.stop()
        errors = [line for line in (out_dir / "server.log").read_text().splitlines() if '"level": "error"' in line]
        outcomes, latencies = read_outcomes(out_dir)
    warm = [rss for t, rss in server.rss if t >= duration / 3]  # after warm-up: the last two thirds of the load
    every = [v for values in latencies.values() for v in values]
    by_code: dict[str, int] = {}
    for key, n in outcomes.items():
        code = key.split(" ", 1)[1]
        by_code[code] = by_code.get(code, 0) + n
    return {
        "config": {"duration_s": duration, "clients": clients, "kill_every_s": kill_every, "ttl_s": ttl, "seed": seed,
                   "cpus": os.cpu_count()},
        **load,
        "requests": sum(outcomes.values()),
        "outcomes_by_code": dict(sorted(by_code.items(), key=lambda kv: -kv[1])),
        "outcomes": dict(sorted(outcomes.items())),
        "latency": percentiles(every),
        "latency_by_op": {op: percentiles(v) for op, v in sorted(latencies.items())},
        **left,
        "rss_start_bytes": rss_start,
        "rss_after_warmup_bytes": warm[0] if warm else rss_start,
        "rss_max_bytes": max([rss for _, rss in server.rss], default=rss_end),
        "rss_end_bytes": rss_end,
        "rss_mib_each_second": [round(rss / 2**20, 1) for t, rss in server.rss if t % 1.0 < 0.25],
        "server_exit_code": exit_code,
        "server_error_lines": errors[:5],
    }  # fmt: skip


def table(r: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        (
            "clients (running at once / started / SIGKILLed)",
            f"{r['config']['clients']} / {r['clients_started']} / {r['clients_killed']}",
        ),
        ("clients that failed or hung", f"{r['client_failures']} / {r['clients_hung']}"),
        (
            "requests answered",
            f"{r['requests']:,} in {r['load_seconds']:.0f} s ({r['requests'] / r['load_seconds']:,.0f}/s)",
        ),
        *((f"  {code}", f"{n:,}") for code, n in r["outcomes_by_code"].items()),
        (
            "latency p50 / p99 / max",
            f"{r['latency']['p50_ms']:.2f} / {r['latency']['p99_ms']:.2f} / {r['latency']['max_ms']:.1f} ms",
        ),
        *((f"  {op} p99", f"{p['p99_ms']:.2f} ms") for op, p in r["latency_by_op"].items()),
        (
            "blocks leaked (must be 0)",
            f"{r['blocks_leaked']} of {r['blocks_total']} ({r['blocks_free']} free, {r['blocks_cached']} cached)",
        ),
        (
            "sessions / sequences / pinned blocks left",
            f"{r['sessions_left']} / {r['live_sequences']} / {r['blocks_pinned']}",
        ),
        ("invariants", r["invariant_violation"] or "hold"),
        ("prefix hit ratio, blocks evicted", f"{r['hit_ratio']:.2f}, {r['evicted_blocks']:,}"),
        ("server RSS start / after warm-up / max / end", " / ".join(f"{r[k] / mib:.1f}" for k in
            ("rss_start_bytes", "rss_after_warmup_bytes", "rss_max_bytes", "rss_end_bytes")) + " MiB"),
        ("server exit status (SIGTERM), error log lines", f"{r['server_exit_code']}, {len(r['server_error_lines'])}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 12 s soak (under 30 s in all)")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--clients", type=int, default=16, help="client processes running at once")
    parser.add_argument("--kill-every", type=float, default=1.0, help="seconds between SIGKILLs")
    parser.add_argument("--ttl", type=float, default=2.0, help="session lease, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    duration = 12.0 if args.quick else args.duration
    start = time.perf_counter()
    results = run(duration, args.clients, args.kill_every, args.ttl, args.seed)
    results["wall_seconds"] = time.perf_counter() - start
    print(table(results))
    print(f"({results['config']['cpus']} CPUs, {results['wall_seconds']:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    ok = results["blocks_leaked"] == 0 and not results["invariant_violation"] and results["sessions_left"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
