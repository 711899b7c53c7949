"""The connector's scheduler side inside vLLM's real `Scheduler` (CPU config, no model, no worker): what it promises,
the load and save lists it hands the worker, chunked prefill saved chunk by chunk, a local hit that already covers
what radixkv holds, and promises radixkv cannot keep. A real radixkv server; the worker's reports are built here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make test-vllm sets it up)")

import torch  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from radixkv.client import RadixKVClient  # noqa: E402
from radixkv.server.process.spawn import ServerProcess, patient  # noqa: E402
from radixkv.vllm.compat import VERSION  # noqa: E402
from radixkv.vllm.connector import RadixKVConnector, RadixKVWorkerMetadata  # noqa: E402

BLOCK = 32
NUM_VLLM_BLOCKS = 100
START = 600  # seconds a server may take to come up: minutes on a loaded machine (tests/vllm/matrix.py runs five vLLMs)
pytestmark = pytest.mark.timeout(1800)  # a test's first one builds vLLM's config (imports): minutes under load


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ["--model", str(model_dir), "--block-size", str(BLOCK), "--kv-dtype", "float32", "--num-blocks", "64"]
    with ServerProcess(flags, tmp_path_factory.mktemp("server") / "server.log", timeout=START) as proc:
        yield proc


@pytest.fixture(scope="module")
def config(model_dir: Path, server: ServerProcess) -> VllmConfig:
    kv_transfer = KVTransferConfig(
        kv_connector="RadixKVConnector",
        kv_connector_module_path="radixkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"radixkv_address": server.address},
        kv_load_failure_policy="recompute",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = EngineArgs(
        model=str(model_dir), dtype="float32", block_size=BLOCK, enable_prefix_caching=True, max_model_len=1024,
        max_num_batched_tokens=128, enforce_eager=True, kv_transfer_config=kv_transfer,
    )  # fmt: skip
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_VLLM_BLOCKS
    init_none_hash(get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo))
    return config


@pytest.fixture
def scheduler(config: VllmConfig) -> Iterator[Scheduler]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    kv_cache_config = KVCacheConfig(NUM_VLLM_BLOCKS, [], [KVCacheGroupSpec(layers, spec)])
    sched = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK, log_stats=True)
    assert isinstance(sched.connector, RadixKVConnector)
    yield sched
    sched.connector.shutdown()


def request(req_id: str, prompt: list[int], config: VllmConfig) -> Request:
    hasher = get_request_block_hasher(BLOCK, get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo))
    return Request(req_id, prompt, SamplingParams(max_tokens=2), None, block_hasher=hasher)


def dg(n: int) -> bytes:
    """A 32-byte digest standing for one block's."""
    return n.to_bytes(32, "little")


def cache_in_radixkv(server: ServerProcess, prompt: list[int], checksums: list[bytes]) -> None:
    """What a saver before us left: the prompt's full blocks cached, with `checksums` recorded from block 0."""
    with RadixKVClient(server.address) as client:
        opened = client.open(prompt)
        client.commit([opened.seq_id], [len(prompt)])
        client.cache(opened.seq_id)
        assert client.checksums.record(opened.seq_id, 0, checksums) == len(checksums)
        client.release(opened.seq_id)


def held(server: ServerProcess, prompt: list[int]) -> int:
    with RadixKVClient(server.address) as client:
        return client.match(prompt)


def step(sched: Scheduler, saved: dict[str, dict[int, bytes]] | None = None) -> SchedulerOutput:
    """One scheduler step; the model's output: a token for each request whose prompt is done, and the worker's
    report that it saved every block the plan asked for (digest dg(1000 + block index)), less `saved` overrides."""
    out = sched.schedule()
    plan = out.kv_connector_metadata.plan  # type: ignore[union-attr]
    report: dict[str, dict[int, bytes]] = {}
    for req_id, index in zip(plan.saves.req_ids, plan.saves.indices, strict=True):
        report.setdefault(req_id, {})[index] = dg(1000 + index)
    if saved is not None:
        report = saved
    ids = list(out.num_scheduled_tokens)
    done = [
        sched.requests[r].num_computed_tokens + out.num_scheduled_tokens[r] >= sched.requests[r].num_tokens for r in ids
    ]
    # vLLM 0.34 dropped ModelRunnerOutput.req_id_to_index (the order of req_ids says it); 0.33 and older need it.
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if VERSION < (0, 34) else {}
    result = ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[7] if d else [] for d in done],
        kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=RadixKVWorkerMetadata(report)),
        **index,
    )
    sched.update_from_output(out, result)
    out.plan = plan  # type: ignore[attr-defined]
    return out


def prompt_of(seed: int, length: int) -> list[int]:
    return [seed * 10_000 + i for i in range(length)]


