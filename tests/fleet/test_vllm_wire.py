"""radixkv's block hashes are vLLM's, salted and unsalted, and llm-d v0.10 keys a request as the blocks it indexed.

Each hash is recomputed with vLLM 0.33/0.34's hasher as reproduced in `vllm_wire.py` (a prompt's block chain for
a request whose `cache_salt` is the namespace's salt); llm-d's keys with its token processor as reproduced in
`router_decoders.py`. Where vLLM itself is installed, the reproduced structs are checked against it.

Two server processes serve the module, one without auth and one with a tenant; each test caches prompts of its
own (distinct first tokens, so no chain is another test's) and reads back only their events.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
import zmq

from radixkv.client import RadixKVClient
from radixkv.server.events.kv_events_config import INSECURE_FLAG
from radixkv.server.process.spawn import patient
from radixkv.tree.block_hash import cache_salt


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fleet_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    return module


fleet, vllm, routers = _sibling("conftest"), _sibling("vllm_wire"), _sibling("router_decoders")
BLOCK_SIZE, FleetServer, wait_until = fleet.BLOCK_SIZE, fleet.FleetServer, fleet.wait_until


def _prompts(first: int) -> list[list[int]]:
    """Four prompts of 3 full blocks and a token; `first` sets them apart from another test's."""
    return [[p * 100 + t for t in range(3 * BLOCK_SIZE + 1)] for p in range(first, first + 4)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, FleetServer]]:
    """{with auth: its server}: without auth, and with tenant acme (token "acme-token", any namespace)."""
    d = tmp_path_factory.mktemp("vllm_wire")
    (d / "tokens.toml").write_text('[tenants.acme]\ntoken = "acme-token"\n')
    started = {False: FleetServer(d, "open")}
    started[True] = FleetServer(d, "auth", extra=("--auth-tokens", str(d / "tokens.toml"), INSECURE_FLAG))
    yield started
    for server in started.values():
        server.stop()


def _stored_events(server: FleetServer) -> list[object]:
    """Every BlockStored of the stream so far, from its replay socket, decoded with vLLM's structs."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(patient(60) * 1000))
    dealer.connect(server.replay_endpoint)
    stored = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := dealer.recv_multipart())[3]:
            stored += [e for e in vllm.DECODER.decode(frames[3]).events if isinstance(e, vllm.BlockStored)]
    finally:
        dealer.close()
    return stored


def _cache(server: FleetServer, prompts: list[list[int]], namespace: str, token: str | None = None) -> None:
    with RadixKVClient(server.address, token=token) as client:
        for prompt in prompts:
            seq_id = client.open(prompt, namespace).seq_id
            client.commit([seq_id], [len(prompt)])
            client.release(seq_id)


def _chains(stored: list[object], prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each of `prompts`' full blocks (its tokens) -> the hashes announced for them (each prompt is one root event)."""
    mine = {tuple(p[: 3 * BLOCK_SIZE]) for p in prompts}
    return {
        tuple(e.token_ids): list(e.block_hashes)  # type: ignore[attr-defined]
        for e in stored
        if e.parent_block_hash is None and tuple(e.token_ids) in mine  # type: ignore[attr-defined]
    }


@pytest.mark.parametrize(
    ("auth", "namespace", "salt", "first"),
    [
        (False, "", None, 1),
        (False, "chat", "chat", 5),
        (True, "chat", "acme%2Fchat", 9),
        (True, "", "acme%2Fdefault", 13),
    ],
    ids=["unsalted", "salted", "tenant-scoped", "tenant-default"],
)
# type: ignore[no-untyped-def]
def test_every_hash_is_the_one_vllm_computes_for_the_same_request(servers, auth, namespace, salt, first):
    server: FleetServer = servers[auth]
    prompts = _prompts(first)
    _cache(server, prompts, namespace, "acme-token" if auth else None)
    assert wait_until(lambda: len(_chains(_stored_events(server), prompts)) == len(prompts))
    chains = _chains(_stored_events(server), prompts)
    for prompt in prompts:
        full = tuple(prompt[: 3 * BLOCK_SIZE])
        ours = chains[full]
        theirs = [vllm.external(h) for h in vllm.request_block_hashes(prompt, BLOCK_SIZE, cache_salt=salt)]
        assert ours == theirs, f"{len(prompts)} prompts, salt {salt!r}: vLLM's hashes"
    assert cache_salt(("acme/" if auth else "") + (namespace or "default")) == salt


def test_llm_d_keys_a_salted_request_as_the_blocks_it_indexed(servers) -> None:  # type: ignore[no-untyped-def]
    """llm-d recomputes its keys from `token_ids` and the salt in `extra_keys` when it ingests an event, and from
    the tokens and `cache_salt` of a request when it scores one: equal keys for cache_salt = cache_salt(namespace)."""
    server: FleetServer = servers[True]
    prompts = _prompts(17)
    _cache(server, prompts, "chat", "acme-token")
    assert wait_until(lambda: len(_chains(_stored_events(server), prompts)) == len(prompts))
    model = server.topic.split("@")[2]  # llm-d's parseTopic: kv@<pod>@<model>
    mine = {tuple(p[: 3 * BLOCK_SIZE]) for p in prompts}
    for event in _stored_events(server):
        if event.parent_block_hash is not None or tuple(event.token_ids) not in mine:  # type: ignore[attr-defined]
            continue
        tokens = event.token_ids  # type: ignore[attr-defined]
        indexed = routers.llm_d_keys(
            tokens,
            model,
            BLOCK_SIZE,
            # type: ignore[attr-defined]
            routers.parse_raw_extra_keys([list(k) if k else None for k in event.extra_keys]),
        )
        num_blocks = len(tokens) // BLOCK_SIZE
        request = routers.llm_d_keys(
            tokens, model, BLOCK_SIZE, routers.fold_cache_salt(None, "acme%2Fchat", num_blocks)
        )
        assert indexed == request, "a request with cache_salt acme%2Fchat hits every block"
        other = routers.llm_d_keys(
            tokens, model, BLOCK_SIZE, routers.fold_cache_salt(None, "globex%2Fchat", num_blocks)
        )
        unsalted = routers.llm_d_keys(tokens, model, BLOCK_SIZE)
        assert not set(indexed) & (set(other) | set(unsalted)), "another salt, or none, hits nothing"


def test_the_reproduced_structs_are_vllms() -> None:
    """Field by field: names, order, types, defaults and struct options, against vLLM's module where installed."""
    upstream = pytest.importorskip("vllm.distributed.kv_events")
    for name in ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"):
        ours, theirs = getattr(vllm, name), getattr(upstream, name)
        assert [(f.name, f.type, f.default) for f in msgspec.structs.fields(ours)] == [
            (f.name, f.type, f.default) for f in msgspec.structs.fields(theirs)
        ], name
        for option in ("array_like", "omit_defaults", "tag", "tag_field", "forbid_unknown_fields"):
            assert getattr(ours.__struct_config__, option) == getattr(theirs.__struct_config__, option), (name, option)
