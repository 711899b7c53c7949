"""`radixkv replay`: agent traces through the real core, against independent oracles of the same rules."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from radixkv.cli import main
from radixkv.planning.replay_report import gap_closed, parse_tokens
from radixkv.planning.trace_replay import load_sessions, replay, schedule, ttl_oracle

_ROOT = Path(__file__).resolve().parents[2]
# The shared traces sit beside the checkout (../shared), or beside the folder of worktrees.
SHARED = (
    next(
        (
            p
            for p in (_ROOT.parent / "shared", _ROOT.parent.parent / "shared")
            if (p / "data" / "agentic-traces").is_dir()
        ),
        _ROOT.parent / "shared",
    )
    / "data"
    / "agentic-traces"
)


def write_session(folder: Path, name: str, seed: int, num_requests: int = 12) -> None:
    """A session in the shared traces' format: a growing context, now and then a branch (new ids from a point),
    pauses of seconds to many minutes, and a subagent summary record the replay must skip."""
    rng = random.Random(seed)
    ids, next_id, t, requests = list(range(1, 1 + rng.randint(20, 60))), 1000, 0.0, []
    for _ in range(num_requests):
        if rng.random() < 0.2 and len(ids) > 16:
            ids = ids[: rng.randint(8, len(ids) - 1)]  # a branch: the rest is superseded
        grow = rng.randint(1, 30)
        ids += list(range(next_id, next_id + grow))
        next_id += grow
        runs, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                runs.append([ids[start], i - start])
                start = i
        requests.append({"t": t, "type": "n", "in": len(ids) * 64 + 17, "out": 10, "runs": runs})
        t += rng.choice([3.0, 10.0, 40.0, 400.0, 4000.0])
    requests.insert(2, {"t": 5.0, "type": "subagent", "requests": [], "runs": []})
    data = {"id": name, "block_size": 64, "hash_id_scope": "local", "requests": requests}
    with gzip.open(folder / f"{name}.json.gz", "wt") as f:
        json.dump(data, f)


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    for i in range(10):
        write_session(tmp_path, f"trace_{i:04d}", seed=i)
    return tmp_path


def test_sessions_are_kept_apart_and_subagent_records_skipped(traces: Path):
    sessions = load_sessions(traces)
    assert [len(s) for s in sessions] == [12] * 10
    ranges = [(int(min(r.token_ids.min() for r in s)), int(max(r.token_ids.max() for r in s))) for s in sessions]
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        assert hi < lo  # the same local hash ids in two sessions are different tokens
    assert all(len(r.token_ids) % 8 == 0 for s in sessions for r in s)


def test_schedule_is_seeded_and_spreads_sessions(traces: Path):
    sessions = load_sessions(traces)
    a, b = schedule(sessions, 2, seed=7), schedule(sessions, 2, seed=7)
    assert [t for t, _ in a] == [t for t, _ in b]
    assert [t for t, _ in a] == sorted(t for t, _ in a)
    assert [t for t, _ in schedule(sessions, 2, seed=8)] != [t for t, _ in a]


@pytest.mark.parametrize("ttl_s", [300.0, 3600.0])
def test_ttl_refreshed_on_use_matches_the_plain_oracle(traces: Path, ttl_s: float):
    events = schedule(load_sessions(traces), 4)
    core, oracle = replay(events, None, "lru", ttl_s=ttl_s), ttl_oracle(events, ttl_s)
    assert core == pytest.approx(oracle, abs=1e-12)
    assert core < replay(events, None, "lru")  # some pause outlived the TTL


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared agent traces are not here")
@pytest.mark.parametrize("ttl_s", [300.0, 3600.0])
def test_ttl_on_the_shared_traces_matches_the_oracle(ttl_s: float):
    events = schedule(load_sessions(SHARED)[::6], 32)  # every 6th session: the rule, not the figure, is tested
    assert replay(events, None, "lru", ttl_s=ttl_s) == pytest.approx(ttl_oracle(events, ttl_s), abs=1e-3)


def test_min_bounds_every_policy_and_infinite_bounds_min(traces: Path):
    events = schedule(load_sessions(traces), 6)
    capacity = 64 * 512
    infinite, best = replay(events, None, "lru"), replay(events, capacity, "min")
    assert best <= infinite
    for policy in ("lru", "slru", "tlru", "agent"):
        assert replay(events, capacity, policy) <= best + 1e-12, policy


def test_cli_prints_the_table_and_writes_the_points(traces: Path, tmp_path: Path, capsys):
    out = tmp_path / "points.json"
    argv = ["replay", "--traces", str(traces), "--concurrency", "4", "--capacity-tokens", "32k"]
    assert main([*argv, "--capacity-tokens", "64k", "--ttl", "300", "--jobs", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gap agent" in text and "300 s TTL" in text
    points = json.loads(out.read_text())["points"]
    assert [p["capacity_tokens"] for p in points] == [32_000, 64_000]
    for p in points:
        assert p["concurrency"] == 4
        assert set(p["policies"]) == {"default", "agent", "lru", "slru", "tlru", "min", "infinite"}
        assert p["policies"]["default"] == p["policies"]["agent"]


def test_cli_refuses_bad_arguments(traces: Path, tmp_path: Path, capsys):
    assert main(["replay", "--traces", str(traces), "--capacity-tokens", "lots"]) == 2
    assert "--capacity-tokens" in capsys.readouterr().err
    assert main(["replay", "--traces", str(traces), "--policy", "fifo"]) == 2
    assert "--policy" in capsys.readouterr().err
    assert main(["replay", "--traces", str(tmp_path / "none")]) == 2
    assert "no *.json.gz" in capsys.readouterr().err


def test_parse_tokens_and_gap_closed():
    assert parse_tokens("0.5M") == 500_000 and parse_tokens("2m") == 2_000_000 and parse_tokens("4096") == 4096
    assert gap_closed({"lru": 0.5, "min": 0.7, "x": 0.6}, "x") == pytest.approx(0.5)
    assert gap_closed({"lru": 0.5, "min": 0.5, "x": 0.5}, "x") is None
