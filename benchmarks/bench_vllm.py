"""A fresh vLLM engine with and without radixkv's connector, on the same prompts: prefill tokens and TTFT.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--quick] [--out results.json] [--model DIR]

Engine A (with the connector) serves the prompts of tests/vllm/prompts.py once, filling radixkv; then engine B, a
fresh process, serves them one at a time, timing each (time to first token: a request of one output token),
once with the connector and once without (vLLM's own prefix cache on in both, as deployed). Each engine is its
own process, one at a time. On CPU this compares configurations, not hardware; the two B engines run one after
the other, so on a shared machine their TTFTs differ by whatever else ran meanwhile (prefill tokens do not).
`--quick`: 9 prompts (the engines still take 30-60 s each to start here, so even --quick runs for minutes: it
cannot meet the 30 s the other benchmarks keep). The model: RADIXKV_VLLM_MODEL or --model (make test-vllm
converts one to .cache-vllm/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from engines import run_engine  # noqa: E402

from radixkv.server.process import ServerProcess  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--model", default=os.environ.get("RADIXKV_VLLM_MODEL", ROOT / ".cache-vllm/smollm2-135m-instruct")
    )
    args = parser.parse_args()
    model = Path(args.model)
    quick = ["--quick"] if args.quick else []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        flags = ["--model", str(model), "--block-size", "32", "--kv-dtype", "float32", "--num-blocks", "600"]
        with ServerProcess(flags, d / "server.log") as server:
            connector = ["--connector", server.address, "--prefix-caching", *quick]
            run_engine(d / "a.json", model, *connector)
            with_radixkv = run_engine(d / "b.json", model, *connector, "--ttft")
        without = run_engine(d / "c.json", model, "--prefix-caching", "--ttft", *quick)
    rows = []
    for name, run in (("without radixkv", without), ("with radixkv", with_radixkv)):
        src = run["prompt_tokens_by_source"]
        rows.append(
            {
                "engine B": name,
                "prompts": len(run["num_prompt_tokens"]),
                "prompt tokens": sum(run["num_prompt_tokens"]),
                "prefill tokens computed": src.get("local_compute", 0),
                "from radixkv": src.get("external_kv_transfer", 0),
                "local hits": src.get("local_cache_hit", 0),
                "TTFT p50 ms": 1000 * statistics.median(run["ttft_seconds"]),
                "TTFT mean ms": 1000 * statistics.fmean(run["ttft_seconds"]),
                "outputs": run["token_ids"],
                "ttft_ms": [round(1000 * t, 1) for t in run["ttft_seconds"]],
                "cached_tokens": run["num_cached_tokens"],
            }
        )
    identical = rows[0].pop("outputs") == rows[1].pop("outputs")
    keys = [k for k in rows[0] if k not in ("ttft_ms", "cached_tokens")]  # per prompt: in --out only
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    ratios = {
        "prefill tokens, with / without": rows[1]["prefill tokens computed"]
        / max(1, rows[0]["prefill tokens computed"]),
        "TTFT p50, with / without": rows[1]["TTFT p50 ms"] / rows[0]["TTFT p50 ms"],
        "first tokens identical": identical,
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "ratios": ratios, "quick": args.quick}, indent=2))


if __name__ == "__main__":
    main()
