"""A hostile tenant: no token, a wrong token, another tenant's session, sequence or namespace; and TLS.

The `secure` server: tenant acme (namespaces chat and code, a block quota) and tenant globex (any
namespace), over TLS with a certificate made for this run. Every refusal is checked by its code
and reason; every probe for another tenant's cached prompt must come back empty.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.client import KVEventKind, RadixKVClient
from radixkv.errors import PermissionDenied, QuotaExceeded, UnknownSequence
from radixkv.sequences.results import OpenResult
from radixkv.server.process.spawn import patient
from radixkv.v1 import debug_pb2, kvcache_pb2_grpc
from radixkv.v1 import kvcache_pb2 as pb

TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-9876543210"}  # conftest.AUTH_TOKENS
METHODS = [
    (f"/radixkv.v1.KVCache/{m.name}", m.server_streaming) for m in pb.DESCRIPTOR.services_by_name["KVCache"].methods
] + [(f"/radixkv.v1.Debug/{m.name}", False) for m in debug_pb2.DESCRIPTOR.services_by_name["Debug"].methods]
Connect = Callable[..., RadixKVClient]


@pytest.fixture
def credentials(certificates: dict[str, tuple[Path, Path]]) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(certificates["server"][0].read_bytes())


@pytest.fixture
def connect(secure, certificates) -> Iterator[Connect]:  # type: ignore[no-untyped-def]
    opened: list[RadixKVClient] = []

    def connect(tenant: str) -> RadixKVClient:
        client = RadixKVClient(
            secure.address, token=TOKENS[tenant], tls_root_cert=str(certificates["server"][0]), timeout=10
        )
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-a-token", f"Basic {TOKENS['acme']}", "Bearer ", f"Bearer {TOKENS['acme']}x", TOKENS["acme"]],
    ids=["none", "wrong", "basic scheme", "empty", "one char more", "no scheme"],
)
def test_every_method_refuses_a_caller_without_a_valid_token(
    secure, credentials, authorization, defined_refusal
) -> None:  # type: ignore[no-untyped-def]
    metadata = [("authorization", authorization)] if authorization else None
    with grpc.secure_channel(secure.address, credentials) as channel:
        for path, streaming in METHODS:
            for body in (b"", b"\xff\xff garbage"):  # authentication comes before the request is even decoded
                call = (channel.unary_stream if streaming else channel.unary_unary)(path)
                with pytest.raises(grpc.RpcError) as refused:
                    response = call(body, metadata=metadata, timeout=patient(10))
                    if streaming:
                        next(response)
                assert (refused.value.code(), defined_refusal(refused.value)) == (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "UNAUTHENTICATED",
                ), path
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=patient(10))
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


def test_another_tenants_session_and_sequences_are_refused_and_left_untouched(
    connect: Connect, secure, credentials, refusal
) -> None:  # type: ignore[no-untyped-def]
    acme, globex = connect("acme"), connect("globex")
    theirs = acme.open([1, 2, 3, 4, 5], "chat").seq_id
    for trespass in (
        lambda: globex.append(theirs, [6]),
        lambda: globex.fork(theirs, 1),
        lambda: globex.cache(theirs),
        lambda: globex.release(theirs),
    ):
        with pytest.raises(UnknownSequence):  # another tenant's sequence is answered as an absent one
            trespass()
    stolen = {"session_id": acme.session_id}
    with grpc.secure_channel(secure.address, credentials) as channel:
        stub, as_globex = kvcache_pb2_grpc.KVCacheStub(channel), [("authorization", f"Bearer {TOKENS['globex']}")]
        for rpc, request in (
            (stub.KeepAlive, pb.KeepAliveRequest(**stolen)),
            (stub.CloseSession, pb.CloseSessionRequest(**stolen)),
            (stub.OpenSequences, pb.OpenSequencesRequest(**stolen, prompts=[pb.Prompt(token_ids=[1])])),
            (stub.Stats, pb.StatsRequest(**stolen)),
        ):
            assert refusal(rpc, request, metadata=as_globex)[:2] == (
                grpc.StatusCode.PERMISSION_DENIED,
                "PERMISSION_DENIED",
            )
    assert acme.append(theirs, [6]).num_tokens == 6  # acme's sequence and session are as they were
    acme.release(theirs, cache=False)


def test_a_tenant_may_use_only_its_own_namespaces(connect: Connect) -> None:
    acme = connect("acme")
    probes: list[Callable[[str], object]] = [
        lambda ns: acme.open([1, 2, 3], ns),
        lambda ns: acme.match([1, 2, 3], ns),
        lambda ns: acme.pin([1, 2, 3, 4], ns),
        lambda ns: next(iter(acme.watch_events([ns]))),
    ]
    for namespace in ("other", "default", "globex/chat", "*"):
        for probe in probes:
            with pytest.raises(PermissionDenied) as denied:
                probe(namespace)
            assert denied.value.metadata["namespace"] == namespace


def test_no_probe_reveals_whether_another_tenants_prompt_is_cached(connect: Connect) -> None:
    acme, globex = connect("acme"), connect("globex")
    prompt = list(range(5000, 5016))  # 4 full blocks
    acme.release(_written(acme, acme.open(prompt + [1], "chat")))
    assert acme.match(prompt, "chat") == 16
    # The same namespace name, acme's scoped name, a name spelled to look like it: globex's own roots, all empty.
    for namespace in ("chat", "acme/chat", "acme", "default", "../acme/chat"):
        assert globex.match(prompt, namespace) == 0, namespace
        opened = globex.open(prompt + [1], namespace)
        assert opened.num_cached_tokens == 0, namespace
        globex.release(opened.seq_id, cache=False)
    assert acme.match(prompt, "chat") == 16


def test_watch_events_never_show_another_tenants_blocks(connect: Connect) -> None:
    acme, globex = connect("acme"), connect("globex")
    acme_prompt, marker = list(range(6000, 6016)), list(range(6100, 6104))
    acme_blocks = set(acme.open(acme_prompt + [1], "code").block_table)  # live during the snapshot below
    with (
        globex.watch_events(include_snapshot=True) as everything,
        globex.watch_events(["code"], include_snapshot=True) as same_name,
    ):
        acme.release(_written(acme, acme.open(list(range(6200, 6216)) + [1], "code")))  # stored while globex watches
        globex.release(_written(globex, globex.open(marker + [1], "marker")))
        globex.release(_written(globex, globex.open(marker + [2], "code")))
        seen_everything = _until_stored(iter(everything), marker)
        seen_code = _until_stored(iter(same_name), marker)
    for events in (seen_everything, seen_code):
        assert all(not set(e.block_ids) & acme_blocks for e in events)
        assert all(e.token_ids[:4] != list(range(6200, 6204)) for e in events if e.kind == KVEventKind.BLOCKS_STORED)
    assert {e.namespace for e in seen_code if not e.snapshot} == {"code"}  # globex's own "code", stored after acme's


def _until_stored(events: Iterator, marker: list[int]) -> list:  # type: ignore[type-arg]
    """Events up to globex's own marker block (stored after acme's blocks, so acme's would have come first)."""
    seen = []
    for event in events:
        seen.append(event)
        if event.kind == KVEventKind.BLOCKS_STORED and event.token_ids[:4] == marker and not event.snapshot:
            return seen
    raise AssertionError("the stream ended before globex's marker")


