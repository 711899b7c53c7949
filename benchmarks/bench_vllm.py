"""Time to first token on long distinct documents: recompute, radixkv's connector, LMCache's MP server, vLLM's own
local prefix hit; and the connector's load path in GB/s against a same-run memcpy.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--quick] [--out results.json] [--model DIR] [--lmcache-venv DIR]

Each engine is a fresh vLLM process (SmolLM2-135M float32, block 32, prefix caching on, enforce_eager), serving
the documents one at a time with one output token after one warm-up request of its own; TTFT is the median over
the documents. Engines, one after the other:
- local: no connector; each document twice: the first pass is the recompute, the second vLLM's local prefix hit;
- radixkv-fill, then radixkv: a radixkv server; one engine saves the documents, a fresh one loads them back,
  each document twice in a row: the second request is a local hit in the same engine, right after, so the paired
  ratio (radixkv's TTFT over that local hit's, median over the documents) holds however the machine's load drifts
  between engines;
- lmcache-fill, then lmcache: LMCache 0.5.6's MP server (`lmcache server`) and vLLM's `LMCacheMPConnector`, when
  `--lmcache-venv` (default /work/venvs/lmcache) holds it: a benchmark peer only, never radixkv's dependency; its
  loading engine too serves each document twice in a row (its paired ratio).
The load path: the documents' blocks saved into a radixkv pool and loaded back into vLLM-layout (CPU_ATTN) KV
tensors by the connector's worker (`WorkerSide`: gather, BLAKE3 digests, layout conversion), in this process,
against `torch` copying the same number of bytes (memcpy) in the same run. Documents: ~1,500 tokens each,
distinct from the first token (seeded text). `--quick`: 3 documents, else 6. On a shared CPU the TTFTs move with
whatever else runs; the ratios within one run are the figures to read. RADIXKV_VLLM_MODEL or --model names the
converted model (`make test-vllm` converts one to .cache-vllm/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
DOC_TOKENS = 1500
WORDS = (
    "cache block prefix token layer memory server engine request latency model vector attention head value key "
    "paged radix tree shared tenant pool digest load save copy kernel batch stream session router replica"
).split()


def documents(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` distinct documents of DOC_TOKENS tokens: seeded text, each opening with its own number."""
    docs = []
    for i in range(count):
        rng = random.Random(1000 + i)
        text = f"Document {i}. " + " ".join(f"{rng.choice(WORDS)} {rng.randrange(10_000)}" for _ in range(1200))
        docs.append(tokenizer.encode(text)[:DOC_TOKENS])
    return docs


# -- one engine, in a process of its own ------------------------------------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    """Serve the documents one at a time (`passes` times each), timing each request's first token."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3000")  # a busy shared CPU: minutes per step
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if args.connector == "radixkv":
        transfer = KVTransferConfig(
            kv_connector="RadixKVConnector", kv_connector_module_path="radixkv.vllm", kv_role="kv_both",
            kv_connector_extra_config={"radixkv_address": args.address}, kv_load_failure_policy="recompute",
        )  # fmt: skip
    elif args.connector == "lmcache":
        host, port = args.address.rsplit(":", 1)
        transfer = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": int(port)},
        )  # fmt: skip
    llm = LLM(
        model=args.model, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=4096,
        max_num_batched_tokens=4096, enable_prefix_caching=True, kv_transfer_config=transfer, seed=0,
        disable_log_stats=False,  # get_metrics below: vLLM's prompt tokens by source
    )  # fmt: skip
    docs = documents(llm.get_tokenizer(), args.count)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    warm = 1000 + os.getpid() % 40_000  # a warm-up prompt of this engine's own: never one radixkv holds
    llm.generate([TokensPrompt(prompt_token_ids=list(range(warm, warm + 3 * BLOCK)))], one, use_tqdm=False)
    slots = args.passes * args.repeat  # ttft[slot][doc]: slot = pass * repeat + the request's place in its repeat
    ttft: list[list[float]] = [[] for _ in range(slots)]
    tokens: list[list[int]] = [[] for _ in range(slots)]
    for p in range(args.passes):
        for doc in docs:
            for r in range(args.repeat):
                start = time.perf_counter()
                out = llm.generate([TokensPrompt(prompt_token_ids=doc)], one, use_tqdm=False)
                ttft[p * args.repeat + r].append(time.perf_counter() - start)
                tokens[p * args.repeat + r].append(out[0].outputs[0].token_ids[0])
    first_tokens = [t for slot in tokens for t in slot]
    by_source = {m.labels["source"]: m.value for m in llm.get_metrics() if m.name == "vllm:prompt_tokens_by_source"}
    result = {"ttft": ttft, "first_tokens": first_tokens, "prompt_tokens_by_source": by_source}
    Path(args.out).write_text(json.dumps(result))


