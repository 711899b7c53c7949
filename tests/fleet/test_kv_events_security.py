"""The KV-events stream holds every tenant's prompts: who can read it, by configuration, on a real server.

With auth on the publisher starts only when secured (ZMQ CURVE with an allow-list of subscriber keys) or
opted in by name; it never binds every interface unless told; a tenant can keep its blocks out entirely.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import zmq
import zmq.auth

from radixkv.client import RadixKVClient
from radixkv.server.events.kv_events_config import BIND_ALL_FLAG, INSECURE_FLAG
from radixkv.server.process.app import main, parse_args
from radixkv.server.process.spawn import patient
from radixkv.tree.block_hash import cache_salt

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fleet_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    return module


fleet, vllm = _sibling("conftest"), _sibling("vllm_wire")
BLOCK_SIZE, FleetServer = fleet.BLOCK_SIZE, fleet.FleetServer
POOL = f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},num_blocks=64"
ACME = list(range(1000, 1000 + 2 * BLOCK_SIZE + 1))  # acme's prompt: its tokens must not leak where withheld
GLOBEX = list(range(2000, 2000 + 2 * BLOCK_SIZE + 1))


def _tokens(tmp_path: Path, acme_publishes: bool = True, globex_publishes: bool = True) -> str:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[tenants.acme]\ntoken = "acme-token"\npublish_kv_events = {str(acme_publishes).lower()}\n'
        f'[tenants.globex]\ntoken = "globex-token"\npublish_kv_events = {str(globex_publishes).lower()}\n'
    )
    return str(path)


def _write(server: FleetServer, token: str, prompt: list[int]) -> None:
    with RadixKVClient(server.address, token=token) as client:
        seq_id = client.open(prompt, "chat").seq_id
        client.commit([seq_id], [len(prompt)])
        client.release(seq_id)


def _sub(endpoint: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sub.curve_publickey, sub.curve_secretkey = keys
        sub.curve_serverkey = server_key
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _expected_ms() -> int:
    """The bound of a wait for events that must come (it ends when they do), stretched on a loaded machine."""
    return int(patient(60) * 1000)


def _until_subscribed(server: FleetServer, token: str, *subs: zmq.Socket) -> None:
    """A PUB socket sends nothing to a subscriber it has not heard from yet (ZMQ's slow joiner): cache probe prompts
    of `token`'s tenant, a new one each time, until every one of `subs` has received something; then drop that."""
    deadline = time.monotonic() + patient(60)
    for i in itertools.count():
        _write(server, token, [5000 + 100 * i + t for t in range(2 * BLOCK_SIZE + 1)])
        if all(sub.poll(100) for sub in subs):
            break
        assert time.monotonic() < deadline, "a subscription never reached the publisher"
    for sub in subs:
        while sub.poll(300):
            sub.recv_multipart()


def _stored(sub: zmq.Socket, wait_ms: int, first_ms: int | None = None) -> list[object]:
    """Every BlockStored received until none comes for `wait_ms` (the first within `first_ms`, when events are
    expected: a bound that stretches on a loaded machine), decoded with vLLM's structs."""
    stored = []
    wait = first_ms or wait_ms
    while sub.poll(wait):
        wait = wait_ms
        _, _, payload = sub.recv_multipart()
        stored += [e for e in vllm.DECODER.decode(payload).events if isinstance(e, vllm.BlockStored)]
    return stored


# type: ignore[no-untyped-def]
def test_with_auth_the_publisher_refuses_to_start_unless_secured_or_opted_in(tmp_path, capsys) -> None:
    args = ["serve", "--pool", POOL, "--auth-tokens", _tokens(tmp_path), "--kv-events-endpoint", "tcp://127.0.0.1:0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert INSECURE_FLAG in err and "--kv-events-curve-secret-key" in err and "publish_kv_events = false" in err
    config, _ = parse_args([*args, INSECURE_FLAG])  # the opt-in, by its name
    assert config.pools[0].kv_events is not None and config.pools[0].kv_events.insecure_publish_tenant_prompts
    # Every tenant withheld: nothing tenant-owned would be published, so nothing to opt in to.
    parse_args(["serve", "--pool", POOL, "--auth-tokens", _tokens(tmp_path, False, False), *args[-2:]])


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "[::]"])
# type: ignore[no-untyped-def]
def test_a_wildcard_endpoint_is_refused_unless_asked_for_by_name(host: str, capsys) -> None:
    for key in ("--kv-events-endpoint", "--kv-events-replay-endpoint", "--kv-events-digest-endpoint"):
        extra = [] if key == "--kv-events-endpoint" else ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
        assert main(["serve", "--pool", POOL, *extra, key, f"tcp://{host}:5557"]) == 2
        assert BIND_ALL_FLAG in capsys.readouterr().err
    config, _ = parse_args(["serve", "--pool", POOL, "--kv-events-endpoint", f"tcp://{host}:5557", BIND_ALL_FLAG])
    assert config.pools[0].kv_events is not None and config.pools[0].kv_events.bind_all_interfaces
    # Connecting out to a subscriber is no bind: only a bound endpoint is checked.
    parse_args(["serve", "--pool", POOL, "--kv-events-endpoint", "tcp://picker:5557", "--kv-events-connect"])


