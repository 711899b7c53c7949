"""Benchmark kernels.swap_blocks: moving scattered whole blocks between a device pool and a host-tier pool.

Each case copies N randomly scattered blocks (every layer's K and V) one way, and compares in the same run:
- `swap_blocks`: one call (CPU: one strided copy_ per block; CUDA: one Triton launch reading / writing
  pinned host memory directly, on a side stream, timed to its event);
- `index_copy_`: index_select of the source blocks then index_copy_ into the destination, along the block
  axis (`swap_blocks_reference`; on CUDA through a device-side gather and a staged transfer);
- a per-block loop of `copy_` calls from Python (on CPU what `swap_blocks` runs; on CUDA one strided
  transfer per block, through torch's staging);
- a contiguous copy of the same number of bytes (`copy_` of one buffer): the ceiling for this memory.
Reported as GB/s and as ratios. CPU figures are memory-bandwidth figures of this machine, not PCIe figures.

    python benchmarks/bench_swap_blocks.py --quick
    python benchmarks/bench_swap_blocks.py --out results/swap_blocks.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch

from radixkv.kernels import swap_blocks, swap_blocks_reference

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Llama-3-8B's K/V per layer, block 16
FULL = {"num_layers": 32, "num_blocks": [16, 128, 512]}  # 2 MiB per fp16 block: 32 MiB to 1 GiB moved
QUICK = {"num_layers": 4, "num_blocks": [16, 64]}  # 256 KiB per block


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` runs after one warm-up, in seconds (CUDA: synchronised around each run): on a shared
    machine the minimum is the least disturbed."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if isinstance(result, torch.cuda.Event):
            result.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def run_case(num_layers: int, num_blocks: int, direction: str, device: torch.device, repeats: int) -> dict:
    shape = (num_layers, 2, num_blocks * 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    device_pool = torch.randn(shape, device=device).half()
    host_pool = torch.randn(shape).half()
    if device.type == "cuda":
        host_pool = host_pool.pin_memory()
    src, dst = (device_pool, host_pool) if direction == "offload" else (host_pool, device_pool)
    gen = torch.Generator().manual_seed(num_blocks)
    pairs = torch.stack([torch.randperm(shape[2], generator=gen)[:num_blocks] for _ in range(2)], dim=1)
    pair_list = pairs.tolist()
    num_bytes = num_blocks * src[:, :, 0].numel() * src.element_size()

    def loop() -> None:
        for s, d in pair_list:
            dst[:, :, d].copy_(src[:, :, s], non_blocking=True)

    flat_src, flat_dst = src.view(-1)[: num_bytes // 2], dst.view(-1)[: num_bytes // 2]
    seconds = {
        "index_copy_": timed(lambda: swap_blocks_reference(src, dst, pairs), device, repeats),
        "per-block loop": timed(loop, device, repeats),
        "contiguous copy": timed(lambda: flat_dst.copy_(flat_src, non_blocking=True), device, repeats),
        "swap_blocks": timed(lambda: swap_blocks(src, dst, pairs), device, repeats),  # last: checked below
    }
    expected = src[:, :, pairs[:, 0].to(src.device)].cpu()
    assert torch.equal(dst[:, :, pairs[:, 1].to(dst.device)].cpu(), expected), "swap_blocks copied wrong bytes"
    return {
        "direction": direction,
        "num_layers": num_layers,
        "num_blocks": num_blocks,
        "bytes": num_bytes,
        "gb_per_s": {name: num_bytes / s / 1e9 for name, s in seconds.items()},
        "speedup_vs_loop": seconds["per-block loop"] / seconds["swap_blocks"],
        "speedup_vs_index_copy": seconds["index_copy_"] / seconds["swap_blocks"],
        "fraction_of_contiguous": seconds["contiguous copy"] / seconds["swap_blocks"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 layers, 16 and 64 blocks (well under 30 s)")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = QUICK if args.quick else FULL
    rows = [
        run_case(sizes["num_layers"], n, direction, device, args.repeats)
        for n in sizes["num_blocks"]
        for direction in ("offload", "load")
    ]
    print(
        f"swap_blocks on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor()})"
    )
    print(f"{'direction':<9} {'blocks':>6} {'MiB':>7} {'swap GB/s':>10} {'index GB/s':>11} {'loop GB/s':>10} "
          f"{'memcpy GB/s':>12} {'x index':>8} {'x loop':>7} {'of memcpy':>10}")  # fmt: skip
    for r in rows:
        g = r["gb_per_s"]
        print(
            f"{r['direction']:<9} {r['num_blocks']:>6} {r['bytes'] / 2**20:>7.1f} {g['swap_blocks']:>10.2f} "
            f"{g['index_copy_']:>11.2f} {g['per-block loop']:>10.2f} {g['contiguous copy']:>12.2f} "
            f"{r['speedup_vs_index_copy']:>8.2f} {r['speedup_vs_loop']:>7.2f} {r['fraction_of_contiguous']:>10.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "quick": args.quick, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
