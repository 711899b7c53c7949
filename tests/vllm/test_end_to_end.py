"""radixkv behind an unmodified vLLM, end to end: real radixkv servers, real vLLM engines, each in its own process.

Engine A serves the prompts with the connector; engine B, a fresh process, serves them again and must find at
least 95% of the prompts' full blocks in radixkv (the blocks it may load: vLLM always computes a prompt's last
token), with vLLM's own prefix cache off (every cached token came from radixkv) and on, its
`vllm:prompt_tokens_by_source{source="external_kv_transfer"}` agreeing; and every greedy output token-identical
to a run without the connector. The same after an upgrade of the server (SIGTERM, restart on its keeper), and
when loads fail: a block whose bytes no longer match their checksum, and the server killed under the engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make test-vllm sets it up)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import run_engine  # noqa: E402

from radixkv.client import PoolView, RadixKVClient  # noqa: E402
from radixkv.server.process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(1800)
BLOCK = 32


def serve_flags(model: Path) -> list[str]:
    return ["--model", str(model), "--block-size", str(BLOCK), "--kv-dtype", "float32", "--num-blocks", "600"]


def loadable_tokens(run: dict) -> list[int]:
    """The prompt tokens radixkv can serve: full blocks, less the block of a prompt's last token."""
    return [(n - 1) // BLOCK * BLOCK for n in run["num_prompt_tokens"]]


def full_block_tokens(run: dict) -> list[int]:
    return [n // BLOCK * BLOCK for n in run["num_prompt_tokens"]]


def coverage(run: dict) -> float:
    return sum(run["num_cached_tokens"]) / sum(full_block_tokens(run))


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The prompts without the connector: the outputs every run must reproduce token for token."""
    return run_engine(tmp_path_factory.mktemp("ref") / "ref.json", model_dir)


def test_a_fresh_engine_gets_the_prompts_from_radixkv(model_dir: Path, reference: dict, tmp_path: Path) -> None:
    with ServerProcess(serve_flags(model_dir), tmp_path / "server.log") as server:
        a = run_engine(tmp_path / "a.json", model_dir, "--connector", server.address, "--max-batched", "256")
        assert a["token_ids"] == reference["token_ids"]  # chunked prefill (256-token chunks), every chunk saved
        b = run_engine(tmp_path / "b.json", model_dir, "--connector", server.address)
        b_on = run_engine(tmp_path / "b_on.json", model_dir, "--connector", server.address, "--prefix-caching")
    for run in (b, b_on):
        assert run["token_ids"] == reference["token_ids"]
        assert coverage(run) >= 0.95, (run["num_cached_tokens"], full_block_tokens(run))
        assert run["num_cached_tokens"] == loadable_tokens(run)
    # Prefix cache off: every cached token came from radixkv, and vLLM's own metric says so.
    assert b["prompt_tokens_by_source"]["external_kv_transfer"] == sum(b["num_cached_tokens"])
    assert b["prompt_tokens_by_source"]["local_cache_hit"] == 0
    on = b_on["prompt_tokens_by_source"]
    assert on["external_kv_transfer"] + on["local_cache_hit"] == sum(b_on["num_cached_tokens"])
    assert on["external_kv_transfer"] > 0


def test_the_cache_survives_a_radixkv_upgrade(model_dir: Path, reference: dict, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with ServerProcess(serve_flags(model_dir), tmp_path / "old.log", state_dir=state) as server:
        port = server.port
        a = run_engine(tmp_path / "a.json", model_dir, "--connector", server.address)
    # Left: SIGTERM, snapshot written beside the keeper's memory. The new server adopts it, checksums included.
    with ServerProcess([*serve_flags(model_dir), "--port", str(port)], tmp_path / "new.log", state_dir=state) as new:
        b = run_engine(tmp_path / "b.json", model_dir, "--connector", new.address)
    assert a["token_ids"] == b["token_ids"] == reference["token_ids"]
    assert coverage(b) >= 0.95, b["num_cached_tokens"]
    assert b["prompt_tokens_by_source"]["external_kv_transfer"] == sum(b["num_cached_tokens"])


def test_a_block_failing_its_checksum_is_recomputed(model_dir: Path, reference: dict, tmp_path: Path) -> None:
    from prompts import test_prompts
    from transformers import AutoTokenizer

    with ServerProcess(serve_flags(model_dir), tmp_path / "server.log") as server:
        run_engine(tmp_path / "a.json", model_dir, "--connector", server.address)
        prompt = test_prompts(AutoTokenizer.from_pretrained(model_dir))[0]
        with RadixKVClient(server.address) as client, PoolView.from_client(client) as pool:
            opened = client.open(prompt)
            assert opened.num_cached_tokens >= 3 * BLOCK
            victim = int(opened.block_table[2])  # in the system prompt every prompt shares
            client.release(opened.seq_id, cache=False)
            pool.data[:, :, victim] += 1.0  # a stray write: the bytes no longer match their checksum
        b = run_engine(tmp_path / "b.json", model_dir, "--connector", server.address)
    assert b["token_ids"] == reference["token_ids"]
    assert sum(b["num_cached_tokens"]) < sum(loadable_tokens(b))  # from the victim on, recomputed
    assert b["prompt_tokens_by_source"]["external_kv_transfer"] > 0


def test_the_server_killed_under_the_engine(model_dir: Path, reference: dict, tmp_path: Path) -> None:
    """SIGKILL between two batches of B's prompts: the rest are computed, vLLM goes on, outputs unchanged."""
    server = ServerProcess(serve_flags(model_dir), tmp_path / "server.log")
    try:
        run_engine(tmp_path / "a.json", model_dir, "--connector", server.address)
        b = run_engine(
            tmp_path / "b.json", model_dir, "--connector", server.address, "--kill-after", "10",
            "--kill-pid", str(server.proc.pid),
        )  # fmt: skip
    finally:
        server.kill()
    assert b["token_ids"] == reference["token_ids"]
    cached = b["num_cached_tokens"]
    assert cached[:10] == loadable_tokens(b)[:10] and cached[10:] == [0] * 10
