"""A server restart on a multi-turn trace: upgrade (snapshot adopted) against a crash (cold start), in one run.

One keeper holds the pools' memory (`radixkv keeper`); a server process serves it. Each scenario
replays the same trace of multi-turn conversations (a turn's prompt is the whole conversation so far
plus a new user message; its reply is appended, committed and cached on release) on a pool of its
own, and restarts the server once, after `restart_turn` turns of every conversation:

- `none`: no restart (the reference hit ratio of the turns after that point);
- `upgrade`: the admin `Upgrade` call; the server writes its snapshot and exits, the next one adopts it;
- `crash`: SIGKILL; the next server starts cold (the crash policy: nothing it cannot prove is adopted).

Reported per scenario: time from the stop to the next server answering (process start included),
hit ratio before and after the restart, prefill tokens after it, and the snapshot's size, write and
adoption time. Then, as ratios in this run: upgrade/none hit ratio after, and the prefill tokens the
upgrade saves against the crash's cold start (the cost of the crash policy on this trace).

    python benchmarks/bench_restart.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from radixkv.client import RadixKVClient
from radixkv.errors import RadixKVError
from radixkv.server.process.spawn import KeeperProcess, ServerProcess
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

BLOCK_SIZE = 16
SCENARIOS = ("none", "upgrade", "crash")


@dataclasses.dataclass(frozen=True)
class TraceShape:
    num_conversations: int
    num_turns: int
    restart_turn: int  # the restart happens once every conversation has had this many turns
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    num_blocks: int
    num_layers: int  # the pool's K/V size: what the snapshot checksums on both sides
    head_dim: int


QUICK = TraceShape(12, 6, 3, 64, 24, 48, 1024, 2, 64)
FULL = TraceShape(48, 10, 5, 256, 48, 128, 8192, 4, 128)


def make_conversations(shape: TraceShape, seed: int = 0) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, its turns as (new user tokens, reply tokens); all share one system prompt."""
    rng = random.Random(seed)
    return [
        [
            ([rng.randrange(1, 30_000) for _ in range(shape.user_tokens)],
             [rng.randrange(1, 30_000) for _ in range(shape.reply_tokens)])
            for _ in range(shape.num_turns)
        ]
        for _ in range(shape.num_conversations)
    ]  # fmt: skip


@dataclasses.dataclass
class Counts:
    num_prompt_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_hit_tokens


def run_turns(
    client: RadixKVClient, system: list[int], conversations: list, histories: list[list[int]], turns: range
) -> Counts:
    """Each conversation's `turns`, round-robin: open, commit the prompt, append and commit the reply, release."""
    counts = Counts()
    for turn in turns:
        for c, conversation in enumerate(conversations):
            user, reply = conversation[turn]
            prompt = (histories[c] or system) + user
            opened = client.open(prompt)
            counts.num_prompt_tokens += len(prompt)
            counts.num_hit_tokens += opened.num_cached_tokens
            client.commit([opened.seq_id], [len(prompt)])
            client.append(opened.seq_id, reply)
            client.commit([opened.seq_id], [len(prompt) + len(reply)])
            client.release(opened.seq_id)
            histories[c] = prompt + reply
    return counts


def _server_args(shape: TraceShape, pool: str, keeper: KeeperProcess) -> list[str]:
    spec = f"{pool}:num_layers={shape.num_layers},num_kv_heads=2,head_dim={shape.head_dim},"
    spec += f"block_size={BLOCK_SIZE},num_blocks={shape.num_blocks}"
    return ["--pool", spec, "--keeper", str(keeper.socket)]


def _log_event(log_path: Path, message: str) -> dict[str, Any]:
    """The last JSON log line of the server whose message is `message` ({} if none)."""
    found: dict[str, Any] = {}
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == message:
            found = record
    return found