def test_radixkv_blocks_past_the_local_hit_are_loaded(
    scheduler: Scheduler, server: ServerProcess, config: VllmConfig
) -> None:
    prompt = prompt_of(1, 200)  # 6 full blocks and 8 tokens
    cache_in_radixkv(server, prompt, [dg(11), dg(12), dg(13), dg(14), dg(15), dg(16)])
    scheduler.add_request(request("r1", prompt, config))
    out = step(scheduler)
    plan = out.plan  # type: ignore[attr-defined]
    vllm_blocks = list(scheduler.kv_cache_manager.get_block_ids("r1")[0])
    assert out.num_scheduled_tokens == {"r1": 8}  # 192 loaded, the rest computed
    assert plan.loads.indices == list(range(6)) and plan.loads.dst == vllm_blocks[:6]
    assert plan.loads.checksums == [dg(11), dg(12), dg(13), dg(14), dg(15), dg(16)] and plan.failed == []
    assert len(set(plan.loads.src)) == 6
    assert out.scheduled_new_reqs[0].num_computed_tokens == 192


def test_a_local_hit_covering_radixkv_asks_nothing(
    scheduler: Scheduler, server: ServerProcess, config: VllmConfig
) -> None:
    prompt = prompt_of(2, 200)
    cache_in_radixkv(server, prompt[:128] + [1], [dg(21), dg(22), dg(23), dg(24)])  # radixkv: the first 4 blocks
    scheduler.add_request(request("a", prompt, config))
    first = step(scheduler)
    assert first.plan.loads.indices == [0, 1, 2, 3]  # type: ignore[attr-defined]
    while scheduler.requests.get("a") is not None and not scheduler.requests["a"].is_finished():
        step(scheduler)
    # vLLM now holds the whole prompt itself: the same prompt again hits locally, past anything radixkv adds.
    scheduler.add_request(request("b", prompt, config))
    again = step(scheduler)
    assert again.plan.loads.indices == [] and again.plan.failed == []  # type: ignore[attr-defined]
    assert again.scheduled_new_reqs[0].num_computed_tokens == 192  # vLLM's own hit
    assert scheduler.connector.get_num_new_matched_tokens(scheduler.requests["b"], 192) == (0, False)
    assert scheduler.connector._scheduler.requests["b"].seq_id is None  # type: ignore[union-attr]  # no Open either


def test_chunked_prefill_saves_every_chunk(scheduler: Scheduler, server: ServerProcess, config: VllmConfig) -> None:
    prompt = prompt_of(3, 300)  # 9 full blocks; 128-token chunks
    scheduler.add_request(request("c", prompt, config))
    saved_by_step = []
    for _ in range(3):
        out = step(scheduler)
        saved_by_step.append(out.plan.saves.indices)  # type: ignore[attr-defined]
        assert held(server, prompt) == min(len(prompt) - 1, 128 * len(saved_by_step)) // BLOCK * BLOCK
    assert saved_by_step == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    with RadixKVClient(server.address) as client:
        opened = client.open(prompt)
        assert client.checksums.get(opened.seq_id, 0, 9) == [dg(1000 + i) for i in range(9)]
        client.release(opened.seq_id, cache=False)


def test_an_unsaved_block_is_planned_again_and_nothing_past_it_committed(
    scheduler: Scheduler, server: ServerProcess, config: VllmConfig
) -> None:
    prompt = prompt_of(4, 300)
    scheduler.add_request(request("d", prompt, config))
    step(scheduler, saved={"d": {0: dg(1000), 1: dg(1001), 3: dg(1003)}})  # block 2 not written
    assert held(server, prompt) == 2 * BLOCK
    out = step(scheduler)
    assert out.plan.saves.indices == [2, 3, 4, 5, 6, 7]  # type: ignore[attr-defined]
    assert held(server, prompt) == 8 * BLOCK


def test_promises_radixkv_cannot_keep_are_failed_loads(
    scheduler: Scheduler, server: ServerProcess, config: VllmConfig
) -> None:
    # Blocks radixkv holds that no saver vouched for (an orchestrator cached them, no checksum): not loaded.
    prompt = prompt_of(5, 100)
    with RadixKVClient(server.address) as client:
        opened = client.open(prompt)
        client.commit([opened.seq_id], [len(prompt)])
        client.release(opened.seq_id)
    scheduler.add_request(request("e", prompt, config))
    out = step(scheduler)
    vllm_blocks = list(scheduler.kv_cache_manager.get_block_ids("e")[0])
    assert out.plan.failed == vllm_blocks[:3] and out.plan.loads.indices == []  # type: ignore[attr-defined]
    assert out.plan.saves.indices == []  # type: ignore[attr-defined]  # computed over a failed load: not saved


