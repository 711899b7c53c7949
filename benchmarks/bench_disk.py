"""The disk tier against its device's roofline, in one run.

First the device's own O_DIRECT bandwidth, measured with `fio` when it is installed, else `dd` (1 MiB requests,
`oflag=direct` / `iflag=direct`, the page cache out of the way); then radixkv's disk tier on the same
directory: `DiskStore.put` of whole blocks (objects of `--object-mib`, headers, XXH3-128 per block, temp +
rename, fsync of every file and directory) and `DiskStore.read` back (verifying every block's checksum),
the block shape of a small model (Qwen2.5-0.5B-like: 24 layers, 2 KV heads, head_dim 64, bf16, 16 tokens).
Reported: object size, GB/s each way and the ratio to the roofline (targets: loads >= 0.90, stores >= 0.80), stores
with and without the fsyncs. Also the index rebuilt from the directory alone, per million blocks (100k blocks with
--quick, 1M without, synthesized: real headers over sparse data).

    python benchmarks/bench_disk.py [--quick] [--dir DIR] [--out results.json]

`--dir` must be on the disk under test (not a tmpfs: the default is under this checkout's parent, /work).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from radixkv.disk.block_io import aligned_rows
from radixkv.disk.object_format import OBJECT_SUFFIX, encode_header, object_bytes
from radixkv.disk.shape import disk_shape
from radixkv.disk.store import DiskStore
from radixkv.memory.block_pool import cdiv
from radixkv.memory.layout import PoolLayout
from radixkv.server.rules.disk_tier import FLUSH_INTERVAL_S, MAX_FLUSH_BYTES
from radixkv.tree.block_hash import chain_hashes

LAYOUT = PoolLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=1, dtype="bfloat16")
GB = 1e9


def roofline(directory: Path, num_mib: int, object_bytes: int, repeats: int) -> dict[str, float | str]:
    """The device's O_DIRECT write and read bandwidth (bytes/s) on `directory`, one stream: the best of `repeats`
    runs of 1 MiB requests and of requests of one object's size (the size radixkv reads and writes)."""
    path = directory / "roofline.bin"
    result: dict[str, float | str] = {"tool": "fio" if shutil.which("fio") else "dd", "write": 0.0, "read": 0.0}
    try:
        for bs in sorted({1 << 20, object_bytes}) * repeats:
            count = num_mib * (1 << 20) // bs
            if shutil.which("fio"):
                write, read = (_fio(path, rw, bs, count) for rw in ("write", "read"))
            else:
                write = _dd(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct",
                             "conv=fsync"])  # fmt: skip
                read = _dd(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"])
            result[f"write_{bs}"] = max(float(result.get(f"write_{bs}", 0.0)), write)
            result[f"read_{bs}"] = max(float(result.get(f"read_{bs}", 0.0)), read)
            result["write"], result["read"] = max(float(result["write"]), write), max(float(result["read"]), read)
            path.unlink()
        return result
    finally:
        path.unlink(missing_ok=True)


def _dd(cmd: list[str]) -> float:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", out)
    assert m, f"unexpected dd output: {out}"
    return int(m.group(1)) / float(m.group(2))


def _fio(path: Path, rw: str, bs: int, count: int) -> float:
    out = subprocess.run(
        ["fio", "--name=roof", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={bs * count}", "--direct=1",
         "--ioengine=psync", "--numjobs=1", "--iodepth=1", "--output-format=json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = json.loads(out)["jobs"][0][rw]
    return float(job["bw_bytes"])


def radixkv_tier(directory: Path, num_mib: int, object_mib: float, durable: bool, write_bps: float,
                 load_objects: int, repeats: int) -> dict[str, float]:  # fmt: skip
    """Stores as the disk tier's writer makes them (a flush hands `DiskStore.put` what committed since the last, at
    most MAX_FLUSH_BYTES: under a load at the disk's rate, `write_bps` x FLUSH_INTERVAL_S), then loads as
    `PoolDisk.promote` makes them (a prompt's run of `load_objects` objects read straight into reused rows); the
    best of `repeats` runs each way, each on a fresh directory."""
    shape = disk_shape(LAYOUT)
    bb = shape.bytes_per_block
    num_blocks = num_mib * (1 << 20) // bb
    rng = np.random.default_rng(0)
    blocks = aligned_rows(num_blocks, bb)  # as the writer gathers them out of the pool
    blocks[:] = rng.integers(0, 256, (num_blocks, bb), dtype=np.uint8)
    hashes = chain_hashes(rng.integers(0, 50_000, num_blocks * LAYOUT.block_size).tolist(), LAYOUT.block_size)
    flush = max(1, int(min(MAX_FLUSH_BYTES, write_bps * FLUSH_INTERVAL_S)) // bb)
    store_s = load_s = float("inf")
    for _ in range(repeats):
        store = DiskStore(directory / "tier", shape, 1 << 40, target_object_bytes=int(object_mib * (1 << 20)),
                          durable=durable)  # fmt: skip
        store.open()
        began = time.perf_counter()
        for i in range(0, num_blocks, flush):
            store.put("", hashes[i : i + flush], blocks[i : i + flush])
        store_s = min(store_s, time.perf_counter() - began)
        assert len(store) == num_blocks, "every block was stored"
        prompt = store.blocks_per_object * load_objects
        rows = aligned_rows(prompt, bb)
        began = time.perf_counter()
        for i in range(0, num_blocks, prompt):
            got = store.read(hashes[i : i + prompt], rows)
            assert len(got) == min(prompt, num_blocks - i), "every block read back and verified"
        load_s = min(load_s, time.perf_counter() - began)
        object_bytes = next(iter(store._objects.values())).file_bytes
        store.close()
        shutil.rmtree(directory / "tier")
    return {
        "block_bytes": bb, "blocks_per_object": store.blocks_per_object, "object_bytes": object_bytes,
        "num_blocks": num_blocks, "store": num_blocks * bb / store_s, "load": num_blocks * bb / load_s,
        "store_batch_objects": cdiv(flush, store.blocks_per_object), "load_batch_objects": load_objects,
        "num_threads": store.num_threads,
    }  # fmt: skip


def rebuild(directory: Path, num_blocks: int, object_mib: float) -> dict[str, float]:
    """The index rebuilt from a directory of `num_blocks` blocks in objects of `object_mib`, synthesized: real
    headers (random hashes and checksums), the data left sparse (a rebuild reads headers only)."""
    shape = disk_shape(LAYOUT)
    store = DiskStore(directory / "synth", shape, 1 << 50, target_object_bytes=int(object_mib * (1 << 20)))
    store.open()
    per = store.blocks_per_object
    rng = np.random.default_rng(1)
    for i in range(0, num_blocks, per):
        n = min(per, num_blocks - i)
        hashes = [rng.bytes(32) for _ in range(n)]
        header = encode_header(shape, "", hashes, rng.bytes(16 * n))
        path = directory / "synth" / "objects" / hashes[0][:1].hex() / f"{hashes[0][:8].hex()}-{i:012x}{OBJECT_SUFFIX}"
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(object_bytes(len(header), n, shape.bytes_per_block))
    store.close()
    began = time.perf_counter()
    rebuilt = DiskStore(directory / "synth", shape, 1 << 50)
    rebuilt.open()
    seconds = time.perf_counter() - began
    assert len(rebuilt) == num_blocks, "every synthesized block indexed"
    rebuilt.close()
    return {"num_blocks": num_blocks, "num_objects": rebuilt.num_objects, "seconds": seconds,
            "seconds_per_million_blocks": seconds / num_blocks * 1e6}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 2 GiB")
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--object-mib", type=float, default=2.0, help="target object size (MiB)")
    parser.add_argument("--load-objects", type=int, default=16, help="objects per prompt's disk run (loads)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs, roofline and radixkv alike")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    num_mib = 256 if args.quick else 2048
    shape = disk_shape(LAYOUT)
    per_object = max(1, int(args.object_mib * (1 << 20)) // shape.bytes_per_block)
    header = encode_header(shape, "", [bytes(32)] * per_object, bytes(16 * per_object))
    size = object_bytes(len(header), per_object, shape.bytes_per_block)
    with tempfile.TemporaryDirectory(prefix="bench-disk-", dir=args.dir) as tmp:
        roof = roofline(Path(tmp), num_mib, size, args.repeats)
        write_bps = float(roof["write"])
        tier = radixkv_tier(Path(tmp), num_mib, args.object_mib, True, write_bps, args.load_objects, args.repeats)
        fast = radixkv_tier(Path(tmp), num_mib, args.object_mib, False, write_bps, args.load_objects, args.repeats)
        index = rebuild(Path(tmp), 100_000 if args.quick else 1_000_000, args.object_mib)
    threads = tier["num_threads"]
    rows = [
        ("stores (write)", roof["write"], tier["store"], 0.80, min(threads, tier["store_batch_objects"])),
        ("stores, no fsync", roof["write"], fast["store"], 0.80, min(threads, fast["store_batch_objects"])),
        ("loads (read)", roof["read"], tier["load"], 0.90, min(threads, tier["load_batch_objects"])),
    ]
    print(f"disk tier on {args.dir}: {num_mib} MiB, blocks of {tier['block_bytes']} B, "
          f"{tier['blocks_per_object']} per object of {tier['object_bytes'] / (1 << 20):.2f} MiB "
          f"({tier['object_bytes']} B); stores {tier['store_batch_objects']} objects per flush, loads "
          f"{tier['load_batch_objects']} objects per prompt, {threads} threads each way; roofline by "
          f"{roof['tool']} O_DIRECT, one stream, the better of 1 MiB and object-size requests; each figure the best "
          f"of {args.repeats} runs")  # fmt: skip
    print(f"{'':16} {'object MiB':>10} {'in flight':>9} {'roofline GB/s':>14} {'radixkv GB/s':>13} {'ratio':>6} "
          f"{'target':>7}")  # fmt: skip
    for name, roof_bw, bw, target, in_flight in rows:
        ratio = float(bw) / float(roof_bw)
        print(f"{name:16} {tier['object_bytes'] / (1 << 20):10.2f} {in_flight:9d} {float(roof_bw) / GB:14.3f} "
              f"{float(bw) / GB:13.3f} {ratio:6.2f} {target:7.2f}")  # fmt: skip
    detail = ", ".join(f"{k} {float(v) / GB:.3f}" for k, v in roof.items() if "_" in k)
    print(f"roofline requests (GB/s): {detail}")
    print(f"index rebuild from the directory alone: {index['num_objects']:,} objects, {index['num_blocks']:,} blocks "
          f"in {index['seconds']:.2f} s = {index['seconds_per_million_blocks']:.1f} s per million blocks "
          "(synthesized headers, page cache warm)")  # fmt: skip
    if args.out:
        result = {"roofline": roof, "tier": tier, "tier_no_fsync": fast, "rebuild": index, "num_mib": num_mib}
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