def _wait_serving(address: str, pool: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        while True:
            try:
                stub.Stats(pb.StatsRequest(pool=pool), timeout=1.0)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def run_scenario(scenario: str, shape: TraceShape, keeper: KeeperProcess, workdir: Path) -> dict[str, Any]:
    pool = f"bench-{scenario}"
    conversations = make_conversations(shape)
    system = make_conversations(dataclasses.replace(shape, user_tokens=shape.system_tokens), seed=1)[0][0][0]
    histories: list[list[int]] = [[] for _ in conversations]
    args = _server_args(shape, pool, keeper)
    first = ServerProcess(args, log_path=workdir / f"{scenario}-1.log")
    port = ["--port", str(first.port)]
    result: dict[str, Any] = {"scenario": scenario}
    client = RadixKVClient(first.address, pool=pool, session_ttl=60.0)
    try:
        before = run_turns(client, system, conversations, histories, range(shape.restart_turn))
        second = first
        if scenario != "none":
            started = time.perf_counter()
            if scenario == "upgrade":
                with grpc.insecure_channel(first.address) as channel:
                    response = kvcache_pb2_grpc.KVCacheStub(channel).Upgrade(pb.UpgradeRequest(), timeout=60)
                (written,) = response.snapshots
                result |= {"snapshot_bytes": written.num_bytes, "snapshot_write_s": written.seconds}
                first.proc.wait(60)
                first.stop()
            else:
                first.kill()
            result["seconds_to_exit"] = time.perf_counter() - started
            second = ServerProcess(args + port, log_path=workdir / f"{scenario}-2.log")
            _wait_serving(second.address, pool)
            result["seconds_to_serving"] = time.perf_counter() - started
            adopted = _log_event(workdir / f"{scenario}-2.log", "snapshot adopted")
            result["adopt_s"] = adopted.get("seconds")
            result["num_adopted_blocks"] = adopted.get("num_cached_blocks", 0)
            # The crash policy: the old session is gone with the index, so the scheduler reopens; an upgrade
            # keeps it. Retried until the channel has reconnected, as a scheduler would.
            _retrying(client.reopen if scenario == "crash" else client.keep_alive)
        after = run_turns(client, system, conversations, histories, range(shape.restart_turn, shape.num_turns))
        second.stop()
    finally:
        client.close()
    result |= {
        "hit_ratio_before": before.hit_ratio,
        "hit_ratio_after": after.hit_ratio,
        "prefill_tokens_after": after.num_prefill_tokens,
        "prompt_tokens_after": after.num_prompt_tokens,
    }
    return result


def _retrying(call: Callable[[], object]) -> None:
    """The first call after a restart may find the channel still reconnecting: retried, as a scheduler would."""
    for _ in range(100):
        try:
            call()
            return
        except (RadixKVError, grpc.RpcError):
            time.sleep(0.05)
    call()


def print_table(report: dict[str, Any]) -> None:
    columns = [  # (title, key, format)
        ("scenario", "scenario", "<9"), ("to exit s", "seconds_to_exit", ">9.2f"),
        ("to serving s", "seconds_to_serving", ">12.2f"), ("hit before", "hit_ratio_before", ">10.3f"),
        ("hit after", "hit_ratio_after", ">9.3f"), ("prefill after", "prefill_tokens_after", ">13"),
        ("snapshot B", "snapshot_bytes", ">10"), ("write s", "snapshot_write_s", ">8.3f"),
        ("adopt s", "adopt_s", ">8.3f"), ("adopted blocks", "num_adopted_blocks", ">14"),
    ]  # fmt: skip
    widths = [int(fmt.lstrip("<>").split(".")[0]) for _, _, fmt in columns]
    print(" ".join(f"{title:{fmt[0]}{width}}" for (title, _, fmt), width in zip(columns, widths, strict=True)))
    for r in report["scenarios"]:
        print(
            " ".join(f"{r.get(key) or 0:{fmt}}" if key != "scenario" else f"{r[key]:{fmt}}" for _, key, fmt in columns)
        )
    ratios = report["ratios"]
    print(f"upgrade hit ratio after / no restart:        {ratios['upgrade_over_none_hit_after']:.3f}")
    print(f"upgrade hit ratio after / its own before:    {ratios['upgrade_after_over_before']:.3f}")
    print(f"crash prefill tokens after / upgrade's:      {ratios['crash_over_upgrade_prefill']:.2f}")
    print(f"prefill tokens the upgrade saves vs a crash: {ratios['prefill_tokens_saved']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller trace (< 30 s)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        workdir = Path(tmp)
        keeper = KeeperProcess(workdir / "state", log_path=workdir / "keeper.log")
        try:
            scenarios = {s: run_scenario(s, shape, keeper, workdir) for s in SCENARIOS}
        finally:
            keeper.stop()
    none, upgrade, crash = scenarios["none"], scenarios["upgrade"], scenarios["crash"]
    report = {
        "shape": dataclasses.asdict(shape),
        "scenarios": list(scenarios.values()),
        "ratios": {
            "upgrade_over_none_hit_after": upgrade["hit_ratio_after"] / none["hit_ratio_after"],
            "upgrade_after_over_before": upgrade["hit_ratio_after"] / upgrade["hit_ratio_before"],
            "crash_over_upgrade_prefill": crash["prefill_tokens_after"] / max(1, upgrade["prefill_tokens_after"]),
            "prefill_tokens_saved": crash["prefill_tokens_after"] - upgrade["prefill_tokens_after"],
        },
    }
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
