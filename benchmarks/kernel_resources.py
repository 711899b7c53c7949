"""What the decode kernels cost an SM, from the kernels compiled for a GPU this machine need not have.

Compiles `paged_decode_attention`'s launches (`radixkv.kernels.paged_decode_attention.decode_launches`, the
launcher's own arguments and constexprs) for a CUDA target, sm_90 by default, through Triton's normal
compile path: `JITFunction.warmup` under a stand-in driver that names the target (the only part of a
driver compiling needs), then Triton's bundled ptxas, whose `-v` report gives registers and spills. Per
kernel it prints registers, spill bytes, shared memory, the byte-wide shared-memory loads in the PTX
(`ld.shared.b8`/`u8`: an 8-bit operand read one byte at a time), and the theoretical occupancy: programs
(CTAs) per SM under the register, shared-memory and warp limits of the target, and which one binds.
No GPU is touched; on a GPU machine the figures are the same.

    python benchmarks/kernel_resources.py --quick
    python benchmarks/kernel_resources.py --configs --out results/kernel_resources.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's (read when triton is imported)

import torch  # noqa: E402
import triton  # noqa: E402
from bench_paged_decode_attention import SHAPES  # noqa: E402  (a script beside this one)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402

from radixkv.kernels import DecodeConfig, plan_decode  # noqa: E402
from radixkv.kernels.decode_plan import decode_config  # noqa: E402
from radixkv.kernels.paged_decode_attention import decode_launches  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 32, 8, 16  # Llama-3-8B's attention, as the decode benchmark
RAGGED = "ragged 256x100-8k"  # the batch issue 34 set fp8's target on
KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """An SM's occupancy limits (CUDA occupancy calculator figures): registers are allocated per warp in units
    of 256, within one of 4 sub-partitions; each CTA reserves 1 KiB of shared memory beyond its own."""

    num_sms: int
    shared_bytes: int
    max_warps: int
    max_ctas: int = 32
    registers: int = 65536
    sub_partitions: int = 4
    reserved_shared: int = 1024


ARCHS = {
    80: SmLimits(num_sms=108, shared_bytes=164 * 1024, max_warps=64),  # A100
    89: SmLimits(num_sms=128, shared_bytes=100 * 1024, max_warps=48, max_ctas=24),  # L40S, RTX 4090
    90: SmLimits(num_sms=132, shared_bytes=228 * 1024, max_warps=64),  # H100 SXM, H200
}


def shapes(quick: bool) -> dict[str, list[int]]:
    """The decode benchmark's batches (gpu_check.sh times them); --quick: the ragged 256-sequence one only."""
    return {RAGGED: SHAPES[RAGGED]} if quick else SHAPES


class StandInDriver(DriverBase):
    """Names the compile target and nothing else: a launch through it fails, `warmup` compiles."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a stand-in driver launches nothing")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def get_benchmarker(self):
        raise NotImplementedError("a stand-in driver times nothing")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def compile_launch(launch, cache: dict) -> dict:
    """Compile one launch; registers and spills from ptxas's own report of it (Triton prints it when asked)."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
    if kernel.hash not in cache:  # a kernel compiled before in this process was not assembled again: no report
        report = log.getvalue()
        registers = re.search(r"Used (\d+) registers", report)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        ptx = kernel.asm["ptx"]
        cache[kernel.hash] = dict(
            kernel=kernel.name,
            registers=int(registers.group(1)) if registers else None,
            spill_store_bytes=int(spills.group(1)) if spills else None,
            spill_load_bytes=int(spills.group(2)) if spills else None,
            shared_bytes=kernel.metadata.shared,
            num_warps=kernel.metadata.num_warps,
            byte_shared_loads=len(re.findall(r"ld\.shared\.[us]8|ld\.shared\.b8", ptx)),
        )
    return dict(cache[kernel.hash])


