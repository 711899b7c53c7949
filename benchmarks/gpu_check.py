"""The GPU check: the kernels on a lent GPU, as one table. Run it through `benchmarks/gpu_check.sh`.

Needs the image's own Python with torch, triton and numpy, nothing installed: it imports the kernels from
the checkout through `benchmarks/from_checkout` (the script puts it first on PYTHONPATH). Each section runs
in its own process with its own time limit, so a crash, a hang or a sticky CUDA error fails that section's
row and the others still run; the whole check stops at `--budget-s` (300 s by default). Sections:

- correctness: each kernel on CUDA against a float64 reference: store_kv, copy_blocks, swap_blocks and
  paged_decode_attention (one split and several), fp16, bf16 and fp8 KV with scales;
- sync: a whole decode step (step_tensors from numpy, swap, copy-on-write, store, plan, attention) under
  `torch.cuda.set_sync_debug_mode("error")`, so any hidden host sync fails loudly;
- ipc: a pool exported by CUDA IPC to a second process, which reads it and writes into it;
- swap: pinning host memory (cudaHostRegister, as the host tier pins), and `swap_blocks` bandwidth device ->
  pinned host and back against a contiguous copy of the same bytes;
- bandwidth: decode K/V bytes per second as a fraction of the device's peak (from its name, or
  `--peak-gbps`), 64x4k fp16, 1x32k, 256 sequences of 100-8,000 tokens, 1x128k + 31x1k, fp16 and fp8; CUDA
  events, a warm-up, the L2 cleared before each call (bench_paged_decode_attention.time_us);
- tests: `pytest -m gpu tests/kernels`, when the image has pytest, in what time is left.

`--smoke` runs every section on the CPU (Triton's interpreter, tiny shapes), so the script itself is tested
where there is no GPU; rows that need CUDA say so. Exit status: 0 when no row failed (targets missed are
reported, not failed), 1 otherwise, 2 on a usage error or no CUDA without --smoke.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("correctness", "sync", "ipc", "swap", "bandwidth", "tests")
BANDWIDTH_SHAPES = ("64x4k", "1x32k", "ragged 256x100-8k", "ragged 1x128k+31x1k")
SMOKE_SHAPES = {"ragged 1x256+3x32": [256, 32, 32, 32]}  # --smoke: one small ragged batch runs the section's code
# (shape, kv dtype, what, wanted): issue 18's fractions of peak bandwidth, issue 34's fp8 speed-up.
TARGETS = [
    ("64x4k", "float16", "peak_fraction", 0.80),
    ("1x32k", "float16", "peak_fraction", 0.60),
    ("ragged 1x128k+31x1k", "float16", "peak_fraction", 0.60),
    ("ragged 256x100-8k", "fp8", "fp8_over_fp16", 1.7),
]


# ---------------------------------------------------------------------------------------------------- rows


class Rows(list):
    """The rows of one section: `with rows.check(name):` turns an exception into that check's ERROR row. With a
    `path`, every row is written there as it is added, so a section that dies later still reports it."""

    def __init__(self, section: str, path: str | None = None) -> None:
        super().__init__()
        self.section, self.path = section, path

    def add(self, check: str, figure: str, status: str = "ok", **values: object) -> None:
        self.append(dict(section=self.section, check=check, figure=figure, status=status, **values))
        if self.path:
            Path(self.path).write_text(json.dumps(self))

    @contextlib.contextmanager
    def check(self, name: str):
        try:
            yield
        except Exception as exc:  # one check's failure is its row, never the section's end
            self.add(name, f"{type(exc).__name__}: {str(exc)[:300]}", "ERROR", trace=traceback.format_exc()[-2000:])


def max_error(actual, expected) -> float:
    return float((actual.double() - expected.double()).abs().max()) if actual.numel() else 0.0


# ---------------------------------------------------------------------------------------------------- correctness


def reference_attention(q, kv_layer, tables, lens: list[int], scale: float, kv_scales):
    """Decode attention in float64, one sequence at a time, from the pool's stored values (dequantized)."""
    import torch

    k_scale, v_scale = kv_scales.double().tolist() if kv_scales is not None else (1.0, 1.0)
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)  # [num_seqs, num_q_heads, head_dim]
    for i, n in enumerate(lens):
        if n == 0:
            continue
        blocks = tables[i, : -(-n // block_size)].long()
        k = kv_layer[0, blocks].flatten(0, 1)[:n].double() * k_scale  # [n, num_kv_heads, head_dim]
        v = kv_layer[1, blocks].flatten(0, 1)[:n].double() * v_scale
        qi = q[i].double().reshape(num_kv_heads, -1, q.shape[-1])  # [num_kv_heads, group, head_dim]
        probs = (qi @ k.permute(1, 2, 0) * scale).softmax(-1)  # [num_kv_heads, group, n]
        out[i] = (probs @ v.transpose(0, 1)).reshape(q.shape[1:])
    return out


def correctness(rows: Rows, device, smoke: bool) -> None:
    import torch

    from radixkv.kernels import copy_blocks, paged_decode_attention, plan_decode, quantize_fp8, store_kv, swap_blocks

    fp8 = torch.float8_e4m3fn
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": fp8}
    gen = torch.Generator().manual_seed(0)
    if smoke:  # the interpreter: small shapes; numpy (its arithmetic) has no bfloat16
        heads, head_dim, lens = (8, 2), 64, [1, 17, 700]
        rows.add("bfloat16 kernels", "the interpreter has no bfloat16", "skip")
        dtypes.pop("bfloat16")
    else:
        heads, head_dim, lens = (32, 8), 128, [1, 17, 300, 2049, 5000]
    num_q_heads, num_kv_heads = heads
    block_size = 16
    for name, kv_dtype in dtypes.items():
        q_dtype = torch.float16 if kv_dtype == fp8 else kv_dtype
        scales = torch.tensor([0.02, 0.02], device=device) if kv_dtype == fp8 else None
        with rows.check(f"store_kv {name}"):
            key = torch.randn(40, num_kv_heads, head_dim, generator=gen).to(q_dtype).to(device)
            value = torch.randn(40, num_kv_heads, head_dim, generator=gen).to(q_dtype).to(device) * 0.04
            kv_layer = torch.zeros(2, 8, block_size, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
            slots = torch.randperm(8 * block_size, generator=gen)[:40].to(device)
            store_kv(key, value, kv_layer, slots, kv_scales=scales)
            stored = kv_layer.flatten(1, 2)[:, slots]  # [2, 40, num_kv_heads, head_dim]
            if kv_dtype == fp8:  # within e4m3's half step of the float64 quotient, and torch's rounding
                wanted = torch.stack([key.double(), value.double()]).clamp(-448 * 0.02, 448 * 0.02) / 0.02
                err = float(((stored.double() - wanted).abs() / wanted.abs().clamp(min=2**-6)).max())
                # torch's quantize_fp8 rounds the same fp32 quotient: a rare tie may land on the neighbouring code
                codes, torchs = stored[0].view(torch.int8).long(), quantize_fp8(key, scales[0]).view(torch.int8).long()
                agree, apart = float((codes == torchs).float().mean()), int((codes - torchs).abs().max())
                figure = f"max rel err {err:.3g} vs float64 (e4m3 half step 0.0625); {agree:.2%} of codes as torch's"
                rows.add(f"store_kv {name}", figure, "ok" if err <= 2**-4 and agree > 0.999 and apart <= 1 else "FAIL")
            else:
                ok = torch.equal(stored[0], key) and torch.equal(stored[1], value)
                rows.add(f"store_kv {name}", "bit-exact" if ok else "differs", "ok" if ok else "FAIL")
        with rows.check(f"copy_blocks {name}"):
            pool = torch.randn(2, 2, 10, block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype).to(device)
            before = pool.clone()
            pairs = [(1, 7), (3, 2), (9, 0)]
            copy_blocks(pool, pairs)
            ok = all(torch.equal(pool[:, :, d].view(torch.uint8), before[:, :, s].view(torch.uint8)) for s, d in pairs)
            rows.add(f"copy_blocks {name}", "bit-exact" if ok else "differs", "ok" if ok else "FAIL")
        with rows.check(f"swap_blocks {name}"):
            pool = torch.randn(2, 2, 10, block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype).to(device)
            host = torch.zeros(2, 2, 6, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
            host = host.pin_memory() if device.type == "cuda" else host
            done = swap_blocks(pool, host, [(4, 1), (8, 5)])
            if done is not None:
                done.synchronize()
            back = swap_blocks(host, pool, [(1, 0), (5, 2)])
            if back is not None:
                back.synchronize()
            bits = pool.view(torch.uint8)
            ok = torch.equal(bits[:, :, 0], bits[:, :, 4]) and torch.equal(bits[:, :, 2], bits[:, :, 8])
            where = "device -> pinned host -> device" if device.type == "cuda" else "CPU pools"
            rows.add(f"swap_blocks {name}", f"bit-exact, {where}" if ok else "differs", "ok" if ok else "FAIL")
        for splits in (1, None):
            label = f"paged_decode_attention {name} {'1 split' if splits == 1 else 'planned splits'}"
            with rows.check(label):
                batch = decode_batch(lens, heads, head_dim, block_size, kv_dtype, q_dtype, gen, device)
                plan = plan_decode(
                    lens,
                    num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    cache_dtype=kv_dtype,
                    device=device,
                    num_splits=splits,
                    num_sms=8 if smoke else None,
                )
                out = paged_decode_attention(*batch, head_dim**-0.5, kv_scales=scales, plan=plan)
                ref = reference_attention(*batch[:3], lens, head_dim**-0.5, scales)
                atol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[q_dtype]
                err, bound = max_error(out, ref), float((atol + atol * ref.abs()).max())
                ok = err <= bound and not torch.isnan(out).any()
                figure = f"max |err| {err:.2g} vs float64 (tol {atol:g} + rel), {plan.num_splits} split(s)"
                rows.add(label, figure, "ok" if ok else "FAIL", max_abs_error=err)


def decode_batch(lens, heads, head_dim, block_size, kv_dtype, q_dtype, gen, device) -> tuple:
    """(q, kv_layer, block_tables, seq_lens): each sequence's blocks scattered over a pool with spare blocks."""
    import torch

    from radixkv.kernels import quantize_fp8

    num_q_heads, num_kv_heads = heads
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    for i, count in enumerate(counts):
        block_tables[i, :count] = torch.tensor(order[sum(counts[:i]) : sum(counts[: i + 1])], dtype=torch.int32)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    fp8 = kv_dtype == torch.float8_e4m3fn
    kv_layer = quantize_fp8(kv * 0.02 * 3, 0.02) if fp8 else kv.to(kv_dtype)  # fp8: stored values ~ N(0, 3)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, kv_layer, block_tables, seq_lens))


# ---------------------------------------------------------------------------------------------------- sync


def sync(rows: Rows, device, smoke: bool) -> None:
    """A decode step as a worker runs it, from the host arrays the hand-off delivers, checked for host syncs."""
    import numpy as np
    import torch

    class Step:  # radixkv.sequences.handoff.StepArrays' fields; the core is not on a bare image
        def __init__(self, lens: list[int], block_size: int) -> None:
            width = max(-(-n // block_size) for n in lens)
            self.block_tables = np.arange(len(lens) * width, dtype=np.int32).reshape(len(lens), width)
            last = np.array(lens) - 1
            row_blocks = self.block_tables[np.arange(len(lens)), last // block_size].astype(np.int64)
            self.slots = row_blocks * block_size + last % block_size
            self.seq_lens = np.array(lens, dtype=np.int32)
            self.seq_ids = np.arange(len(lens), dtype=np.int64)
            self.query_starts = np.arange(len(lens) + 1, dtype=np.int32)
            spare = len(lens) * width
            self.copies = np.array([[spare, spare + 1]], dtype=np.int64)

    lens, num_q_heads, num_kv_heads, head_dim = (
        ([97, 3, 40, 17], 8, 2, 64) if smoke else ([4097, 3, 1000, 17], 32, 8, 128)
    )
    block_size, num_layers = 16, 2
    step = Step(lens, block_size)
    num_blocks = step.block_tables.size + 4
    shape = (block_size, num_kv_heads, head_dim)
    for name, kv_dtype in (("float16", torch.float16), ("fp8", torch.float8_e4m3fn)):
        label = f"decode step {name}: step_tensors, swap, copy, store, plan, attention"
        with rows.check(label):
            pool = torch.randn(num_layers, 2, num_blocks, *shape, device=device).to(kv_dtype)
            host = torch.zeros(num_layers, 2, 4, *shape, dtype=kv_dtype)
            host = host.pin_memory() if device.type == "cuda" else host
            scales = torch.tensor([0.5, 0.5], device=device) if kv_dtype == torch.float8_e4m3fn else None
            key = torch.randn(len(lens), num_kv_heads, head_dim, dtype=torch.float16, device=device)
            q = torch.randn(len(lens), num_q_heads, head_dim, dtype=torch.float16, device=device)

            def run(pool=pool, host=host, key=key, q=q, scales=scales, kv_dtype=kv_dtype) -> list:
                return decode_step(step, lens, pool, host, key, q, scales, kv_dtype, device)

            run()  # compiles outside the checked region
            if device.type != "cuda":
                run()
                rows.add(label, "ran on CPU; the sync check needs CUDA", "skip")
                continue
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            finite = all(bool(torch.isfinite(o).all()) for o in outs)
            rows.add(label, "no host sync under set_sync_debug_mode('error')", "ok" if finite else "FAIL")


def decode_step(step, lens, pool, host, key, q, scales, kv_dtype, device) -> list:
    """What a worker does in one decode step, every layer: host arrays in, attention out."""
    from radixkv.kernels import copy_blocks, paged_decode_attention, plan_decode, step_tensors, store_kv, swap_blocks

    t = step_tensors(step, device)
    done = swap_blocks(pool, host, [(pool.shape[2] - 1, 0)])  # an offload, as the step's first move
    if done is not None:
        done.wait()
    copy_blocks(pool, step.copies)
    num_kv_heads, head_dim = pool.shape[4:]
    plan = plan_decode(
        lens, num_q_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim, cache_dtype=kv_dtype, device=device
    )
    outs = []
    for layer in range(pool.shape[0]):
        store_kv(key, key, pool[layer], t.slots, kv_scales=scales)
        outs.append(
            paged_decode_attention(
                q, pool[layer], t.block_tables, t.seq_lens, head_dim**-0.5, kv_scales=scales, plan=plan
            )
        )
    return outs


# ---------------------------------------------------------------------------------------------------- ipc


def _ipc_child(queue, replies) -> None:
    """The second process: map the pool from its CUDA IPC handle, check the exporter's data, write block 3."""
    import torch

    pool, expected_sum = queue.get(timeout=60)
    seen = float(pool[:, :, 1].double().sum())
    pool[:, :, 3].fill_(7.0)
    torch.cuda.synchronize()
    replies.put((seen, expected_sum))
    queue.get(timeout=60)  # the exporter has checked the write: the mapping may go


def ipc(rows: Rows, device, smoke: bool) -> None:
    if device.type != "cuda":
        rows.add("CUDA IPC export/import of a pool", "needs CUDA", "skip")
        return
    import torch
    import torch.multiprocessing as mp

    with rows.check("CUDA IPC export/import of a pool"):
        pool = torch.randn(2, 2, 8, 16, 8, 128, device=device, dtype=torch.float16)  # [layers, K/V, blocks, ...]
        ctx = mp.get_context("spawn")
        queue, replies = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_ipc_child, args=(queue, replies))
        child.start()
        start = time.perf_counter()
        queue.put((pool, float(pool[:, :, 1].double().sum())))
        seen, expected = replies.get(timeout=120)
        seconds = time.perf_counter() - start
        torch.cuda.synchronize()
        wrote = bool((pool[:, :, 3] == 7.0).all())
        queue.put("done")
        child.join(timeout=60)
        ok = math.isclose(seen, expected, rel_tol=1e-9) and wrote and child.exitcode == 0
        figure = f"the child read the pool and wrote into it; {seconds * 1e3:.0f} ms round trip (its start included)"
        rows.add("CUDA IPC export/import of a pool", figure, "ok" if ok else "FAIL")


# ---------------------------------------------------------------------------------------------------- swap


def swap(rows: Rows, device, smoke: bool) -> None:
    import bench_swap_blocks
    import torch

    if device.type == "cuda":
        with rows.check("pin 1 GiB of host memory (cudaHostRegister)"):
            buffer = torch.empty(2**30, dtype=torch.uint8)
            buffer.fill_(1)  # the pages exist before they are pinned, as a host tier's do
            cudart = torch.cuda.cudart()
            start = time.perf_counter()
            code = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1 | 2)  # portable | mapped: as KVStorage
            seconds = time.perf_counter() - start
            cudart.cudaHostUnregister(buffer.data_ptr())
            status = "ok" if int(code) == 0 else "FAIL"
            rows.add("pin 1 GiB of host memory (cudaHostRegister)", f"{1 / seconds:.1f} GiB/s", status)
    else:
        rows.add("pin host memory", "needs CUDA", "skip")
    num_layers, num_blocks = (32, 256) if device.type == "cuda" else (2, 8)
    for direction, what in (("offload", "device -> pinned host"), ("load", "pinned host -> device")):
        label = f"swap_blocks {what}, {num_blocks} scattered blocks x {num_layers} layers"
        with rows.check(label):
            r = bench_swap_blocks.run_case(num_layers, num_blocks, direction, device, repeats=3)
            gb = r["gb_per_s"]["swap_blocks"]
            note = "" if device.type == "cuda" else " (CPU memory, not a bus)"
            figure = f"{gb:.3g} GB/s, {r['fraction_of_contiguous']:.0%} of one contiguous copy's{note}"
            rows.add(label, figure, gb_per_s=gb)


# ---------------------------------------------------------------------------------------------------- bandwidth


def bandwidth(rows: Rows, device, smoke: bool, peak: float | None) -> None:
    import bench_paged_decode_attention as bench
    import torch

    shapes = SMOKE_SHAPES if smoke else {name: bench.SHAPES[name] for name in BANDWIDTH_SHAPES}
    fp16_us: dict[str, float] = {}
    for shape, lens in shapes.items():
        for kv in ("float16", "fp8"):
            label = f"decode {shape} {kv}"
            with rows.check(label):
                inputs = bench.build_inputs(lens, bench.KV_DTYPES[kv], device)
                us = bench.time_us(bench.ours(inputs), device)
                del inputs
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                kv_bytes = 2 * sum(lens) * bench.NUM_KV_HEADS * bench.HEAD_DIM * bench.KV_DTYPES[kv].itemsize
                fraction = kv_bytes / (us * 1e-6) / peak if peak else None
                ratio = fp16_us[shape] / us if kv == "fp8" and shape in fp16_us else None
                fp16_us.update({shape: us} if kv == "float16" else {})
                figure = f"{us:.0f} us, {kv_bytes / us / 1e3:.0f} GB/s"
                figure += f", {fraction:.0%} of peak" if fraction else ("" if smoke else ", peak unknown")
                figure += f", fp8 x{ratio:.2f} fp16 tokens/s" if ratio else ""
                figure += " (CPU torch path: not a bandwidth figure)" if smoke else ""
                status = "ok"
                for t_shape, t_kv, what, wanted in TARGETS:
                    got = {"peak_fraction": fraction, "fp8_over_fp16": ratio}[what]
                    if (t_shape, t_kv) == (shape, kv) and not smoke:
                        figure += f" (target >= {wanted:g})"
                        status = "ok" if got is not None and got >= wanted else "missed"
                rows.add(label, figure, status, us=us, peak_fraction=fraction, fp8_over_fp16=ratio)


# ---------------------------------------------------------------------------------------------------- tests


def tests(rows: Rows, seconds_left: float) -> None:
    if importlib.util.find_spec("pytest") is None:
        rows.add("pytest -m gpu tests/kernels", "pytest is not on this image", "skip")
        return
    with tempfile.TemporaryDirectory() as work, rows.check("pytest -m gpu tests/kernels"):
        junit = Path(work) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
        cmd += ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), f"--junitxml={junit}"]
        cmd += [str(ROOT / "tests" / "kernels")]
        # From a scratch directory: `-m` puts the working directory on sys.path, and the checkout's root would
        # shadow the stand-in radixkv package with the real one (the core, which a bare image cannot import).
        try:
            result = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=max(10, seconds_left))
        except subprocess.TimeoutExpired:  # out of the check's time, which is not a failure of the kernels
            figure = f"stopped after {max(10, seconds_left):.0f} s, the check's time left: run it alone"
            rows.add("pytest -m gpu tests/kernels", figure, "skip")
            return
        counts = dict.fromkeys(("passed", "failure", "error", "skipped"), 0)
        failed = []
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
                counts[outcome] += 1
                if outcome in ("failure", "error"):
                    failed.append(f"{case.get('classname')}::{case.get('name')}")
        bad = counts["failure"] + counts["error"]
        status = "ok" if result.returncode in (0, 5) and bad == 0 else "FAIL"  # 5: nothing collected
        figure = f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped"
        rows.add("pytest -m gpu tests/kernels", figure, status, failed=failed, log=result.stdout[-3000:])


# ---------------------------------------------------------------------------------------------------- driver


def run_section(name: str, args: argparse.Namespace) -> list[dict]:
    rows = Rows(name, args.rows)
    if name == "tests":  # pytest runs in a process of its own: this one needs neither torch nor a CUDA context
        tests(rows, args.seconds_left)
        return rows
    import torch

    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    peak = args.peak_gbps * 1e9 if args.peak_gbps else None
    if name == "bandwidth":
        import bench_paged_decode_attention as bench

        bandwidth(rows, device, args.smoke, peak or bench.peak_bandwidth(device))
    else:
        {"correctness": correctness, "sync": sync, "ipc": ipc, "swap": swap}[name](rows, device, args.smoke)
    return rows


def describe(smoke: bool, peak_gbps: float | None) -> str:
    import bench_paged_decode_attention as bench
    import torch
    import triton

    if smoke:
        where = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        peak = peak_gbps * 1e9 if peak_gbps else bench.peak_bandwidth(device)
        where = f"{torch.cuda.get_device_name(device)}, peak {f'{peak / 1e9:.0f} GB/s' if peak else 'unknown'}"
    return f"{where}; Python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}"


def section_row(name: str, figure: str, status: str = "ERROR", **values: object) -> dict:
    """The row of a section that ran no check of its own (it crashed, hung, or was not started)."""
    return dict(section=name, check="(section)", figure=figure, status=status, **values)


def print_table(rows: list[dict]) -> None:
    width = max(len(r["check"]) for r in rows)
    print(f"{'section':<12} {'check':<{width}} {'status':<7} figure")
    for r in rows:
        print(f"{r['section']:<12} {r['check']:<{width}} {r['status']:<7} {r['figure']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every section on the CPU, tiny shapes (tests the script)")
    parser.add_argument("--out", default="gpu_check.json", help="the rows as JSON (default: gpu_check.json)")
    parser.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth, when its name is unknown")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting sections after this long")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--seconds-left", type=float, default=300.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, here and in every section
    if args.section:
        run_section(args.section, args)  # its rows are in args.rows as they come
        return 0
    sections = [s for s in args.sections.split(",") if s]
    if unknown := sorted(set(sections) - set(SECTIONS)):
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --smoke runs the CPU version", file=sys.stderr)
        return 2
    start = time.monotonic()
    header = describe(args.smoke, args.peak_gbps)
    print(f"gpu_check ({'smoke' if args.smoke else 'gpu'}): {header}", flush=True)  # before the sections' progress
    rows: list[dict] = []
    for name in sections:
        left = args.budget_s - (time.monotonic() - start)
        if left < 15:
            rows.append(section_row(name, f"not started: {args.budget_s:.0f} s spent", "skip"))
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, "--section", name, "--rows", out.name, "--seconds-left", str(left - 10)]
            cmd += ["--smoke"] if args.smoke else []
            cmd += ["--peak-gbps", str(args.peak_gbps)] if args.peak_gbps else []
            section_start = time.monotonic()
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
                problem = None if result.returncode == 0 else f"exit {result.returncode}"
                log = result.stderr
            except subprocess.TimeoutExpired as timeout:
                problem, log = f"still running after {left:.0f} s", timeout.stderr or ""
            found = json.loads(Path(out.name).read_text() or "[]")  # the rows it added before any trouble
            if problem or not found:
                log = log.decode(errors="replace") if isinstance(log, bytes) else log
                tail = log.strip().splitlines()[-1:] or ["no rows, no output"]
                found.append(section_row(name, f"{problem or 'no rows'}: {tail[0][:300]}", log=log[-4000:]))
        for row in found:
            row.setdefault("seconds", round(time.monotonic() - section_start, 1))
        rows += found
        print(f"  {name}: {len(found)} rows in {time.monotonic() - section_start:.0f} s", file=sys.stderr, flush=True)
    seconds = time.monotonic() - start
    print_table(rows)
    failed = [r for r in rows if r["status"] in ("FAIL", "ERROR")]
    missed = [r for r in rows if r["status"] == "missed"]
    verdict = "FAILED" if failed else "ok"
    print(
        f"gpu_check: {verdict} in {seconds:.0f} s; {len(rows)} rows, {len(failed)} failed, {len(missed)} targets missed"
    )
    mode = "smoke" if args.smoke else "gpu"
    report = dict(mode=mode, environment=header, seconds=round(seconds, 1), ok=not failed, rows=rows)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