def run_engine(d: Path, name: str, model: Path, count: int, *flags: str) -> dict[str, Any]:
    out = d / f"{name}.json"
    command = [sys.executable, __file__, "--engine", str(out), "--model", str(model), "--count", str(count), *flags]
    with (d / f"{name}.log").open("wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=d, timeout=1200, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"engine {name} failed: {(d / f'{name}.log').read_text()[-3000:]}")
    return json.loads(out.read_text())


# -- the load path, in this process -----------------------------------------------------------------------------


def load_path(server_address: str, model: Path, count: int) -> dict[str, float]:
    """GB/s of the connector's load (gather, digest, convert into CPU_ATTN KV tensors) and of a memcpy of as many
    bytes, best of 7 each (interleaved), on `count` documents' worth of blocks."""
    import torch

    from radixkv.client import PoolView, RadixKVClient
    from radixkv.vllm.layouts import CpuLayout
    from radixkv.vllm.plan import StepPlan
    from radixkv.vllm.worker_side import WorkerSide

    with RadixKVClient(server_address) as client, PoolView(client.get_pool()) as view:
        num_layers, _, _, block_size, heads, head_dim = view.data.shape
        num_blocks = count * (DOC_TOKENS // BLOCK)
        gen = torch.Generator().manual_seed(0)
        kv = [torch.randn(num_blocks + 1, heads, block_size, 2 * head_dim, generator=gen) for _ in range(num_layers)]
        worker = WorkerSide(view, kv, CpuLayout)
        prompt = [7_000_000 + i for i in range(num_blocks * BLOCK + 1)]
        opened = client.open(prompt, "bench-load-path")
        saves = StepPlan()
        for i in range(num_blocks):
            saves.saves.add("r", i, 1 + i, opened.block_table[i])
        digests = worker.save(saves)["r"]
        client.commit([opened.seq_id], [num_blocks * BLOCK])
        client.cache(opened.seq_id)
        client.checksums.record(opened.seq_id, 0, [digests[i] for i in range(num_blocks)])
        loads = StepPlan()
        for i in range(num_blocks):
            loads.loads.add("r", i, opened.block_table[i], 1 + i, digests[i])
        into = [torch.zeros_like(t) for t in kv]
        reader = WorkerSide(view, into, CpuLayout)
        num_bytes = num_blocks * view.data[:, :, 0].numel() * view.data.element_size()
        src = torch.randn(num_bytes // 4)
        dst = torch.empty_like(src)

        def timed(f: Any) -> float:
            start = time.perf_counter()
            f()
            return time.perf_counter() - start

        reader.load(loads)
        assert not reader.take_load_errors(), "a load failed its digest"
        assert all(torch.equal(a[1:], b[1:]) for a, b in zip(kv, into, strict=True)), "the load is not the save"
        pairs = [(timed(lambda: reader.load(loads)), timed(lambda: dst.copy_(src))) for _ in range(7)]  # interleaved
        load_s, memcpy_s = min(p[0] for p in pairs), min(p[1] for p in pairs)
        client.release(opened.seq_id, cache=False)
    return {
        "MB": num_bytes / 1e6,
        "load GB/s": num_bytes / load_s / 1e9,
        "memcpy GB/s": num_bytes / memcpy_s / 1e9,
        "load ms": 1000 * load_s,
        "memcpy ms": 1000 * memcpy_s,
    }


# -- LMCache's MP server, when installed -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lmcache_rows(d: Path, model: Path, count: int, venv: Path) -> tuple[dict[str, Any] | None, str]:
    """(the lmcache engine's result, "") or (None, why it did not run)."""
    lmcache = venv / "bin" / "lmcache"
    if not lmcache.exists():
        return None, f"not installed ({lmcache} missing)"
    port = free_port()
    log = (d / "lmcache-server.log").open("wb")
    server = subprocess.Popen(
        [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "4",
         "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"],
        stdout=log, stderr=subprocess.STDOUT, cwd=d,
    )  # fmt: skip
    try:
        time.sleep(15)
        if server.poll() is not None:
            return None, f"its server exited: {(d / 'lmcache-server.log').read_text()[-400:]}"
        python = str(venv / "bin" / "python")
        flags = ["--connector", "lmcache", "--address", f"127.0.0.1:{port}"]
        for name, repeat in (("lmcache-fill", 1), ("lmcache", 2)):
            command = [python, __file__, "--engine", str(d / f"{name}.json"), "--model", str(model),
                       "--count", str(count), "--repeat", str(repeat), *flags]  # fmt: skip
            with (d / f"{name}.log").open("wb") as out:
                done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=d, timeout=1200, check=False)
            if done.returncode != 0:
                return None, f"engine {name} failed: {(d / f'{name}.log').read_text()[-600:]}"
        return json.loads((d / "lmcache.json").read_text()), ""
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--model", default=os.environ.get("RADIXKV_VLLM_MODEL", ROOT / ".cache-vllm/smollm2-135m-instruct")
    )
    parser.add_argument("--lmcache-venv", type=Path, default=Path("/work/venvs/lmcache"))
    parser.add_argument("--no-lmcache", action="store_true", help="skip the LMCache peer")
    parser.add_argument("--keep", type=Path, help="keep the engines' logs in this folder")
    # An engine's own process (internal).
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--connector", choices=["radixkv", "lmcache"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--passes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        args.out = args.engine
        engine_main(args)
        return

    from radixkv.server.process.spawn import ServerProcess

    model, count = Path(args.model).resolve(), 3 if args.quick else 6
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        d = args.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        local = run_engine(d, "local", model, count, "--passes", "2")
        pool_blocks = 2 * count * (DOC_TOKENS // BLOCK + 1) + 64
        flags = [
            "--model",
            str(model),
            "--block-size",
            str(BLOCK),
            "--kv-dtype",
            "float32",
            "--num-blocks",
            str(pool_blocks),
        ]
        with ServerProcess(flags, d / "server.log") as server:
            connector = ["--connector", "radixkv", "--address", server.address]
            run_engine(d, "radixkv-fill", model, count, *connector)
            radixkv = run_engine(d, "radixkv", model, count, *connector, "--repeat", "2")
            load = load_path(server.address, model, count)
        peer, why = (
            (None, "skipped (--no-lmcache)") if args.no_lmcache else lmcache_rows(d, model, count, args.lmcache_venv)
        )

    med = {
        "recompute": statistics.median(local["ttft"][0]),
        "radixkv": statistics.median(radixkv["ttft"][0]),
        "local hit": statistics.median(local["ttft"][1]),
    }
    if peer is not None:
        med["LMCache MP"] = statistics.median(peer["ttft"][0])
    print(f"TTFT, median of {count} documents of {DOC_TOKENS} tokens (ms)")
    print("| engine | TTFT p50 ms | / local hit |")
    print("|---|---|---|")
    for name, seconds in med.items():
        print(f"| {name} | {1000 * seconds:.0f} | {seconds / med['local hit']:.2f} |")
    if peer is None:
        print(f"| LMCache MP | did not run: {why} | |")
    print(f"\nload path: {load['MB']:.0f} MB in {load['load ms']:.1f} ms = {load['load GB/s']:.2f} GB/s; "
          f"memcpy {load['memcpy ms']:.1f} ms = {load['memcpy GB/s']:.2f} GB/s; "
          f"ratio {load['load GB/s'] / load['memcpy GB/s']:.2f}")  # fmt: skip
    print("\npaired: each document's next request in the same engine is a local hit, right after")
    pairs = {}
    for name, run in (("radixkv", radixkv), ("LMCache MP", peer)):
        if run is not None:
            pairs[name] = statistics.median(a / b for a, b in zip(run["ttft"][0], run["ttft"][1], strict=True))
            print(f"  {name} / its engine's local hit ({1000 * statistics.median(run['ttft'][1]):.0f} ms p50): "
                  f"median ratio {pairs[name]:.2f}")  # fmt: skip
    print(f"load average (1, 5, 15 min) at the start {load_before}, at the end {os.getloadavg()}")
    identical = radixkv["first_tokens"] == local["first_tokens"][:count] * 2
    loaded = radixkv.get("prompt_tokens_by_source", {}).get("external_kv_transfer", 0)
    hit_ratio = loaded / (count * ((DOC_TOKENS - 1) // BLOCK * BLOCK))  # vLLM always computes the last token
    print(f"first tokens through radixkv identical to recompute: {identical}; "
          f"full-block tokens loaded from radixkv: {hit_ratio:.3f}")  # fmt: skip
    if args.out:
        result = {
            "quick": args.quick, "documents": count, "doc_tokens": DOC_TOKENS, "ttft_p50_s": med,
            "ttft_s": {"recompute": local["ttft"][0], "local hit": local["ttft"][1], "radixkv": radixkv["ttft"][0],
                       "local hit, radixkv's engine": radixkv["ttft"][1],
                       **({"LMCache MP": peer["ttft"][0]} if peer else {})},
            "lmcache": why or "ran", "load_path": load, "first_tokens_identical": identical, "hit_ratio": hit_ratio,
            "paired_ratio": pairs, "load_average": [load_before, os.getloadavg()],
        }  # fmt: skip
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