# type: ignore[no-untyped-def]
def test_opted_in_any_subscriber_reads_every_tenants_prompts_as_the_flag_says(start_fleet_server, tmp_path) -> None:
    server: FleetServer = start_fleet_server(extra=("--auth-tokens", _tokens(tmp_path), INSECURE_FLAG))
    sub = _sub(server.events_endpoint)
    try:
        _until_subscribed(server, "acme-token", sub)
        _write(server, "acme-token", ACME)
        stored = _stored(sub, 2000, _expected_ms())
    finally:
        sub.close()
    assert any(e.token_ids == ACME[: 2 * BLOCK_SIZE] for e in stored), "an unauthenticated peer read acme's prompt"
    assert stored[0].extra_keys[0] == (cache_salt("acme/chat"),)


# type: ignore[no-untyped-def]
def test_secured_with_curve_only_allowed_subscribers_receive_anything(start_fleet_server, tmp_path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    reader_public, reader_secret = zmq.auth.create_certificates(keys, "reader")
    _, stranger_secret = zmq.auth.create_certificates(keys, "stranger")
    Path(reader_public).rename(allowed / "reader.key")  # the allow-list: a directory of public certificates
    server: FleetServer = start_fleet_server(
        extra=("--auth-tokens", _tokens(tmp_path), "--kv-events-curve-secret-key", server_secret,
               "--kv-events-curve-allowed-keys", str(allowed))
    )  # fmt: skip
    server_key = zmq.auth.load_certificate(server_public)[0]
    reader = _sub(server.events_endpoint, zmq.auth.load_certificate(reader_secret), server_key)
    stranger = _sub(server.events_endpoint, zmq.auth.load_certificate(stranger_secret), server_key)
    plain = _sub(server.events_endpoint)
    plain_digest = _sub(server.digest_endpoint)
    reader_digest = _sub(server.digest_endpoint, zmq.auth.load_certificate(reader_secret), server_key)
    try:
        _until_subscribed(server, "globex-token", reader, reader_digest)  # the others' handshakes began with theirs
        _write(server, "acme-token", ACME)
        _write(server, "globex-token", GLOBEX)
        read = _stored(reader, 2000, _expected_ms())
        assert reader_digest.poll(_expected_ms()), "the allowed subscriber reads the digest socket too"
        assert _stored(stranger, 500) == [] and _stored(plain, 500) == [], "a key not allowed, or none: nothing"
        assert not plain_digest.poll(500)
        replayer = zmq.Context.instance().socket(zmq.DEALER)  # a plain peer asking for the replay gets nothing
        replayer.setsockopt(zmq.LINGER, 0)
        replayer.connect(server.replay_endpoint)
        replayer.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
        assert not replayer.poll(500)
        replayer.close()
    finally:
        for sub in (reader, stranger, plain, plain_digest, reader_digest):
            sub.close()
    assert {tuple(e.token_ids) for e in read} >= {tuple(ACME[: 2 * BLOCK_SIZE]), tuple(GLOBEX[: 2 * BLOCK_SIZE])}


# type: ignore[no-untyped-def]
def test_a_tenant_withheld_from_the_stream_has_no_event_in_it(start_fleet_server, tmp_path) -> None:
    server: FleetServer = start_fleet_server(
        extra=("--auth-tokens", _tokens(tmp_path, acme_publishes=False), INSECURE_FLAG)
    )
    sub = _sub(server.events_endpoint)
    try:
        _until_subscribed(server, "globex-token", sub)  # acme's blocks are withheld: globex's probes
        _write(server, "acme-token", ACME)
        _write(server, "globex-token", GLOBEX)
        live = _stored(sub, 2000, _expected_ms())
    finally:
        sub.close()
    replayed = fleet_replay(server.replay_endpoint)
    for stored in (live, replayed):
        tokens = {t for e in stored for t in e.token_ids}
        assert tokens & set(GLOBEX) and not tokens & set(ACME), "globex's blocks are there, acme's never"
        salts = {e.extra_keys[0][0] for e in stored if e.extra_keys}
        assert salts == {cache_salt("globex/chat")}


def fleet_replay(endpoint: str) -> list[object]:
    """Every BlockStored the replay socket holds from seq 0."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, _expected_ms())
    dealer.connect(endpoint)
    stored = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := dealer.recv_multipart())[3]:
            stored += [e for e in vllm.DECODER.decode(frames[3]).events if isinstance(e, vllm.BlockStored)]
    finally:
        dealer.close()
    return stored
