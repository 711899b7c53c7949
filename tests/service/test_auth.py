"""Bearer tokens, tenant isolation and quotas, over TLS.

Tenant acme: namespaces chat and code, an 8-block quota; globex: any namespace, no quota, may map pools.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.client import RadixKVClient
from radixkv.errors import PermissionDenied, QuotaExceeded, Unauthenticated
from radixkv.sequences.results import OpenResult
from radixkv.server.process.spawn import patient
from radixkv.tree.block_hash import WIRE_MASK, chain_hashes, mix64, wire_hash

Connect = Callable[..., RadixKVClient]


@pytest.fixture
def connect(auth_server, tls_files) -> Iterator[Connect]:  # type: ignore[no-untyped-def]
    cert, _ = tls_files
    opened: list[RadixKVClient] = []

    def connect(token: str | None, pool: str = "default") -> RadixKVClient:
        client = RadixKVClient(auth_server.address, pool=pool, token=token, tls_root_cert=str(cert))
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


def test_calls_without_a_valid_token_are_unauthenticated(connect: Connect) -> None:
    with pytest.raises(Unauthenticated):
        connect(None)
    with pytest.raises(Unauthenticated):
        connect("not-a-token")


def test_health_needs_no_token(auth_server, tls_files) -> None:  # type: ignore[no-untyped-def]
    cert, _ = tls_files
    with grpc.secure_channel(auth_server.address, grpc.ssl_channel_credentials(cert.read_bytes())) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="radixkv.v1.KVCache"), timeout=10
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_clients_cannot_talk_to_a_tls_server(auth_server, tokens) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as refused:
        RadixKVClient(auth_server.address, token=tokens["acme"], timeout=patient(5))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_a_tenant_uses_only_its_namespaces(connect: Connect, tokens: dict[str, str]) -> None:
    acme = connect(tokens["acme"])
    assert acme.open([1, 2, 3], "chat").num_cached_tokens == 0
    for namespace in ("other", "default"):
        with pytest.raises(PermissionDenied) as denied:
            acme.open([1, 2, 3], namespace)
        assert denied.value.metadata["namespace"] == namespace
    with pytest.raises(PermissionDenied):
        acme.match([1, 2, 3], "other")
    with pytest.raises(PermissionDenied):
        acme.watch_events(["other"]).__iter__().__next__()


def test_one_tenants_prompt_never_hits_for_another(connect: Connect, tokens: dict[str, str]) -> None:
    acme, globex = connect(tokens["acme"]), connect(tokens["globex"])
    prompt = list(range(900, 916))  # 4 full blocks
    with globex.watch_events() as globex_events, acme.watch_events(["chat"]) as acme_events:
        seq_id = acme.open(prompt, "chat").seq_id
        acme.commit([seq_id], [16])
        acme.release(seq_id)  # cached in acme's "chat"
        assert acme.match(prompt, "chat") == 16
        assert globex.match(prompt, "chat") == 0  # same namespace name, another tenant
        opened = globex.open(prompt, "chat")
        assert opened.num_cached_tokens == 0
        globex.release(opened.seq_id, cache=False)
        marker = list(range(950, 954))
        seq_id = globex.open(marker + [1], "marker").seq_id
        globex.commit([seq_id], [5])
        globex.release(seq_id)
        # acme's stream names its own namespace, unscoped; globex's first event is its own marker:
        # acme's blocks, stored before it, never reached globex.
        stored = next(iter(acme_events))
        assert (stored.namespace, stored.token_ids) == ("chat", prompt)
        first = next(iter(globex_events))
        assert (first.namespace, first.token_ids) == ("marker", marker)
    assert acme.match(prompt, "chat") == 16


def test_block_quota_counts_the_tenants_live_sequences(connect: Connect, tokens: dict[str, str], auth_debug) -> None:  # type: ignore[no-untyped-def]
    acme = connect(tokens["acme"])
    first = acme.open(list(range(20)), "code")  # 5 blocks of acme's 8
    with pytest.raises(QuotaExceeded) as refused:
        acme.open(list(range(100, 116)), "code")  # 4 more
    assert (refused.value.needed, refused.value.available) == (4, 3)
    second = acme.open(list(range(100, 112)), "code")  # 3 more: exactly 8
    with pytest.raises(QuotaExceeded):
        acme.append(second.seq_id, [1])  # crossing into a 9th block
    with pytest.raises(QuotaExceeded):
        acme.fork(first.seq_id, 1)
    acme.release(first.seq_id, cache=False)
    assert acme.append(second.seq_id, [1]).num_tokens == 13  # room again
    # Another tenant is not held back by acme's quota.
    globex = connect(tokens["globex"])
    globex.release(_written(globex, globex.open(list(range(200)), "anything")))
    auth_debug.check()


def test_a_session_belongs_to_its_tenant(connect: Connect, tokens: dict[str, str]) -> None:
    acme = connect(tokens["acme"])
    opened = acme.open([5, 6, 7], "chat")
    globex = connect(tokens["globex"])
    own, globex.session_id = globex.session_id, acme.session_id  # a stolen session id
    try:
        with pytest.raises(PermissionDenied):
            globex.append(opened.seq_id, [8])  # the session check comes first
        with pytest.raises(PermissionDenied):
            globex.keep_alive()
    finally:
        globex.session_id = own
    assert acme.append(opened.seq_id, [8]).num_tokens == 4


def test_only_trusted_tenants_get_a_handle_and_only_of_their_own_pool(connect: Connect, tokens: dict[str, str]) -> None:
    # A handle maps the whole pool, read and write: only a map_pools tenant gets one, of a pool it alone uses.
    with pytest.raises(PermissionDenied):
        connect(tokens["acme"]).get_pool()
    with pytest.raises(PermissionDenied, match="'default' also serves tenants \\['acme'\\]") as shared:
        connect(tokens["globex"]).get_pool()
    assert shared.value.metadata["field"] == "pool"
    assert connect(tokens["globex"], pool="globex").get_pool().handle.WhichOneof("memory") == "shared_memory"
    with pytest.raises(PermissionDenied, match="may not use pool 'globex'"):
        connect(tokens["acme"], pool="globex")


def _written(client: RadixKVClient, opened: OpenResult) -> int:
    """As a worker that wrote every token of `opened` would: commit them (only written blocks are cached)."""
    client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
    return opened.seq_id


def test_verify_gives_each_tenant_the_digests_of_its_own_namespaces_only(
    connect: Connect, tokens: dict[str, str]
) -> None:
    acme, globex = connect(tokens["acme"]), connect(tokens["globex"])
    acme_before, globex_before = acme.verify(), globex.verify()
    prompt = list(range(700, 709))  # two full blocks of 4 (the auth server's block size)
    seq_id = acme.open(prompt, "code").seq_id
    acme.commit([seq_id], [len(prompt)])
    acme.release(seq_id)
    acme_after, globex_after = acme.verify(), globex.verify()
    # acme's "code" moved by exactly its two new blocks, hashed under its scoped name "acme/code".
    added = sum(mix64(wire_hash(h)) for h in chain_hashes(prompt, 4, "acme/code")) & WIRE_MASK
    assert acme_after.digests["code"] == (acme_before.digests.get("code", 0) + added) & WIRE_MASK
    assert acme_after.num_blocks["code"] == acme_before.num_blocks.get("code", 0) + 2
    assert set(acme_after.digests) <= {"chat", "code"}, "acme sees only its own namespaces, by its own names"
    # globex learns nothing of it: no acme namespace, no change in its digests.
    assert (globex_after.digests, globex_after.digest) == (globex_before.digests, globex_before.digest)
    assert not any(ns.startswith("acme") or ns == "code" for ns in globex_after.digests)
    assert acme_after.digest == sum(acme_after.digests.values()) & WIRE_MASK
