"""Admission by token budget, preemption and tenant token budgets over the wire, against a real server process.

Every refusal is checked for its status code, reason and numbers, and the server's invariants after it.
Pool "small": 16 blocks of 4 tokens, no watermark; pool "wm": 100 blocks, the default 1% watermark.
Tenant ops: admin, no token budget; tenant slow: 40 tokens per second.
"""

from __future__ import annotations

import itertools
import math
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from radixkv.client import RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotAdmitted,
    OutOfBlocks,
    SequencePreempted,
    TokenBudget,
    UnknownSequence,
)
from radixkv.sequences.step import Append, Step
from radixkv.server.process.spawn import ServerProcess, patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc
from tests.service.conftest import Debug

OPS = "ops-token"
SLOW = [f"slow-{i}-token" for i in range(4)]  # one tenant per test: each starts with a full bucket
# slow3's bucket refills slowly: its test's refusal must hold however long a loaded machine takes between calls
RATES = [40, 40, 40, 4]
TOKENS = f"""
[tenants.ops]
token = "{OPS}"
admin = true
""" + "".join(
    f"""
[tenants.slow{i}]
token = "{token}"
max_tokens_per_second = {rate}
"""
    for i, (token, rate) in enumerate(zip(SLOW, RATES, strict=True))
)
POOLS = [
    "--pool", "small:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=16,dtype=float16,"
    "watermark_fraction=0.0",
    "--pool", "wm:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=100,dtype=float16",
]  # fmt: skip
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d: Path = tmp_path_factory.mktemp("admission")
    (d / "tokens.toml").write_text(TOKENS)
    proc = ServerProcess(
        [*POOLS, "--debug-rpc", "--metrics-port", "0", "--auth-tokens", str(d / "tokens.toml")], d / "server.log"
    )
    yield proc
    assert proc.stop() == 0, (d / "server.log").read_text()[-2000:]


@pytest.fixture(scope="module")
def debug(server: ServerProcess) -> Iterator[Debug]:
    d = Debug(server.address, token=OPS)
    yield d
    d.close()


@pytest.fixture
def client(server: ServerProcess, debug: Debug) -> Iterator[RadixKVClient]:
    """A session on the small pool; everything it opened is released after the test, leaving the pool empty."""
    with RadixKVClient(server.address, pool="small", token=OPS) as c:
        yield c
    debug.check("small")


@pytest.fixture
def ns() -> str:
    return f"admit-{next(_namespaces)}"


def test_a_budgeted_open_reserves_its_growth_and_appends_into_it(client: RadixKVClient, debug: Debug, ns: str) -> None:
    a = client.open([1, 2, 3, 4], ns, max_new_tokens=12, priority=2)  # 1 block + 3 reserved
    stats = client.stats()
    assert (stats.num_blocks_reserved, stats.num_blocks_in_use) == (1 * 3, 1)
    assert stats.memory_pressure == 4 / 16 and stats.pressure_band == "normal"
    filler = client.open(list(range(100, 148)), ns)  # 12 blocks: all that the reservation leaves
    with pytest.raises(OutOfBlocks) as refused:
        client.open([9], ns)
    assert (refused.value.needed, refused.value.free) == (1, 0)
    debug.check("small")
    for token in range(12):
        client.append(a.seq_id, [token])  # drawn from its reservation: never refused
    assert client.stats().num_blocks_reserved == 0 and len(client.block_table(a.seq_id)) == 4
    assert client.stats().pressure_band == "danger"
    client.release_many([a.seq_id, filler.seq_id], cache=False)


def test_not_admitted_carries_the_numbers(client: RadixKVClient, debug: Debug, ns: str) -> None:
    held = client.open([1, 2, 3, 4], ns, max_new_tokens=12)  # 4 of 16 blocks
    before = client.stats()
    with pytest.raises(NotAdmitted) as refused:
        client.open(list(range(40)), ns, max_new_tokens=12)  # 10 prompt blocks + 3 reserved > 12
    assert refused.value.reason == "NOT_ADMITTED" and refused.value.grpc_code == "RESOURCE_EXHAUSTED"
    assert (refused.value.blocks_needed, refused.value.blocks_available) == (13, 12)
    after = client.stats()
    assert after.num_admission_refusals == before.num_admission_refusals + 1
    assert (after.num_blocks_free, after.num_blocks_reserved) == (before.num_blocks_free, before.num_blocks_reserved)
    debug.check("small")
    client.release(held.seq_id, cache=False)


