"""benchmarks/builds.py: before and after from one run. Each build's run imports that build's radixkv, the order
alternates round by round, and each metric keeps its best round the way its pattern says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import radixkv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import builds  # noqa: E402 - a benchmark's sibling script, not a package

SCRIPT = """
import argparse, json, os, radixkv
parser = argparse.ArgumentParser(); parser.add_argument("--out"); parser.add_argument("--x", type=float)
args = parser.parse_args()
log = os.environ["ORDER_LOG"]
with open(log, "a") as f: f.write(radixkv.__file__ + "\\n")
with open(args.out, "w") as f: json.dump({"source": radixkv.__file__, "t": {"wall_s": args.x, "n": 1}}, f)
"""


def test_each_build_runs_its_own_radixkv_alternately(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "old" / "radixkv"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    log = tmp_path / "order.log"
    monkeypatch.setenv("ORDER_LOG", str(log))
    runs = builds.run_alternately(script, {"old": str(tmp_path / "old"), "new": None}, ["--x", "2"], rounds=3)
    assert [r["source"] for r in runs["old"]] == [str(fake / "__init__.py")] * 3
    assert [r["source"] for r in runs["new"]] == [radixkv.__file__] * 3
    order = log.read_text().split()
    old, new = str(fake / "__init__.py"), radixkv.__file__
    assert order == [old, new, new, old, old, new]  # reversed every other round: neither always runs first


def test_best_takes_each_metric_at_its_best_and_the_table_gives_ratios() -> None:
    runs = [
        {"a": {"16": {"cpu_s": 3.0}}, "tps": 10, "skip": 1.0},
        {"a": {"16": {"cpu_s": 2.0}}, "tps": 30, "skip": 0.5},
    ]
    patterns = {"a.*.cpu_s": "lower", "tps": "higher"}
    assert builds.best(runs, patterns) == {"a.16.cpu_s": 2.0, "tps": 30.0}
    table = builds.compare_table({"a.16.cpu_s": 2.0, "tps": 30.0}, {"a.16.cpu_s": 1.0, "only_after": 5.0}, ("b", "a"))
    rows = table.splitlines()[2:]
    assert len(rows) == 1 and rows[0].split() == ["a.16.cpu_s", "2", "1", "0.500"]  # only metrics both reported
