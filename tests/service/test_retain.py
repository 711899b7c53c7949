"""Retain over the wire: a soft hint on a cached prefix, from the blocking and the asyncio client."""

from __future__ import annotations

import pytest

from radixkv.client import RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.errors import InvalidArgument, OutOfBlocks
from radixkv.tree.eviction import Retention


def _cache(client: RadixKVClient, tokens: list[int], namespace: str) -> None:
    opened = client.open(tokens, namespace)
    client.commit([opened.seq_id], [len(tokens)])
    client.release(opened.seq_id)


def test_a_ttl_keeps_a_prefix_through_pressure_but_never_refuses_an_admission(server, debug) -> None:
    with RadixKVClient(server.address, pool="tiny") as client:  # 8 blocks of 4 tokens
        kept, other = list(range(100, 109)), list(range(200, 209))
        _cache(client, kept, "ret")
        _cache(client, other, "ret")
        assert client.retain(kept, "ret", Retention(ttl_s=3600)) == 8
        _cache(client, list(range(300, 321)), "ret")  # needs 6 blocks of 4 free: the unhinted prefix goes
        assert client.match(kept, "ret") == 8 and client.match(other, "ret") == 0
        big = client.open(list(range(400, 429)), "ret")  # the whole pool: the TTL gives way, nothing refused
        assert client.match(kept, "ret") == 0
        client.release(big.seq_id, cache=False)
        with pytest.raises(OutOfBlocks):
            client.open(list(range(500, 540)), "ret")
    debug.check("tiny")


def test_retain_refuses_a_bad_hint_naming_the_field(server) -> None:
    with RadixKVClient(server.address) as client:
        request_ttl = Retention(ttl_s=1.0)
        object.__setattr__(request_ttl, "ttl_s", -5.0)  # past the client's own check: the server refuses it too
        with pytest.raises(InvalidArgument) as e:
            client.retain(list(range(8)), "ret", request_ttl)
        assert e.value.field == "retention.ttl_s"
        assert client.retain(list(range(900, 908)), "ret", Retention(priority=5)) == 0  # nothing cached: covers 0


@pytest.mark.asyncio
async def test_the_async_client_retains_too(server) -> None:  # type: ignore[no-untyped-def]
    async with AsyncRadixKVClient(server.address) as client:
        opened = await client.open(list(range(60, 69)), "aio-ret")
        await client.commit([opened.seq_id], [9])
        await client.release(opened.seq_id)
        assert await client.retain(list(range(60, 69)), "aio-ret", Retention(ttl_s=300, end_session=True)) == 8
