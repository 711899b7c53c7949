"""The online audit's cost: how long one slice holds a pool's lock, against pool size, and what it does to Open.

For each pool size a real server process (`--audit-interval`, `--audit-slice-ms`) is filled through
the client to about 90% of its blocks (cached prefixes in several namespaces, and a few open
sequences), then left to audit while a client opens, commits and releases; the hold times come from
the server's own `radixkv_audit_slice_seconds` histogram and `radixkv_audit_max_slice_seconds` gauge.
A run copies the pool over several slices and recounts the copy off the lock (server/process/audit_image.py),
so the longest hold should stay near the slice budget whatever the pool's size. `p99_slice_ms` is
read from the histogram (its bucket's upper bound). The comparison inside the run: the longest slice
as a multiple of the median client-side Open round trip on the same pool.

A second table compares the two ways in one process, on the same filled pool with no other load:
the whole recount under the lock (`check_pool`, what each slice did before) against the copy's
slices, by wall time and by the audit thread's CPU time (on a loaded machine the OS may preempt a
slice mid-hold: wall time shows it, CPU time does not).

    python benchmarks/bench_audit.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path
from tempfile import TemporaryDirectory

from radixkv.client import RadixKVClient
from radixkv.server.process.audit import check_pool
from radixkv.server.process.audit_image import PoolImage
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.process.spawn import ServerProcess
from radixkv.server.rules.config import PoolConfig
from radixkv.server.rules.sessions import Session
from radixkv.server.rules.tenants import Tenant

BLOCK_SIZE = 16
PROMPT_BLOCKS = 64  # blocks per filling prompt (1024 tokens)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _value(text: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{pool="p"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _p99_bound(text: str) -> float:
    """The upper bound of the histogram bucket holding the 99th percentile slice."""
    buckets = [
        (float(le), float(n))
        for le, n in re.findall(
            r'^radixkv_audit_slice_seconds_bucket{le="([^"]+)",pool="p"} (\S+)$', text, re.MULTILINE
        )
    ]
    total = buckets[-1][1] if buckets else 0.0
    return next((le for le, n in buckets if n >= 0.99 * total), float("nan"))


def measure(num_blocks: int, audit_seconds: float, slice_ms: float, log_dir: Path) -> dict[str, float]:
    pool = f"p:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},num_blocks={num_blocks},dtype=float16"
    args = ["--pool", pool, "--audit-interval", "0.01", "--audit-slice-ms", str(slice_ms)]
    args += ["--metrics-port", "0", "--max-session-ttl", "600"]
    server = ServerProcess(args, log_dir / f"server-{num_blocks}.log")
    try:
        assert server.metrics_port is not None
        with RadixKVClient(server.address, pool="p") as client:
            num_prompts = int(num_blocks * 0.9) // PROMPT_BLOCKS
            for i in range(num_prompts):
                tokens = [i + 1] * 8 + list(range(PROMPT_BLOCKS * BLOCK_SIZE - 8))
                opened = client.open(tokens, f"ns{i % 4}")
                client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
                if i % 8:
                    client.release(opened.seq_id)  # every eighth stays open: block tables and locks to recount
            before = _value(_metrics(server.metrics_port), "radixkv_audit_runs_total")
            opens = []
            deadline = time.monotonic() + audit_seconds
            while time.monotonic() < deadline:
                start = time.perf_counter()
                opened = client.open(list(range(1, 3 * BLOCK_SIZE)), "probe")  # a hit after the first
                opens.append(time.perf_counter() - start)
                client.commit([opened.seq_id], [3 * BLOCK_SIZE - 1])  # written: its full blocks stay cached
                client.release(opened.seq_id)
            text = _metrics(server.metrics_port)
    finally:
        server.stop()
    runs = _value(text, "radixkv_audit_runs_total")
    slices = _value(text, "radixkv_audit_slice_seconds_count")
    total = _value(text, "radixkv_audit_slice_seconds_sum")
    open_p50 = statistics.median(opens)
    max_slice = _value(text, "radixkv_audit_max_slice_seconds")
    return {
        "num_blocks": num_blocks,
        "num_cached_blocks": num_prompts * PROMPT_BLOCKS,
        "slice_budget_ms": slice_ms,
        "audit_runs": runs,
        "audit_runs_during_opens": runs - before,
        "slices_per_run": slices / runs if runs else float("nan"),
        "audit_failures": _value(text, "radixkv_audit_failures_total"),
        "audit_skipped": _value(text, "radixkv_audit_skipped_total"),
        "mean_slice_ms": 1000 * total / slices if slices else float("nan"),
        "p99_slice_ms_at_most": 1000 * _p99_bound(text),
        "max_slice_ms": 1000 * max_slice,
        "open_p50_ms": 1000 * open_p50,
        "max_slice_over_open_p50": max_slice / open_p50,
    }


def compare_in_process(num_blocks: int, slice_ms: float, num_runs: int = 5) -> dict[str, float]:
    """The whole recount under the lock against the copy's slices, on the same pool filled as `measure` fills it."""
    config = PoolConfig(
        name="p", num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, num_blocks=num_blocks
    )
    pool = build_pool(config, 16)
    session = Session(
        session_id="bench",
        tenant=Tenant(name="t", namespaces=frozenset(), max_blocks=None, map_pools=False),
        ttl=600.0,
        deadline=float("inf"),
    )
    try:
        for i in range(int(num_blocks * 0.9) // PROMPT_BLOCKS):
            tokens = [i + 1] * 8 + list(range(PROMPT_BLOCKS * BLOCK_SIZE - 8))
            opened = pool.cache.open(tokens, f"ns{i % 4}")
            pool.cache.commit([opened.seq_id], [len(tokens)])
            if i % 8:
                pool.cache.release(opened.seq_id)
            else:
                pool.ledger.adopt(session, opened.seq_id, len(opened.block_table))
        whole, walls, cpus, num_slices, checks = [], [], [], [], []
        for _ in range(num_runs):
            start = time.perf_counter()
            check_pool(pool)
            whole.append(time.perf_counter() - start)
            image = PoolImage(pool)
            done = False
            while not done:
                start, start_cpu = time.perf_counter(), time.thread_time()
                done = image.step(slice_ms / 1000)
                walls.append(time.perf_counter() - start)
                cpus.append(time.thread_time() - start_cpu)
            num_slices.append(image.num_holds)
            start = time.perf_counter()
            image.check()
            checks.append(time.perf_counter() - start)
    finally:
        pool.close()
    return {
        "num_blocks": num_blocks,
        "whole_recount_locked_ms": 1000 * statistics.median(whole),
        "slices_per_run": float(statistics.mean(num_slices)),
        "max_slice_wall_ms": 1000 * max(walls),
        "max_slice_cpu_ms": 1000 * max(cpus),
        "recount_unlocked_ms": 1000 * statistics.median(checks),
        "whole_over_max_slice_cpu": statistics.median(whole) / max(cpus),
    }


def _print(rows: list[dict[str, float]]) -> None:
    columns = list(rows[0])
    print(" | ".join(f"{c:>14}" for c in columns))
    for row in rows:
        print(" | ".join(f"{row[c]:>14.3f}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small pools, about 15 s")
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--audit-slice-ms", type=float, default=2.0, help="the server's slice budget (default 2)")
    args = parser.parse_args()
    sizes = [1024, 8192] if args.quick else [1024, 8192, 65536]
    with TemporaryDirectory() as tmp:
        rows = [measure(n, 2.0 if args.quick else 5.0, args.audit_slice_ms, Path(tmp)) for n in sizes]
    _print(rows)
    in_process = [compare_in_process(n, args.audit_slice_ms, 2 if args.quick else 5) for n in sizes]
    print()
    _print(in_process)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "in_process": in_process}, indent=2))


if __name__ == "__main__":
    main()
