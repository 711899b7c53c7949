"""Match with explain: each reason produced on purpose against a real server, and tenant isolation."""

from __future__ import annotations

import itertools
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from radixkv.client import MatchExplanation, RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.server.events.hub import Tombstones
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc
from tests.service.conftest import ACME_TOKEN, GLOBEX_TOKEN

_namespaces = itertools.count()
_BASE = 7_340_000  # token ids no other test of the shared server uses, so only these tests cache them


def _cache(client: RadixKVClient, prompt: list[int], namespace: str) -> None:
    """Compute (commit) every token of `prompt` and cache its full blocks."""
    opened = client.open(prompt, namespace)
    client.commit([opened.seq_id], [len(prompt)])
    client.release(opened.seq_id)


def _miss_tokens(server, reason: str) -> float:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as r:
        text = r.read().decode()
    found = re.search(rf'^radixkv_miss_tokens_total{{pool="default",reason="{reason}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_plain_match_still_returns_an_int(server) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client:
        assert client.match(list(range(_BASE + 5000, _BASE + 5008)), f"plain-{next(_namespaces)}") == 0


def test_never_cached_partial_block_and_fully_cached(server, debug) -> None:  # type: ignore[no-untyped-def]
    ns = f"explain-{next(_namespaces)}"
    prompt = list(range(_BASE + 1000, _BASE + 1008))  # two blocks of 4
    with RadixKVClient(server.address) as client:
        before = _miss_tokens(server, "NEVER_CACHED")
        never = client.match(prompt, ns, explain=True)
        assert never == MatchExplanation(num_cached_tokens=0, reason="NEVER_CACHED", block_index=0)
        assert _miss_tokens(server, "NEVER_CACHED") == before + 8
        _cache(client, prompt, ns)
        assert client.match(prompt, ns, explain=True) == MatchExplanation(
            num_cached_tokens=8, reason="FULLY_CACHED", block_index=2
        )
        partial = client.match([*prompt, 7, 7, 7], ns, explain=True)
        assert partial == MatchExplanation(num_cached_tokens=8, reason="PARTIAL_BLOCK", block_index=2)
        # A full block past the cached prefix that nobody ever cached.
        assert client.match([*prompt, 1, 2, 3, 4], ns, explain=True) == MatchExplanation(
            num_cached_tokens=8, reason="NEVER_CACHED", block_index=2
        )
    debug.check()


def test_evicted_after_pressure_says_when(server, debug) -> None:  # type: ignore[no-untyped-def]
    ns = f"evict-{next(_namespaces)}"
    prompt = list(range(_BASE + 2000, _BASE + 2016))  # 4 full blocks of the 8-block tiny pool
    with RadixKVClient(server.address, pool="tiny") as client:
        _cache(client, prompt, ns)
        assert client.match(prompt, ns) == 16
        before = time.time_ns()
        big = client.open(list(range(_BASE + 3000, _BASE + 3032)), f"{ns}-other")  # 8 blocks: evicts all four
        after = time.time_ns()
        client.release(big.seq_id, cache=False)
        why = client.match(prompt, ns, explain=True)
        assert (why.num_cached_tokens, why.reason, why.block_index) == (0, "EVICTED", 0)
        assert before <= why.evicted_at_unix_ns <= after
        # The same tokens in a namespace that never held them were never cached there.
        assert client.match(prompt, f"{ns}-never", explain=True).reason == "NEVER_CACHED"
    with grpc.insecure_channel(server.address) as channel:
        stats = kvcache_pb2_grpc.KVCacheStub(channel).Stats(pb.StatsRequest(pool="tiny"), timeout=patient(5))
    assert stats.num_tombstones >= 4  # the four evicted blocks, at least
    assert stats.tombstone_bytes == stats.num_tombstones * Tombstones.ENTRY_BYTES
    debug.check("tiny")


def test_other_namespace_names_where_the_tokens_are(server) -> None:  # type: ignore[no-untyped-def]
    ns = f"other-{next(_namespaces)}"
    prompt = list(range(_BASE + 4000, _BASE + 4012))
    with RadixKVClient(server.address) as client:
        _cache(client, prompt, f"{ns}-b")
        why = client.match(prompt, f"{ns}-a", explain=True)
        assert why == MatchExplanation(
            num_cached_tokens=0, reason="OTHER_NAMESPACE", block_index=0, other_namespace=f"{ns}-b"
        )


@pytest.fixture
def tenant(auth_server, tls_files: tuple[Path, Path]) -> Iterator:  # type: ignore[no-untyped-def,type-arg]
    opened: list[RadixKVClient] = []

    def connect(token: str) -> RadixKVClient:
        opened.append(RadixKVClient(auth_server.address, token=token, tls_root_cert=str(tls_files[0])))
        return opened[-1]

    yield connect
    for client in opened:
        client.close()


def test_another_tenants_prefix_is_never_cached_for_you(tenant) -> None:  # type: ignore[no-untyped-def]
    acme, globex = tenant(ACME_TOKEN), tenant(GLOBEX_TOKEN)
    prompt = list(range(_BASE + 6000, _BASE + 6008))
    _cache(globex, prompt, "0-explain")  # globex's own namespace (sorts first among the few explain matches)
    # acme's "chat": the same tokens sit in globex's namespaces only, which acme may never learn of.
    assert acme.match(prompt, "chat", explain=True) == MatchExplanation(
        num_cached_tokens=0, reason="NEVER_CACHED", block_index=0
    )
    # globex itself is told where they are.
    assert globex.match(prompt, "chat", explain=True).other_namespace == "0-explain"
    # Within acme's own namespaces the reason is OTHER_NAMESPACE, named as acme names it.
    _cache(acme, prompt, "code")
    assert acme.match(prompt, "chat", explain=True) == MatchExplanation(
        num_cached_tokens=0, reason="OTHER_NAMESPACE", block_index=0, other_namespace="code"
    )


def test_evicted_tail_past_a_cached_prefix(server, debug) -> None:  # type: ignore[no-untyped-def]
    """Eviction trims tails first: the prefix stays, and its first missing block is EVICTED (a chained hash)."""
    ns = f"tail-{next(_namespaces)}"
    prompt = list(range(_BASE + 7000, _BASE + 7016))  # 4 blocks of the 8-block tiny pool
    with RadixKVClient(server.address, pool="tiny") as client:
        flush = client.open(
            list(range(_BASE + 9000, _BASE + 9032)), f"{ns}-flush"
        )  # all 8 blocks: the pool holds nothing else now
        client.release(flush.seq_id, cache=False)
        _cache(client, prompt, ns)
        big = client.open(list(range(_BASE + 8000, _BASE + 8024)), f"{ns}-other")  # 6 blocks: two of the four must go
        client.release(big.seq_id, cache=False)
        why = client.match(prompt, ns, explain=True)
        assert 0 < why.num_cached_tokens < 16
        assert (why.reason, why.block_index) == ("EVICTED", why.num_cached_tokens // 4)
        assert why.evicted_at_unix_ns > 0
    debug.check("tiny")


def test_open_explains_last_token_and_misses(server, debug) -> None:  # type: ignore[no-untyped-def]
    ns = f"open-{next(_namespaces)}"
    prompt = list(range(_BASE + 11000, _BASE + 11008))  # two blocks of 4
    with RadixKVClient(server.address) as client:
        first, why = client.open(prompt, ns, explain=True)
        assert (first.num_cached_tokens, why) == (
            0,
            MatchExplanation(num_cached_tokens=0, reason="NEVER_CACHED", block_index=0),
        )
        client.commit([first.seq_id], [8])
        client.release(first.seq_id)
        # Fully cached: open still leaves the last token (so its block) to compute.
        again, why = client.open(prompt, ns, explain=True)
        assert again.num_cached_tokens == 4
        assert why == MatchExplanation(num_cached_tokens=4, reason="LAST_TOKEN", block_index=1)
        client.release(again.seq_id, cache=False)
        longer, why = client.open([*prompt, 9, 9], ns, explain=True)
        assert (longer.num_cached_tokens, why) == (
            8,
            MatchExplanation(num_cached_tokens=8, reason="PARTIAL_BLOCK", block_index=2),
        )
        client.release(longer.seq_id, cache=False)
        assert isinstance(client.open(prompt, ns), type(first))  # the plain open is unchanged
    debug.check()


def test_open_retry_from_the_window_carries_its_first_explanation(server) -> None:  # type: ignore[no-untyped-def]
    """A retry is answered with its own first result, whole: the explanation is the first call's (the prompt is
    cached by now, so explaining it again would answer something else)."""
    with RadixKVClient(server.address) as client, grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        prompt = pb.Prompt(token_ids=list(range(_BASE + 12000, _BASE + 12006)), namespace=f"retry-{next(_namespaces)}")
        request = pb.OpenSequencesRequest(
            pool="default", session_id=client.session_id, prompts=[prompt], request_id=424242, explain=True
        )
        first = stub.OpenSequences(request, timeout=patient(5)).sequences[0]
        again = stub.OpenSequences(request, timeout=patient(5)).sequences[0]
        assert first.miss_reason == pb.MISS_REASON_NEVER_CACHED
        assert again == first


@pytest.mark.asyncio
async def test_the_async_client_explains_a_match(server) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(_BASE + 13000, _BASE + 13008))
    async with AsyncRadixKVClient(server.address) as client:
        assert await client.match(prompt, f"aio-{next(_namespaces)}") == 0
        why = await client.match(prompt, f"aio-{next(_namespaces)}", explain=True)
        assert why == MatchExplanation(num_cached_tokens=0, reason="NEVER_CACHED", block_index=0)
