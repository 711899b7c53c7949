"""benchmarks/bench_workload.py on the tiny model: the matrix is what it says, and the cache on/off
figures differ as they must."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from radixkv.demo.model_source import ChatModel, load_chat_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_workload.py"
SIZES = dict(
    short_prompt=4,
    long_prompt=30,
    short_output=3,
    long_output=6,
    num_requests=3,
    num_conversations=2,
    num_turns=3,
    num_documents=2,
    document_words=30,
)


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_workload", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_workload"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatModel:
    return load_chat_model("tiny", tiny_dir=tmp_path_factory.mktemp("tiny"))


def test_the_matrix_holds_every_scenario(bench: ModuleType, chat: ChatModel) -> None:
    found = bench.scenarios(chat, bench.Sizes(**SIZES))
    assert list(found) == [
        "short prompt, short out",
        "short prompt, long out",
        "long prompt, short out",
        "long prompt, long out",
        "multi-turn",
        "RAG, shared documents",
    ]
    assert [s.max_new_tokens for s in found["short prompt, long out"]] == [6, 6, 6]
    assert min(len(s.prompt) for s in found["long prompt, short out"]) > max(
        len(s.prompt) for s in found["short prompt, short out"]
    )
    turns = found["multi-turn"]
    assert [s.follows for s in turns] == [None, "c0t0", "c0t1", None, "c1t0", "c1t1"]
    rag = found["RAG, shared documents"]
    assert (
        common(rag[0].prompt, rag[2].prompt) > common(rag[0].prompt, rag[1].prompt) + 100
    )  # 0 and 2 read one document


def test_multi_turn_hits_with_the_cache_on_and_never_with_it_off(bench: ModuleType, chat: ChatModel) -> None:
    specs = bench.scenarios(chat, bench.Sizes(**SIZES))["multi-turn"]
    on, off = (bench.run(chat, specs, 256, caching, 512) for caching in (True, False))
    assert on["hit_ratio"] > 0.5 and off["hit_ratio"] == 0.0  # later turns re-send the whole conversation
    assert on["profile"]["multi_turn_share"] == pytest.approx(4 / 6)
    assert on["profile"]["shared_system_prompt_share"] == 1.0
    assert on["profile"]["output_tokens_p50_p95_p99"] == [3.0, 3.0, 3.0]  # EOS ignored: every output its stated length
    for r in (on, off):
        assert r["ttft_ms_p50_p95_p99"][0] > 0 and r["decode_tokens_per_s"] > 0
        assert r["allocation_failures"] == 0 and r["preemptions"] == 0
