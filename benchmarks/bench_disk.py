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

from radixkv.disk.object_format import OBJECT_SUFFIX, encode_header, object_bytes
from radixkv.disk.shape import disk_shape
from radixkv.disk.store import DiskStore
from radixkv.memory.layout import PoolLayout
from radixkv.tree.block_hash import chain_hashes

LAYOUT = PoolLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=1, dtype="bfloat16")
GB = 1e9


def roofline(directory: Path, num_mib: int) -> dict[str, float | str]:
    """The device's O_DIRECT write and read bandwidth (bytes/s) on `directory`, 1 MiB requests."""
    path = directory / "roofline.bin"
    try:
        if shutil.which("fio"):
            return {"tool": "fio", **{rw: _fio(path, rw, num_mib) for rw in ("write", "read")}}
        write = _dd(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={num_mib}", "oflag=direct", "conv=fsync"])
        read = _dd(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
        return {"tool": "dd", "write": write, "read": read}
    finally:
        path.unlink(missing_ok=True)


def _dd(cmd: list[str]) -> float:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", out)
    assert m, f"unexpected dd output: {out}"
    return int(m.group(1)) / float(m.group(2))


def _fio(path: Path, rw: str, num_mib: int) -> float:
    out = subprocess.run(
        ["fio", "--name=roof", f"--filename={path}", f"--rw={rw}", "--bs=1M", f"--size={num_mib}M", "--direct=1",
         "--ioengine=psync", "--numjobs=1", "--iodepth=1", "--output-format=json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = json.loads(out)["jobs"][0][rw]
    return float(job["bw_bytes"])


def radixkv_tier(directory: Path, num_mib: int, object_mib: float, durable: bool) -> dict[str, float]:
    shape = disk_shape(LAYOUT)
    bb = shape.bytes_per_block
    num_blocks = num_mib * (1 << 20) // bb
    store = DiskStore(directory / "tier", shape, 1 << 40, target_object_bytes=int(object_mib * (1 << 20)),
                      durable=durable)  # fmt: skip
    store.open()
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (num_blocks, bb), dtype=np.uint8)
    hashes = chain_hashes(rng.integers(0, 50_000, num_blocks * LAYOUT.block_size).tolist(), LAYOUT.block_size)
    batch = store.blocks_per_object * 16  # what one writer flush hands the store at once
    began = time.perf_counter()
    for i in range(0, num_blocks, batch):
        store.put("", hashes[i : i + batch], blocks[i : i + batch])
    store_s = time.perf_counter() - began
    assert len(store) == num_blocks, "every block was stored"
    began = time.perf_counter()
    for i in range(0, num_blocks, batch):
        got = store.read(hashes[i : i + batch])
        assert len(got) == min(batch, num_blocks - i), "every block read back and verified"
    load_s = time.perf_counter() - began
    object_bytes = next(iter(store._objects.values())).file_bytes
    store.close()
    shutil.rmtree(directory / "tier")
    return {
        "block_bytes": bb, "blocks_per_object": store.blocks_per_object, "object_bytes": object_bytes,
        "num_blocks": num_blocks, "store": num_blocks * bb / store_s, "load": num_blocks * bb / load_s,
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    num_mib = 256 if args.quick else 2048
    with tempfile.TemporaryDirectory(prefix="bench-disk-", dir=args.dir) as tmp:
        roof = roofline(Path(tmp), num_mib)
        tier = radixkv_tier(Path(tmp), num_mib, args.object_mib, durable=True)
        fast = radixkv_tier(Path(tmp), num_mib, args.object_mib, durable=False)
        index = rebuild(Path(tmp), 100_000 if args.quick else 1_000_000, args.object_mib)
    rows = [
        ("stores (write)", roof["write"], tier["store"], 0.80),
        ("stores, no fsync", roof["write"], fast["store"], 0.80),
        ("loads (read)", roof["read"], tier["load"], 0.90),
    ]
    print(f"disk tier on {args.dir}: {num_mib} MiB, blocks of {tier['block_bytes']} B, "
          f"{tier['blocks_per_object']} per object of {tier['object_bytes'] / (1 << 20):.2f} MiB; "
          f"roofline by {roof['tool']} O_DIRECT 1 MiB")  # fmt: skip
    print(f"{'':16} {'roofline GB/s':>14} {'radixkv GB/s':>13} {'ratio':>6} {'target':>7}")
    for name, roof_bw, bw, target in rows:
        ratio = float(bw) / float(roof_bw)
        print(f"{name:16} {float(roof_bw) / GB:14.3f} {float(bw) / GB:13.3f} {ratio:6.2f} {target:7.2f}")
    print(f"index rebuild from the directory alone: {index['num_objects']:,} objects, {index['num_blocks']:,} blocks "
          f"in {index['seconds']:.2f} s = {index['seconds_per_million_blocks']:.1f} s per million blocks "
          "(synthesized headers, page cache warm)")  # fmt: skip
    if args.out:
        result = {"roofline": roof, "tier": tier, "tier_no_fsync": fast, "rebuild": index, "num_mib": num_mib}
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