def occupancy(registers: int | None, shared_bytes: int, num_warps: int, sm: SmLimits) -> tuple[int, str]:
    """(CTAs per SM, the limit that binds) for one kernel."""
    limits = {"warps": sm.max_warps // num_warps, "ctas": sm.max_ctas}
    if registers is not None:
        per_warp = math.ceil(registers * 32 / 256) * 256
        limits["registers"] = sm.sub_partitions * (sm.registers // sm.sub_partitions // per_warp) // num_warps
    limits["shared memory"] = sm.shared_bytes // (shared_bytes + sm.reserved_shared)
    binding = min(limits, key=lambda k: limits[k])
    return limits[binding], binding


def resource_rows(
    shape: str, lens: list[int], kv_name: str, head_dim: int, arch: int, cache: dict, config: DecodeConfig | None
) -> list[dict]:
    """One row per launch of a decode step over `lens` (meta tensors: shapes and strides, no memory)."""
    kv_dtype, sm = KV_DTYPES[kv_name], ARCHS[arch]
    q_dtype = torch.float16 if kv_dtype.itemsize == 1 else kv_dtype
    meta = dict(device="meta")
    q = torch.empty(len(lens), NUM_Q_HEADS, head_dim, dtype=q_dtype, **meta)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens)
    kv_layer = torch.empty(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=kv_dtype, **meta)
    tables = torch.empty(len(lens), -(-max(lens) // BLOCK_SIZE), dtype=torch.int32, **meta)
    seq_lens = torch.empty(len(lens), dtype=torch.int32, **meta)
    kv_scales = torch.empty(2, dtype=torch.float32, **meta) if kv_dtype.itemsize == 1 else None
    plan = plan_decode(
        lens,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        cache_dtype=kv_dtype,
        device="meta",
        num_sms=sm.num_sms,
        config=config,
    )
    out = torch.empty_like(q)
    launches = decode_launches(q, kv_layer, tables, seq_lens, out, head_dim**-0.5, plan, kv_scales=kv_scales)
    rows = []
    for launch in launches:
        row = compile_launch(launch, cache)
        ctas, binding = occupancy(row["registers"], row["shared_bytes"], row["num_warps"], sm)
        c = plan.config
        row |= dict(shape=shape, kv_dtype=kv_name, head_dim=head_dim, arch=f"sm_{arch}", num_splits=plan.num_splits)
        row |= dict(tile_n=c.tile_n, config_warps=c.num_warps, num_stages=c.num_stages)
        row |= dict(ctas_per_sm=ctas, warps_per_sm=ctas * row["num_warps"], bound_by=binding)
        rows.append(row)
    return rows


def neighbours(head_dim: int, kv_dtype: torch.dtype) -> list[DecodeConfig]:
    """The default config and its neighbours (tile x2 and /2, stages 3-5, warps 4/8), default first."""
    default = decode_config(head_dim, kv_dtype)
    others = (
        {dataclasses.replace(default, tile_n=t) for t in (default.tile_n // 2, default.tile_n * 2) if 16 <= t <= 256}
        | {dataclasses.replace(default, num_stages=s) for s in (3, 4, 5)}
        | {dataclasses.replace(default, num_warps=w) for w in (4, 8)}
    ) - {default}
    return [default, *sorted(others, key=dataclasses.astuple)]


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'kernel':<20}{'shape':<19}{'kv':>9}{'D':>4}{'tile/w/st':>10}{'regs':>6}{'spill B':>8}{'smem KiB':>9}"
        f"{'ld.b8':>6}{'CTA/SM':>7}{'warps':>6}  bound by"
    )
    print(head)
    for r in rows:
        spills = None if r["spill_store_bytes"] is None else r["spill_store_bytes"] + r["spill_load_bytes"]
        config = f"{r['tile_n']}/{r['config_warps']}/{r['num_stages']}" if "split" in r["kernel"] else "-"
        print(
            f"{r['kernel'].removeprefix('decode_'):<20}{r['shape']:<19}{r['kv_dtype']:>9}{r['head_dim']:>4}"
            f"{config:>10}{r['registers'] if r['registers'] is not None else 'n/a':>6}"
            f"{spills if spills is not None else 'n/a':>8}{r['shared_bytes'] / 1024:>9.1f}{r['byte_shared_loads']:>6}"
            f"{r['ctas_per_sm']:>7}{r['warps_per_sm']:>6}  {r['bound_by']}"
        )
    print("tile/w/st = tokens per K/V tile / warps / pipeline stages; spill B = spill store + load bytes per thread;")
    print("ld.b8 = byte-wide shared-memory loads in the PTX; CTA/SM = programs per SM (theoretical occupancy)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(ARCHS), help="compute capability x10")
    parser.add_argument("--quick", action="store_true", help="the ragged batch, fp16 and fp8, head_dim 128")
    parser.add_argument("--configs", action="store_true", help="also each neighbour of the default tile configs")
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    triton.runtime.driver.set_active(StandInDriver(args.arch))
    cache: dict = {}
    rows: list[dict] = []
    kv_names = ["float16", "fp8"] if args.quick else list(KV_DTYPES)
    with tempfile.TemporaryDirectory() as cache_dir:
        # A fresh cache: a kernel found on disk is not assembled, and ptxas's report is what gives registers.
        triton.knobs.cache.dir = cache_dir
        triton.knobs.nvidia.dump_ptxas_log = True
        for shape, lens in shapes(args.quick).items():
            for kv in kv_names:
                rows += resource_rows(shape, lens, kv, 128, args.arch, cache, None)
        if not args.quick:
            ragged = SHAPES[RAGGED]
            for head_dim in (64, 256):
                for kv in ("float16", "fp8"):
                    rows += resource_rows(RAGGED, ragged, kv, head_dim, args.arch, cache, None)
        config_rows: list[dict] = []
        if args.configs:
            ragged = SHAPES[RAGGED]
            for head_dim in (64, 128, 256):
                for kv in ("float16", "fp8"):
                    for config in neighbours(head_dim, KV_DTYPES[kv]):
                        found = resource_rows(RAGGED, ragged, kv, head_dim, args.arch, cache, config)
                        config_rows += [r for r in found if "split" in r["kernel"]]
    print(
        f"decode kernels compiled for sm_{args.arch} (Triton {triton.__version__}); GQA {NUM_Q_HEADS}/{NUM_KV_HEADS}, "
        f"block {BLOCK_SIZE}, {ARCHS[args.arch].num_sms} SMs for the plan"
    )
    print_table(rows)
    if config_rows:
        print("\nthe split kernel under each neighbour of the default config (the first row of each group):")
        print_table(config_rows)
    print(f"{time.perf_counter() - start:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"arch": args.arch, "triton": triton.__version__, "rows": rows, "configs": config_rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
