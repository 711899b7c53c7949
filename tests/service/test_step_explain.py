"""Explain on the Session stream: an open item asking for it gets exactly what the unary open(explain) says.

The twin property: for each reason, the same prompt opened both ways against the same pool state
(each open released uncached, so the tree is as it was) is explained the same, evicted time included.
"""

from __future__ import annotations

import itertools

import grpc
import pytest

from radixkv.client import MatchExplanation, RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.errors import InvalidArgument
from radixkv.sequences.step import Step
from radixkv.server.process.spawn import patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc

_namespaces = itertools.count()
_BASE = 7_460_000  # token ids no other test of the shared server uses


def _cache(client: RadixKVClient, prompt: list[int], namespace: str) -> None:
    opened = client.open(prompt, namespace)
    client.commit([opened.seq_id], [len(prompt)])
    client.release(opened.seq_id)


def _twins(client: RadixKVClient, prompt: list[int], namespace: str) -> tuple[MatchExplanation, MatchExplanation]:
    """The unary open's explanation and the stream's, each open released uncached (the tree stays as it was)."""
    opened, unary = client.open(prompt, namespace, explain=True)
    client.release(opened.seq_id, cache=False)
    result = client.step(Step(opens=[(prompt, namespace)], explain=[True]))
    client.release(result.opened[0].seq_id, cache=False)
    assert result.opened[0].num_cached_tokens == opened.num_cached_tokens
    return unary, result.explanations[0]


def test_each_reason_on_the_stream_equals_the_unary_open(server, debug) -> None:  # type: ignore[no-untyped-def]
    ns = f"twin-{next(_namespaces)}"
    prompt = list(range(_BASE, _BASE + 8))  # two blocks of 4
    with RadixKVClient(server.address) as client:
        reasons = {}
        unary, stream = _twins(client, prompt, ns)
        reasons[unary.reason] = stream == unary
        _cache(client, prompt, ns)
        for tokens, namespace in (
            (prompt, ns),  # fully cached: LAST_TOKEN
            ([*prompt, 9, 9], ns),  # PARTIAL_BLOCK
            ([*prompt, 1, 2, 3, 4, 5], ns),  # a full block nobody cached: NEVER_CACHED past a hit
            (prompt, f"{ns}-b"),  # OTHER_NAMESPACE
        ):
            unary, stream = _twins(client, tokens, namespace)
            assert stream == unary, (tokens, namespace)
            reasons[unary.reason] = True
        assert unary.other_namespace == ns
    assert set(reasons) == {"NEVER_CACHED", "LAST_TOKEN", "PARTIAL_BLOCK", "OTHER_NAMESPACE"}
    assert all(reasons.values())
    debug.check()


def test_evicted_on_the_stream_says_the_same_when(server, debug) -> None:  # type: ignore[no-untyped-def]
    ns = f"twin-evict-{next(_namespaces)}"
    prompt = list(range(_BASE + 1000, _BASE + 1016))  # 4 full blocks of the 8-block tiny pool
    with RadixKVClient(server.address, pool="tiny") as client:
        _cache(client, prompt, ns)
        big = client.open(list(range(_BASE + 2000, _BASE + 2032)), f"{ns}-other")  # 8 blocks: evicts the four
        client.release(big.seq_id, cache=False)
        unary, stream = _twins(client, [*prompt, 1], ns)
        assert unary.reason == "EVICTED" and unary.evicted_at_unix_ns > 0
        assert stream == unary
    debug.check("tiny")


# type: ignore[no-untyped-def]
def test_only_the_opens_that_ask_are_explained_and_a_retried_step_keeps_them(server) -> None:
    ns = f"twin-mixed-{next(_namespaces)}"
    asked, silent = list(range(_BASE + 3000, _BASE + 3006)), list(range(_BASE + 3100, _BASE + 3106))
    with RadixKVClient(server.address) as client:
        step = Step(opens=[(asked, ns), (silent, ns)], explain=[True, False])
        first = client.step(step, request_id=777_001)
        assert first.explanations == [MatchExplanation(num_cached_tokens=0, reason="NEVER_CACHED", block_index=0), None]
        again = client.step(step, request_id=777_001)  # re-sent: answered from the window, not applied twice
        assert [r.seq_id for r in again.opened] == [r.seq_id for r in first.opened]
        assert again.explanations == first.explanations
        plain = client.step(Step(opens=[(asked, ns)]))
        assert plain.explanations == ()  # a step that asks for nothing is answered as before
        client.release_many([r.seq_id for r in first.opened] + [plain.opened[0].seq_id], cache=False)
        with pytest.raises(InvalidArgument, match="explain"):
            client.step(Step(opens=[(asked, ns)], explain=[True, True]))


@pytest.mark.asyncio
async def test_the_async_client_explains_a_stream_open(server) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(_BASE + 4000, _BASE + 4008))
    async with AsyncRadixKVClient(server.address) as client:
        result = await client.step(Step(opens=[(prompt, f"twin-aio-{next(_namespaces)}")], explain=[True]))
        assert result.explanations == [MatchExplanation(num_cached_tokens=0, reason="NEVER_CACHED", block_index=0)]
        await client.release(result.opened[0].seq_id, cache=False)


def test_every_server_reason_has_its_wire_value_and_the_client_names_it_back() -> None:
    """HOST_TIER included: reserved for the host tier, it already round-trips (an additive enum value)."""
    from radixkv.server.rules.miss_reasons import MissExplanation, MissReason, wire_reason
    from radixkv.v1 import kvcache_pb2 as pb

    for reason in MissReason:
        wire = wire_reason(MissExplanation(reason=reason, block_index=3, num_missed_tokens=5))
        assert MatchExplanation.from_response(pb.StepOpened(miss_reason=wire, miss_block_index=3)).reason == reason.name
    assert pb.MissReason.Name(pb.MISS_REASON_HOST_TIER) == "MISS_REASON_HOST_TIER"


TIERED = "tiered:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8,dtype=float32,host_num_blocks=16"


def test_host_tier_explains_a_match_and_an_open_loads_past_it(start_server) -> None:  # type: ignore[no-untyped-def]
    """Evicted from the device into the host tier: Match says HOST_TIER; open loads it back, so its prefix ends
    past both tiers, on the stream exactly as in the unary call."""
    server = start_server("--pool", TIERED, "--debug-rpc", pool_flags=False)
    prompt = list(range(_BASE + 5000, _BASE + 5009))  # 2 full blocks and 1 token
    with RadixKVClient(server.address, pool="tiered") as client:
        _cache(client, prompt, "")
        fillers = [client.open([_BASE + 6000 + i] * 16).seq_id for i in range(2)]  # 8 blocks: the prompt's go to host
        why = client.match(prompt, explain=True)
        assert why == MatchExplanation(num_cached_tokens=0, reason="HOST_TIER", block_index=0, num_host_cached_tokens=8)
        assert client.match(prompt[:4], explain=True).reason == "HOST_TIER"  # one host-resident block past nothing
        client.release_many(fillers, cache=False)
        unary, stream = _twins(client, prompt, "")
        assert unary == stream == MatchExplanation(num_cached_tokens=8, reason="PARTIAL_BLOCK", block_index=2)
    with grpc.insecure_channel(server.address) as channel:
        debug = debug_pb2_grpc.DebugStub(channel)
        assert not debug.CheckInvariants(debug_pb2.CheckInvariantsRequest(pool="tiered"), timeout=patient(10)).violation
