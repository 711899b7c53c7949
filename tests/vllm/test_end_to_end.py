"""radixkv behind an unmodified vLLM, end to end: a real radixkv server (on a keeper), real vLLM engines, each
engine in a process of its own, one after the other, on the prompts of `prompts.py`.

One chain, since each engine costs ~30-60 s to start on CPU:
- a reference engine without the connector: the greedy outputs every other engine must reproduce token for token;
- engine A with the connector and chunked prefill (256-token chunks): it fills radixkv, chunk by chunk;
- engine B, a fresh process, vLLM's prefix cache off: at least 95% of the prompts' full blocks come from radixkv
  (exactly every block it may load: vLLM always computes a prompt's last token), and vLLM's
  `vllm:prompt_tokens_by_source{source="external_kv_transfer"}` counts exactly those tokens;
- the server upgraded (SIGTERM: snapshot; a new server adopts it from the keeper's memory), and one block of the
  longest prompt corrupted in the pool: engine C, vLLM's prefix cache on, gets every block again, less the
  corrupted one: its checksum fails, the connector reports it as a load error and vLLM recomputes it (vLLM still
  counts it in `num_cached_tokens` and the metric: they count what the connector promised; its log says what
  was recomputed);
- then the server SIGKILLed under engine C, which serves the prompts again: vLLM goes on without it (the
  connector's calls fail, it promises nothing more), nothing fails, the outputs stay the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make test-vllm sets it up)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import run_engine  # noqa: E402
from prompts import prompt_token_ids  # noqa: E402

from radixkv.client import PoolView, RadixKVClient  # noqa: E402
from radixkv.server.process.spawn import KeeperProcess, ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(3600)  # a hang guard: engine starts wait patient(...) each, longer on a loaded machine
BLOCK = 32
START = 600  # seconds a server or keeper may take to come up: minutes on a loaded machine


def loadable(run: dict) -> list[int]:
    """The prompt tokens radixkv can serve: full blocks, less the block of a prompt's last token."""
    return [(n - 1) // BLOCK * BLOCK for n in run["num_prompt_tokens"]]


def coverage(run: dict) -> float:
    """Cached tokens over the prompts' full-block tokens."""
    return sum(run["num_cached_tokens"]) / sum(n // BLOCK * BLOCK for n in run["num_prompt_tokens"])


def corrupt_last_loadable_block(address: str, prompt: list[int]) -> None:
    """A stray write into the pool: the block's bytes no longer match the checksum its saver recorded."""
    with RadixKVClient(address) as client, PoolView.from_client(client) as pool:
        opened = client.open(prompt)
        victim = int(opened.block_table[opened.num_cached_tokens // BLOCK - 1])
        client.release(opened.seq_id, cache=False)
        pool.data[:, :, victim] += 1.0


def test_engines_share_radixkv_across_processes_an_upgrade_and_failures(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    prompts = prompt_token_ids(AutoTokenizer.from_pretrained(model_dir))
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    flags = ["--model", str(model_dir), "--block-size", str(BLOCK), "--kv-dtype", "float32", "--num-blocks", "600"]
    reference = run_engine(tmp_path / "reference.json", model_dir)["token_ids"]
    keeper = KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log", timeout=START)
    try:
        with ServerProcess(flags, tmp_path / "server.log", keeper=keeper.socket, timeout=START) as server:
            port = server.port
            a = run_engine(tmp_path / "a.json", model_dir, "--connector", server.address, "--max-batched", "256")
            b = run_engine(tmp_path / "b.json", model_dir, "--connector", server.address)
        assert a["token_ids"] == reference
        assert b["token_ids"] == reference
        assert coverage(b) >= 0.95 and b["num_cached_tokens"] == loadable(b)  # every chunk of A was saved
        assert b["prompt_tokens_by_source"]["external_kv_transfer"] == sum(b["num_cached_tokens"])
        assert b["prompt_tokens_by_source"]["local_cache_hit"] == 0  # prefix cache off: all from radixkv

        # SIGTERM above wrote the snapshot; the new server adopts it (and the checksums) from the keeper's memory.
        new_flags = [*flags, "--port", str(port)]
        with ServerProcess(new_flags, tmp_path / "upgraded.log", keeper=keeper.socket, timeout=START) as upgraded:
            corrupt_last_loadable_block(upgraded.address, prompts[longest])
            c = run_engine(
                tmp_path / "c.json", model_dir, "--connector", upgraded.address, "--prefix-caching",
                "--then-kill", str(upgraded.proc.pid),
            )  # fmt: skip
        assert c["token_ids"] == reference
        assert c["num_cached_tokens"] == loadable(c) and coverage(c) >= 0.95  # vLLM counts what it was promised,
        # and says what it recomputed: the corrupted block, reported by get_block_ids_with_load_errors.
        log = (tmp_path / "c.log").read_text()
        assert "1 of " in log and "blocks failed their digest" in log
        assert "Recovered from KV load failure: 1 request(s) rescheduled (32 tokens affected)" in log
        by_source = c["prompt_tokens_by_source"]
        assert by_source["external_kv_transfer"] + by_source["local_cache_hit"] == sum(c["num_cached_tokens"])
        assert by_source["external_kv_transfer"] > 0
        assert c["token_ids_after_kill"] == reference
        assert "radixkv match failed, computing instead" in log  # the connector stood aside
    finally:
        keeper.stop()
