"""The disk tier behind an unmodified vLLM: warm from the disk alone after the server and its keeper die.

- a reference engine without the connector: the greedy outputs the others must reproduce token for token;
- engine A with the connector fills a radixkv server (on a keeper, with a host tier and a disk tier); once every
  committed block is on disk (`radixkv_disk_pending_blocks` 0), the server and the keeper are SIGKILLed: no
  device or host memory survives, only the directory;
- one object is damaged (a flipped byte in the K/V of the longest prompt's last loadable block);
- a fresh server on the same --disk-dir alone rebuilds its index; a fresh engine B, vLLM's prefix cache off, is
  promised every full block of its prompts (Match counts the disk's), loads them through the host tier (the
  connector's worker applies the open's host -> device loads, and verifies each block against the digest its
  saver recorded, which the disk object kept), and recomputes the damaged one: refused by its checksum, counted,
  removed, reported to vLLM as a failed load. Outputs token-identical to the reference.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make test-vllm sets it up)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import run_engine  # noqa: E402
from prompts import prompt_token_ids  # noqa: E402

from radixkv.disk.object_format import OBJECT_SUFFIX  # noqa: E402
from radixkv.server.process.spawn import KeeperProcess, ServerProcess, patient  # noqa: E402
from radixkv.tree.block_hash import chain_hashes  # noqa: E402

pytestmark = pytest.mark.timeout(3600)  # a hang guard: engine starts wait patient(...) each, longer on a loaded machine
BLOCK = 32
START = 600  # seconds a server or keeper may take to come up: minutes on a loaded machine
# SmolLM2-135M's shape (the engine checks it), with a host tier: a disk tier loads through it.
POOL = "default:num_layers=30,num_kv_heads=3,head_dim=64,block_size=32,dtype=float32,num_blocks=600,host_num_blocks=300"


def serve(log: Path, disk_dir: Path, keeper: Path | None = None) -> ServerProcess:
    flags = ["--pool", POOL, "--disk-dir", str(disk_dir), "--disk-capacity", "2GiB", "--metrics-port", "0"]
    return ServerProcess(flags, log, keeper=keeper, timeout=START)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60) as r:
        text = r.read().decode()
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:_total)?\{{(.*)\}} (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == {"pool": "default", **labels}:
            return float(m.group(2))
    return 0.0


def full_block_tokens(run: dict) -> int:
    return sum(n // BLOCK * BLOCK for n in run["num_prompt_tokens"])


def test_a_fresh_engine_is_served_from_disk_alone_and_a_damaged_object_is_recomputed(
    model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    prompts = prompt_token_ids(AutoTokenizer.from_pretrained(model_dir), quick=True)
    longest = max(prompts, key=len)
    disk_dir = tmp_path / "disk-tier"
    reference = run_engine(tmp_path / "reference.json", model_dir, "--quick")["token_ids"]

    keeper = KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log", timeout=START)
    first = serve(tmp_path / "a-server.log", disk_dir, keeper=keeper.socket)
    try:
        a = run_engine(tmp_path / "a.json", model_dir, "--quick", "--connector", first.address)
        deadline = time.monotonic() + patient(300)
        while metric(first, "radixkv_disk_pending_blocks") or not metric(first, "radixkv_disk_blocks"):
            assert time.monotonic() < deadline, "the writer never emptied its queue"
            time.sleep(0.2)
        num_on_disk = metric(first, "radixkv_disk_blocks")
    finally:
        first.kill()  # SIGKILL, no snapshot
        keeper.kill()  # and the host memory with it
    assert a["token_ids"] == reference

    # The longest prompt's last loadable block (vLLM computes a prompt's last token): one object per block here.
    last = (len(longest) - 1) // BLOCK
    victim_hash = chain_hashes(longest[: last * BLOCK], BLOCK, "default")[-1]
    (victim,) = disk_dir.glob(f"default/objects/*/{victim_hash[:8].hex()}-*{OBJECT_SUFFIX}")
    with open(victim, "r+b") as f:
        f.seek(-4096 - 100, 2)  # inside the block's K/V, past the header
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x40]))
    os.utime(victim, (1, 1))  # the oldest in the rebuilt LRU: the start's bandwidth probe reads the newest object

    with serve(tmp_path / "b-server.log", disk_dir) as fresh:
        assert fresh.announcement["disk"]["default"]["blocks"] == num_on_disk, "the index, from the directory alone"
        b = run_engine(tmp_path / "b.json", model_dir, "--quick", "--connector", fresh.address)
        assert metric(fresh, "radixkv_disk_refused_objects", why="corrupt") == 1 and not victim.exists()
        hit_tokens = metric(fresh, "radixkv_disk_hit_tokens")
    assert b["token_ids"] == reference, "the damaged block recomputed, the rest loaded from disk: the same outputs"
    log = (tmp_path / "b.log").read_text()
    assert "Recovered from KV load failure: 1 request(s) rescheduled (32 tokens affected)" in log
    # vLLM counts what the connector promised (every loadable block); one block of it was recomputed instead.
    assert b["num_cached_tokens"] == [(n - 1) // BLOCK * BLOCK for n in b["num_prompt_tokens"]]
    assert b["prompt_tokens_by_source"]["local_cache_hit"] == 0  # prefix cache off: every hit came from radixkv
    loaded = sum(b["num_cached_tokens"]) - BLOCK
    assert loaded / full_block_tokens(b) >= 0.95, (loaded, full_block_tokens(b))
    assert hit_tokens >= (num_on_disk - len(prompts) - 1) * BLOCK, "read from disk: no device or host memory survived"
