"""benchmarks/bench_memory.py on a handful of requests: the accounting behaves as sharing says it must."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_memory", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_memory"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_one_sample_shares_nothing(bench: ModuleType) -> None:
    for block_size in (1, 16):
        row = bench.measure("alpaca", "sample", 1, block_size, num_requests=12, max_live=4, seed=0)
        assert row.saving_vs_paged == pytest.approx(0.0)  # no forks, unrelated prompts: radixkv is plain paging
        assert row.util_radixkv == pytest.approx(row.util_paged)
        assert row.util_contiguous < row.util_paged  # slabs reserve max_new_tokens up front
    assert bench.measure("alpaca", "sample", 1, 1, 12, 4, 0).util_paged == 1.0  # one-token blocks waste nothing


def test_forks_save_and_copy_on_write_only_with_partial_blocks(bench: ModuleType) -> None:
    samples = bench.measure("alpaca", "sample", 4, 16, num_requests=12, max_live=4, seed=0)
    beams = bench.measure("alpaca", "beam", 4, 16, num_requests=12, max_live=4, seed=0)
    assert 0 < samples.saving_vs_paged < beams.saving_vs_paged  # samples share the prompt; beams most of their past
    assert beams.num_cow_copies > 0
    assert (
        bench.measure("alpaca", "beam", 4, 1, num_requests=12, max_live=4, seed=0).num_cow_copies == 0
    )  # no partial blocks


def test_table_json_and_paper_line(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "BLOCK_SIZES", (16,))
    monkeypatch.setattr(bench, "MODES", (("sample", 2), ("beam", 2)))
    monkeypatch.setattr(bench, "TRACES", {"alpaca": bench.TRACES["alpaca"]})
    out = tmp_path / "memory.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "util radixkv" in printed and "paper 6.1-9.8%" in printed and "paper 37.6-55.2%" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["width"], r["block_size"]) for r in rows] == [("sample", 2, 16), ("beam", 2, 16)]
    assert all(0 < r["util_radixkv"] <= 1 for r in rows)