def test_the_server_gone_between_the_promise_and_the_lock(model_dir: Path, config: VllmConfig, tmp_path: Path) -> None:
    """vLLM asks, radixkv answers, radixkv dies before vLLM allocates: every promised block is a failed load."""
    flags = ["--model", str(model_dir), "--block-size", str(BLOCK), "--kv-dtype", "float32", "--num-blocks", "16"]
    proc = ServerProcess(flags, tmp_path / "server.log", timeout=START)
    try:
        own = dataclasses.replace(
            config.kv_transfer_config, kv_connector_extra_config={"radixkv_address": proc.address}
        )
        connector = RadixKVConnector(
            dataclasses.replace(config, kv_transfer_config=own), _role("SCHEDULER"), _kv_config()
        )
        prompt = prompt_of(6, 100)
        cache_in_radixkv(proc, prompt, [dg(61), dg(62), dg(63)])
        req = request("f", prompt, config)
        assert connector.get_num_new_matched_tokens(req, 0) == (96, False)
        proc.kill()
        connector.update_state_after_alloc(req, _blocks([40, 41, 42, 43]), 96)
        plan = connector._scheduler.build_plan([], lambda r: [])  # type: ignore[union-attr]
        assert plan.failed == [40, 41, 42] and len(plan.loads) == 0
        assert connector.get_num_new_matched_tokens(request("g", prompt, config), 0) == (0, False)  # computes instead
        connector.request_finished(req, [])  # the release fails quietly
    finally:
        proc.kill()


def test_a_full_pool_costs_that_request_alone(model_dir: Path, config: VllmConfig, tmp_path: Path) -> None:
    """An open radixkv refuses (OutOfBlocks: the pool cannot hold the prompt) leaves that request without loads or
    saves; the next request still asks radixkv, which answers (a refusal is not a server that is down)."""
    flags = ["--model", str(model_dir), "--block-size", str(BLOCK), "--kv-dtype", "float32", "--num-blocks", "4"]
    with ServerProcess(flags, tmp_path / "server.log", timeout=START) as proc:
        own = dataclasses.replace(
            config.kv_transfer_config, kv_connector_extra_config={"radixkv_address": proc.address}
        )
        connector = RadixKVConnector(
            dataclasses.replace(config, kv_transfer_config=own), _role("SCHEDULER"), _kv_config()
        )
        try:
            big = request("big", prompt_of(9, 200), config)  # 7 blocks: more than the pool's 4
            assert connector.get_num_new_matched_tokens(big, 0) == (0, False)
            connector.update_state_after_alloc(big, _blocks(list(range(7))), 0)
            small_prompt = prompt_of(10, 70)
            cache_in_radixkv(proc, small_prompt, [dg(91), dg(92)])
            small = request("small", small_prompt, config)
            assert connector.get_num_new_matched_tokens(small, 0) == (64, False)  # asked at once, and answered
        finally:
            connector.shutdown()


def test_a_pool_shaped_otherwise_is_refused_at_start_naming_both_values(
    model_dir: Path, config: VllmConfig, tmp_path: Path
) -> None:
    flags = ["--model", str(model_dir), "--block-size", "16", "--kv-dtype", "float16", "--num-blocks", "8"]
    with ServerProcess(flags, tmp_path / "server.log", timeout=START) as proc:
        own = dataclasses.replace(
            config.kv_transfer_config, kv_connector_extra_config={"radixkv_address": proc.address}
        )
        with pytest.raises(ValueError) as refused:
            RadixKVConnector(dataclasses.replace(config, kv_transfer_config=own), _role("WORKER"), _kv_config())
    message = str(refused.value)
    assert "block_size 16 (radixkv) != 32 (vLLM)" in message and "dtype float16 (radixkv) != float32 (vLLM)" in message
    assert "num_layers" not in message and "head_dim" not in message  # only what differs


def _role(name: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole[name]


def _kv_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    return KVCacheConfig(NUM_VLLM_BLOCKS, [], [KVCacheGroupSpec(["l0"], spec)])


def _blocks(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))


def test_take_events_relays_radixkv_blocks_with_vllms_own_hashes(config: VllmConfig, server: ServerProcess) -> None:
    """With vLLM's KV events on, `take_events` hands vLLM radixkv's stored blocks, hashed as vLLM hashes them with
    `--prefix-caching-hash-algo sha256_cbor` (so a router reading vLLM's stream finds what this engine can load)."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    events_on = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    connector = RadixKVConnector(
        dataclasses.replace(config, kv_events_config=events_on), _role("SCHEDULER"), _kv_config()
    )
    try:
        prompt = prompt_of(8, 100)
        cache_in_radixkv(server, prompt, [dg(81), dg(82), dg(83)])
        stored: list[BlockStored] = []
        deadline = time.monotonic() + patient(60)
        while not stored and time.monotonic() < deadline:  # the relay's thread delivers them: wait for it
            stored = [e for e in connector.take_events() if isinstance(e, BlockStored)]
            time.sleep(0.05)
    finally:
        connector.shutdown()
    sha256_cbor = get_hash_fn_by_name("sha256_cbor")
    try:
        init_none_hash(sha256_cbor)
        expected, parent = [], None
        for i in range(3):
            parent = hash_block_tokens(sha256_cbor, parent, prompt[i * BLOCK : (i + 1) * BLOCK])
            expected.append(int.from_bytes(parent, "big") & (2**64 - 1))  # vLLM's int form of its block hashes
    finally:
        init_none_hash(get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo))
    assert [h for e in stored for h in e.block_hashes] == expected
    assert [t for e in stored for t in e.token_ids] == prompt[:96]
    assert {e.medium for e in stored} == {"CPU"} and stored[0].parent_block_hash is None
