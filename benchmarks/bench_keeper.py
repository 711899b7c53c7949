"""What the keeper costs a restarting server: attaching a kept pool against allocating a new one, by pool size.

Per size, in this process (a keeper on a thread, spoken to over its real Unix socket):
- `create`: what a server without a keeper does at start, `KVStorage.create` in shared memory, then a write
  of every byte (the pool is useless until its pages exist; the OS zero-fills them on first touch);
- `fresh`: the keeper allocates it (create_or_attach on a new pool) and the server maps it, then writes it;
- `attach`: the keeper hands the same memory to the next server, which maps it; no byte is written, the
  pages already exist: this is the restart's cost;
- `touch`: a read of one byte per 4 KiB page of the attached pool: mapping the pages into the new process,
  which the server's first use of each block pays.
The ratios compare `attach` with `create` in the same run.

    python benchmarks/bench_keeper.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from radixkv.memory.layout import PoolLayout
from radixkv.memory.storage import KVStorage
from radixkv.server.keeper.keeper_client import KeeperClient
from radixkv.server.keeper.keeper_protocol import socket_path
from radixkv.server.keeper.keeper_registry import Keeper
from radixkv.server.process.keeper import KeeperServer


def _layout(num_bytes: int) -> PoolLayout:
    """A Llama-8B-shaped pool (32 layers, 8 KV heads, head_dim 128, fp16, block 16) of about `num_bytes`."""
    return PoolLayout.for_budget(num_bytes, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")


def _timed(fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(layout: PoolLayout, state_dir: Path) -> dict[str, float]:
    def create_and_fill() -> None:
        storage = KVStorage.create(layout)
        storage.data.view(torch.uint8).fill_(1)
        storage.close()
        storage.unlink()

    create_s, _ = _timed(create_and_fill)
    keeper = Keeper(state_dir)
    server = KeeperServer(keeper, socket_path(state_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:

        def fresh_and_fill() -> None:
            client = KeeperClient(server.path)
            storage = KVStorage.open(client.create_or_attach("p", layout, "cpu").handle)
            storage.data.view(torch.uint8).fill_(1)
            storage.close()
            client.close()

        fresh_s, _ = _timed(fresh_and_fill)
        client = KeeperClient(server.path)
        attach_s, storage = _timed(lambda: KVStorage.open(client.create_or_attach("p", layout, "cpu", 5).handle))
        assert isinstance(storage, KVStorage)
        touch_s, total = _timed(lambda: int(storage.data.view(torch.uint8)[::4096].sum()))
        assert total > 0, "the attached pool holds what the previous server wrote"
        storage.close()
        client.close()
    finally:
        server.stop()
        thread.join()
        server.close()
        keeper.close()
    return {"bytes": layout.total_bytes, "create_s": create_s, "fresh_s": fresh_s, "attach_s": attach_s,
            "touch_s": touch_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small pools (under 30 s)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    sizes = [64 << 20, 256 << 20] if args.quick else [256 << 20, 1 << 30, 2 << 30]
    rows = []
    print(f"{'pool':>9} {'create+fill':>12} {'keeper fresh':>13} {'attach':>9} {'touch':>10} {'create/attach':>14}")
    for size in sizes:
        with TemporaryDirectory() as d:
            row = measure(_layout(size), Path(d))
        rows.append(row)
        print(
            f"{row['bytes'] / 2**20:>7.0f}Mi {row['create_s'] * 1e3:>10.1f}ms {row['fresh_s'] * 1e3:>11.1f}ms "
            f"{row['attach_s'] * 1e3:>7.2f}ms {row['touch_s'] * 1e3:>8.1f}ms "
            f"{row['create_s'] / row['attach_s']:>13.0f}x"
        )
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "keeper", "quick": args.quick, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
