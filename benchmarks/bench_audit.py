"""The online audit's cost: how long one slice holds a pool's lock, against pool size, and what it does to Open.

For each pool size a real server process (`--audit-interval`) is filled through the client to about
90% of its blocks (cached prefixes in several namespaces, and a few open sequences), then left to
audit for a while; the slice hold times come from the server's own `radixkv_audit_slice_seconds`
histogram and `radixkv_audit_max_slice_seconds` gauge. The comparison inside the run: the longest
slice as a multiple of the median client-side Open round trip, measured on the same filled pool.

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
from radixkv.server.process import ServerProcess

BLOCK_SIZE = 16
PROMPT_BLOCKS = 64  # blocks per filling prompt (1024 tokens)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _value(text: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{pool="p"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def measure(num_blocks: int, audit_seconds: float, log_dir: Path) -> dict[str, float]:
    pool = f"p:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},num_blocks={num_blocks},dtype=float16"
    args = ["--pool", pool, "--audit-interval", "0.01", "--metrics-port", "0", "--max-session-ttl", "600"]
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
            before = _value(_metrics(server.metrics_port), "radixkv_audit_slice_seconds_count")
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
    runs = _value(text, "radixkv_audit_slice_seconds_count")
    total = _value(text, "radixkv_audit_slice_seconds_sum")
    open_p50 = statistics.median(opens)
    max_slice = _value(text, "radixkv_audit_max_slice_seconds")
    return {
        "num_blocks": num_blocks,
        "num_cached_blocks": num_prompts * PROMPT_BLOCKS,
        "audit_runs": runs,
        "audit_runs_during_opens": runs - before,
        "audit_failures": _value(text, "radixkv_audit_failures_total"),
        "audit_skipped": _value(text, "radixkv_audit_skipped_total"),
        "mean_slice_ms": 1000 * total / runs if runs else float("nan"),
        "max_slice_ms": 1000 * max_slice,
        "open_p50_ms": 1000 * open_p50,
        "max_slice_over_open_p50": max_slice / open_p50,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small pools, about 15 s")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    sizes = [1024, 8192] if args.quick else [1024, 8192, 65536]
    with TemporaryDirectory() as tmp:
        rows = [measure(n, 2.0 if args.quick else 5.0, Path(tmp)) for n in sizes]
    columns = list(rows[0])
    print(" | ".join(f"{c:>24}" for c in columns))
    for row in rows:
        print(" | ".join(f"{row[c]:>24.3f}" if isinstance(row[c], float) else f"{row[c]:>24}" for c in columns))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
