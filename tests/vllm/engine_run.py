"""One vLLM engine in its own process: serve the test prompts greedily, write what a test compares as JSON.

    python tests/vllm/engine_run.py OUT.json [--connector HOST:PORT] [--prefix-caching] [--max-batched N]

The engine core is a spawned process, hence the `__main__` guard. Written: per prompt the generated token ids and
`num_cached_tokens`, the engine's `vllm:prompt_tokens_by_source` counters (before --then-kill's second pass), the
time to first token of each prompt when `--ttft` serves them one at a time (for benchmarks/bench_vllm.py), and
the outputs of the second pass after `--then-kill PID`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # unset, vLLM on CPU takes ~20 GiB for its KV cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import BLOCK_SIZE, prompt_token_ids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default=os.environ.get("RADIXKV_VLLM_MODEL"))
    parser.add_argument("--connector", metavar="HOST:PORT", help="radixkv's server: run with RadixKVConnector")
    parser.add_argument("--pool", default="default")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache on")
    parser.add_argument("--max-batched", type=int, default=2048, help="max_num_batched_tokens (chunked prefill below)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="fewer prompts")
    parser.add_argument("--ttft", action="store_true", help="serve the prompts one at a time, timing each")
    parser.add_argument(
        "--then-kill", type=int, metavar="PID", help="then SIGKILL PID (radixkv's server) and serve the prompts again"
    )
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv_transfer = None
    if args.connector:
        kv_transfer = KVTransferConfig(
            kv_connector="RadixKVConnector",
            kv_connector_module_path="radixkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"radixkv_address": args.connector, "radixkv_pool": args.pool},
            kv_load_failure_policy="recompute",  # a failed load is recomputed, not the request failed
        )
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_num_batched_tokens=args.max_batched,
        enable_chunked_prefill=True,
        enable_prefix_caching=args.prefix_caching,
        kv_transfer_config=kv_transfer,
        disable_log_stats=False,
        seed=0,
    )
    start_seconds = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_token_ids(llm.get_tokenizer(), quick=args.quick)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    ttft: list[float] = []
    if args.ttft:
        outputs = []
        for prompt in prompts:
            one = SamplingParams(temperature=0.0, max_tokens=1)
            t = time.perf_counter()
            outputs += llm.generate([prompt], one, use_tqdm=False)
            ttft.append(time.perf_counter() - t)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    by_source = prompt_tokens_by_source(llm)
    again = []
    if args.then_kill:
        os.kill(args.then_kill, signal.SIGKILL)
        # vLLM's own cache forgets the prompts: a prompt it held whole would cost radixkv no call, and the pass is
        # to show the connector standing aside for a server that is gone
        assert llm.reset_prefix_cache(), "vLLM kept its prefix cache"
        again = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "start_seconds": start_seconds,
        "num_prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
        "num_cached_tokens": [o.num_cached_tokens for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_tokens_by_source": by_source,
        "ttft_seconds": ttft,
        "token_ids_after_kill": [list(o.outputs[0].token_ids) for o in again],
    }
    Path(args.out).write_text(json.dumps(result))


def prompt_tokens_by_source(llm: Any) -> dict[str, int]:
    """The engine's `vllm:prompt_tokens_by_source` counters so far, by source."""
    return {
        m.labels["source"]: m.value  # type: ignore[attr-defined]
        for m in llm.get_metrics()
        if m.name == "vllm:prompt_tokens_by_source"
    }


if __name__ == "__main__":
    main()