def test_the_block_quota_names_itself(connect: Connect) -> None:
    acme = connect("acme")
    with pytest.raises(QuotaExceeded) as refused:
        acme.open(list(range(17 * 4)), "chat")  # 17 blocks > acme's 16
    assert (refused.value.metadata["limit"], refused.value.needed, refused.value.available) == ("max_blocks", 17, 16)


def test_tls_round_trip_and_clean_failures_without_it(secure, hardened, certificates, connect: Connect) -> None:  # type: ignore[no-untyped-def]
    client = connect("globex")
    client.release(_written(client, client.open([1, 2, 3], "tls")))  # a round trip over TLS
    with RadixKVClient(
        f"localhost:{secure.port}", token=TOKENS["globex"], tls_root_cert=str(certificates["server"][0]), timeout=10
    ) as by_name:
        assert by_name.stats().num_blocks_total == 64  # the certificate names localhost too
    attempts = {
        "plaintext to TLS": lambda: RadixKVClient(secure.address, token=TOKENS["globex"], timeout=patient(5)),
        "untrusted certificate": lambda: RadixKVClient(
            secure.address, token=TOKENS["globex"], tls_root_cert=str(certificates["stranger"][0]), timeout=5
        ),
        "TLS to plaintext": lambda: RadixKVClient(
            hardened.address, tls_root_cert=str(certificates["server"][0]), timeout=5
        ),
    }  # fmt: skip
    for name, attempt in attempts.items():
        with pytest.raises(grpc.RpcError) as failed:
            attempt()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, name  # refused at the handshake, not hung
    for junk in (b"\x16\x03\x01\xff\xff" + b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256))):
        with socket.create_connection(("127.0.0.1", secure.port), timeout=patient(5)) as raw:
            raw.sendall(junk)
    assert client.stats().num_blocks_total == 64  # still serving


def _written(client: RadixKVClient, opened: OpenResult) -> int:
    """As a worker that wrote every token of `opened` would: commit them (only written blocks are cached)."""
    client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
    return opened.seq_id