def test_not_admitted_as_a_raw_status(server: ServerProcess, client: RadixKVClient, ns: str) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        request = pb.OpenSequencesRequest(
            pool="small", session_id=client.session_id,
            prompts=[pb.Prompt(token_ids=list(range(8)), namespace=ns, max_new_tokens=100)],
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            stub.OpenSequences(request, metadata=(("authorization", f"Bearer {OPS}"),), timeout=patient(10))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(refused.value)
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert (info.reason, info.metadata["blocks_needed"], info.metadata["blocks_available"]) == (
        "NOT_ADMITTED",
        "27",
        "16",
    )
    assert "27" in status.message and "16" in status.message


def test_the_watermark_holds_back_budgeted_opens(server: ServerProcess, debug: Debug, ns: str) -> None:
    with RadixKVClient(server.address, pool="wm", token=OPS) as c:
        with pytest.raises(NotAdmitted) as refused:
            c.open(list(range(4 * 99)), ns, max_new_tokens=4)
        assert (refused.value.blocks_needed, refused.value.blocks_available) == (100, 99)
        debug.check("wm")
        opened = c.open(list(range(4 * 100)), ns)  # no budget: the whole pool, as before
        assert len(opened.block_table) == 100
    debug.check("wm")


def test_preempt_and_resume_by_recompute(client: RadixKVClient, debug: Debug, ns: str) -> None:
    a = client.open(list(range(10)), ns, max_new_tokens=6)  # 3 blocks + 1 reserved
    client.commit([a.seq_id], [10])
    result = client.preempt([a.seq_id], "recompute")
    assert (result.seq_ids, result.mode, result.offloads.tolist()) == ([a.seq_id], "recompute", [])
    assert result.num_freed_blocks == 3 and result.num_unreserved_blocks == 16
    assert client.block_table(a.seq_id) == []
    stats = client.stats()
    assert (stats.num_preempted_sequences, stats.num_preemptions_recompute, stats.num_blocks_reserved) == (1, 1, 0)
    assert client.describe_sequences([a.seq_id]) == [(10, 0)]
    debug.check("small")

    resumed = client.resume(a.seq_id)
    assert resumed.seq_id == a.seq_id and resumed.num_cached_tokens == 8 and not len(resumed.loads)
    assert len(resumed.block_table) == 3 and client.block_table(a.seq_id) == resumed.block_table.tolist()
    table = resumed.block_table
    assert np.asarray(resumed.slots).tolist() == [table[p // 4] * 4 + p % 4 for p in range(8, 10)]
    assert client.stats().num_blocks_reserved == 1
    client.append(a.seq_id, [1, 2])
    debug.check("small")
    client.release(a.seq_id, cache=False)


def test_what_a_preempt_caches_stays_within_the_tenants_cache_share(client: RadixKVClient, ns: str) -> None:
    share = 16 // (1 + len(SLOW))  # an even share of the small pool among the tenants
    a = client.open(list(range(24)), ns)  # 6 blocks
    client.commit([a.seq_id], [24])
    client.preempt([a.seq_id], "recompute")
    assert sum(client.verify().num_blocks.values()) <= share, "a preempt cached past the tenant's share"
    resumed = client.resume(a.seq_id)
    assert resumed.num_cached_tokens <= share * 4
    client.release(a.seq_id, cache=False)


def test_a_preempted_sequence_is_failed_precondition_except_for_resume_and_release(
    client: RadixKVClient, debug: Debug, ns: str
) -> None:
    a = client.open(list(range(6)), ns)
    client.preempt([a.seq_id], "recompute")
    for call in (
        lambda: client.append(a.seq_id, [1]),
        lambda: client.fork(a.seq_id, 1),
        lambda: client.cache(a.seq_id),
        lambda: client.commit([a.seq_id], [1]),
        lambda: client.preempt([a.seq_id], "recompute"),
        lambda: client.can_append([a.seq_id], [1]),
    ):
        with pytest.raises(SequencePreempted) as refused:
            call()
        assert refused.value.reason == "SEQUENCE_PREEMPTED" and refused.value.seq_id == a.seq_id
        assert refused.value.field in ("seq_id", "seq_ids[0]")
        debug.check("small")
    client.release(a.seq_id)
    with pytest.raises(UnknownSequence):
        client.resume(a.seq_id)
    debug.check("small")


def test_preempt_and_resume_refusals(client: RadixKVClient, debug: Debug, ns: str) -> None:
    a = client.open(list(range(6)), ns)
    with pytest.raises(FailedPrecondition) as no_tier:
        client.preempt([a.seq_id], "swap")
    assert no_tier.value.reason == "FAILED_PRECONDITION" and no_tier.value.metadata["field"] == "mode"
    with pytest.raises(FailedPrecondition) as live:
        client.resume(a.seq_id)
    assert live.value.metadata["field"] == "seq_id"
    with pytest.raises(UnknownSequence):
        client.preempt([a.seq_id, 987654321], "recompute")
    with pytest.raises(InvalidArgument) as bad_mode:
        client.preempt([a.seq_id], "drop")
    assert bad_mode.value.field == "mode"
    debug.check("small")
    client.preempt([a.seq_id], "recompute")
    filler = client.open(list(range(200, 264)), ns)  # the whole pool
    with pytest.raises(OutOfBlocks) as refused:
        client.resume(a.seq_id)
    assert (refused.value.needed, refused.value.free) == (2, 0)
    debug.check("small")
    client.release_many([filler.seq_id, a.seq_id], cache=False)


def test_unspecified_mode_is_invalid_argument_naming_the_field(server: ServerProcess, client: RadixKVClient) -> None:
    a = client.open([1, 2, 3])
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        request = pb.PreemptRequest(pool="small", session_id=client.session_id, seq_ids=[a.seq_id])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Preempt(request, metadata=(("authorization", f"Bearer {OPS}"),), timeout=patient(10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.release(a.seq_id)


def test_victims_are_the_sessions_own_by_priority_then_latest(
    server: ServerProcess, client: RadixKVClient, ns: str
) -> None:
    low_old = client.open([1] * 4, ns, priority=0)
    high = client.open([2] * 4, ns, priority=7)
    low_new = client.open([3] * 4, ns, priority=0)
    with RadixKVClient(server.address, pool="small", token=OPS) as other:
        theirs = other.open([4] * 4, ns, priority=-5)
        assert other.victims(1) == [theirs.seq_id]
        assert client.victims(1) == [low_new.seq_id], "another session's sequences are never listed"
        assert client.victims(2) == [low_new.seq_id, low_old.seq_id]
        assert client.victims(99) == [low_new.seq_id, low_old.seq_id, high.seq_id]
        client.preempt([low_new.seq_id], "recompute")
        assert client.victims(1) == [low_old.seq_id]
    client.release_many([low_old.seq_id, high.seq_id, low_new.seq_id], cache=False)


def test_a_session_stream_step_admits_with_a_budget(client: RadixKVClient, debug: Debug, ns: str) -> None:
    result = client.step(Step(opens=[([1, 2, 3, 4, 5], ns)], max_new_tokens=[7], priorities=[3]))
    seq = result.opened[0].seq_id
    assert client.stats().num_blocks_reserved == 1
    with pytest.raises(NotAdmitted) as refused:
        client.step(Step(opens=[(list(range(50)), ns)], max_new_tokens=[8]))
    assert refused.value.metadata["item"] == "opens"
    debug.check("small")
    client.step(Step(append=Append([seq], [4], [6, 7, 8, 9])))  # 9 tokens: the third block, the reserved one
    assert client.stats().num_blocks_reserved == 0
    client.release(seq, cache=False)


def _slow_client(server: ServerProcess, i: int) -> RadixKVClient:
    """A session of tenant slow<i>: 40 tokens per second, a bucket of 40."""
    return RadixKVClient(server.address, pool="small", token=SLOW[i])


def retry_bounds(deficit_tokens: float, rate: float, elapsed: float) -> tuple[float, float]:
    """What a refusal's retry delay may be: the deficit right after the charge that caused it, in seconds (rounded
    up to whole ms, as the server sends it), less what the bucket refilled in `elapsed`, the most time that can
    have passed between that charge and the refusal; never under 1 ms. No bound on how fast the machine is."""
    most = math.ceil(deficit_tokens / rate * 1000) / 1000
    return max(0.001, most - elapsed - 0.001), most


def test_a_token_budget_refuses_with_a_retry_delay(server: ServerProcess, debug: Debug) -> None:
    with _slow_client(server, 0) as slow:
        started = time.monotonic()
        a = slow.open([1, 2, 3, 4], "chat", max_new_tokens=30)  # 34 of 40 tokens
        with pytest.raises(TokenBudget) as refused:
            slow.open([5, 6, 7, 8], "chat", max_new_tokens=8)  # 12 more: 6 left
        elapsed = time.monotonic() - started
        e = refused.value
        assert (e.reason, e.grpc_code, e.tenant, e.num_tokens) == ("TOKEN_BUDGET", "RESOURCE_EXHAUSTED", "slow0", 12)
        low, high = retry_bounds(12 - 6, 40, elapsed)  # (12 - 6) / 40 s, less what refilled between the calls
        assert e.retry_delay is not None and low <= e.retry_delay <= high, (e.retry_delay, elapsed)
        assert e.retry_delay == pytest.approx(e.retry_after_ms / 1000)
        debug.check("small")
        time.sleep(e.retry_delay + 0.05)
        b = slow.open([5, 6, 7, 8], "chat", max_new_tokens=8)
        slow.release_many([a.seq_id, b.seq_id], cache=False)
    debug.check("small")


def test_a_token_budget_refusal_carries_retry_info_on_the_wire(server: ServerProcess) -> None:
    with _slow_client(server, 1) as slow, grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        request = pb.OpenSequencesRequest(
            pool="small", session_id=slow.session_id, prompts=[pb.Prompt(token_ids=[1], max_new_tokens=60)]
        )
        metadata = (("authorization", f"Bearer {SLOW[1]}"),)
        started = time.monotonic()
        opened = stub.OpenSequences(request, metadata=metadata, timeout=patient(10))  # a full bucket admits a large one
        with pytest.raises(grpc.RpcError) as refused:
            stub.OpenSequences(request, metadata=metadata, timeout=patient(10))  # then the bucket is in debt
        elapsed = time.monotonic() - started
        slow.release(opened.sequences[0].seq_id, cache=False)
    status = rpc_status.from_call(refused.value)
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR))
    # 61 tokens from a bucket of 40 leave it 21 in debt; the next needs 40: (21 + 40) / 40 s, less what refilled.
    low, high = retry_bounds(21 + 40, 40, elapsed)
    assert low <= retry.retry_delay.ToTimedelta().total_seconds() <= high, elapsed


def test_a_session_step_over_the_token_budget_is_refused_whole(server: ServerProcess, debug: Debug) -> None:
    with RadixKVClient(server.address, pool="small", token=SLOW[3]) as slow:
        a = slow.step(Step(opens=[([1, 2, 3], "chat")], max_new_tokens=[30])).opened[0]  # 33: a full bucket of 4 admits
        # it and is 29 in debt, so the next 10 tokens wait ~10 s (at 40/s, 75 ms of a loaded machine refilled them)
        with pytest.raises(TokenBudget) as refused:
            slow.step(Step(opens=[([4, 5, 6], "chat")], max_new_tokens=[7], append=Append([a.seq_id], [1], [9])))
        e = refused.value
        assert (e.metadata["item"], e.num_tokens) == ("opens", 10) and e.retry_delay == e.retry_after_ms / 1000 > 0
        assert slow.describe_sequences([a.seq_id]) == [(3, 0)], "the refused step's append was not applied"
        slow.release(a.seq_id, cache=False)
    debug.check("small")


def test_a_refused_open_is_not_charged(server: ServerProcess) -> None:
    with _slow_client(server, 2) as slow:
        with pytest.raises(NotAdmitted):
            slow.open(list(range(66)), "chat", max_new_tokens=4)  # 17 + 1 blocks of 16: refused, 70 tokens refunded
        a = slow.open(list(range(30)), "chat", max_new_tokens=10)  # 40 tokens: only a full bucket pays them
        slow.release(a.seq_id, cache=False)


def test_metrics_report_pressure_preemptions_and_refusals(server: ServerProcess, client: RadixKVClient) -> None:
    a = client.open([1, 2, 3, 4], max_new_tokens=4)
    client.preempt([a.seq_id], "recompute")
    with pytest.raises(NotAdmitted):
        client.open(list(range(60)), max_new_tokens=8)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as r:
        text = r.read().decode()
    assert 'radixkv_reserved_blocks{pool="small"} 0.0' in text
    assert 'radixkv_memory_pressure_ratio{pool="small"}' in text
    assert 'radixkv_preempted_sequences{pool="small"} 1.0' in text
    assert _value(text, 'radixkv_preemptions_total{mode="recompute",pool="small"}') >= 1
    assert _value(text, 'radixkv_admission_refusals_total{pool="small",reason="NOT_ADMITTED"}') >= 1
    assert 'radixkv_admission_refusals_total{pool="small",reason="TOKEN_BUDGET"}' in text
    client.release(a.seq_id)


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} missing")


@pytest.mark.asyncio
async def test_the_async_client_preempts_resumes_and_lists_victims(server: ServerProcess, debug: Debug) -> None:
    async with AsyncRadixKVClient(server.address, pool="small", token=OPS) as c:
        a = await c.open([1, 2, 3, 4, 5], max_new_tokens=3, priority=1)
        assert await c.victims(1) == [a.seq_id]
        await c.commit([a.seq_id], [5])
        preempted = await c.preempt([a.seq_id], "recompute")
        assert preempted.seq_ids == [a.seq_id]
        resumed = await c.resume(a.seq_id)
        assert resumed.num_cached_tokens == 4 and len(resumed.slots) == 1
        await c.release(a.seq_id, cache=False)
    debug.check("small")
