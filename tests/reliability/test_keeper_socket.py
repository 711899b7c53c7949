"""The keeper's socket, in process: every bad frame gets an error reply and the keeper answers on; attach is
idempotent, held pools are refused to a second server, a layout mismatch names its fields; a new keeper cleans
up after a dead one."""

from __future__ import annotations

import json
import os
import pickle
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.extras import install_hint
from radixkv.memory.layout import PoolLayout
from radixkv.memory.shm_segment import SHM_DIR
from radixkv.memory.storage import KVStorage
from radixkv.server.keeper.keeper_client import KeeperClient
from radixkv.server.keeper.keeper_protocol import MAX_FRAME_BYTES, KeeperError, recv_frame, socket_path
from radixkv.server.keeper.keeper_registry import STATE_FILE, Keeper
from radixkv.server.process import keeper as keeper_module
from radixkv.server.process.keeper import KeeperServer
from radixkv.server.process.spawn import patient
from tests.examples import examples

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16, dtype="float32")
GOOD_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "num_blocks": 16, "dtype": "float32"}


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[KeeperServer]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    server = KeeperServer(Keeper(state), socket_path(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(patient(120))
    server.close()
    server.keeper.close()


def _connect(server: KeeperServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.path))
    sock.settimeout(patient(60))
    return sock


def _send_raw(sock: socket.socket, body: bytes, length: int | None = None) -> dict[str, Any] | None:
    sock.sendall(struct.pack(">I", len(body) if length is None else length) + body)
    reply = recv_frame(sock, 5)
    return None if reply is None else json.loads(reply)


def _hello_works(sock: socket.socket) -> bool:
    reply = _send_raw(sock, b'{"op":"hello"}')
    return reply is not None and reply["ok"] is True


def _attach(layout: dict[str, Any], pool: object = "default", device: object = "cpu", tier: object = "device") -> bytes:
    request = {"op": "create_or_attach", "pool": pool, "layout": layout, "device": device, "tier": tier}
    return json.dumps(request).encode()


BAD_FRAMES = {
    "not json": (b"not json", "BAD_FRAME"),
    "not utf-8": (b"\xff\xfe{}", "BAD_FRAME"),
    "a list": (b"[1, 2]", "BAD_FRAME"),
    "a pickle": (pickle.dumps({"op": "hello"}), "BAD_FRAME"),
    "unknown op": (b'{"op": "format_disk"}', "UNKNOWN_OP"),
    "op not a string": (b'{"op": 7}', "UNKNOWN_OP"),
    "extra key": (b'{"op": "hello", "pool": "x"}', "BAD_REQUEST"),
    "missing key": (b'{"op": "release"}', "BAD_REQUEST"),
    "layout as string": (_attach("big"), "BAD_REQUEST"),  # type: ignore[arg-type]
    "int as string": (_attach({**GOOD_LAYOUT, "num_layers": "2"}), "BAD_REQUEST"),
    "bool as int": (_attach({**GOOD_LAYOUT, "head_dim": True}), "BAD_REQUEST"),
    "negative": (_attach({**GOOD_LAYOUT, "num_blocks": -1}), "BAD_REQUEST"),
    "huge": (_attach({**GOOD_LAYOUT, "num_blocks": 2**62}), "BAD_REQUEST"),
    "float": (_attach({**GOOD_LAYOUT, "num_blocks": 1.5}), "BAD_REQUEST"),
    "unknown dtype": (_attach({**GOOD_LAYOUT, "dtype": "float64"}), "BAD_REQUEST"),
    "block size not a power of two": (_attach({**GOOD_LAYOUT, "block_size": 3}), "BAD_REQUEST"),
    "extra layout key": (_attach({**GOOD_LAYOUT, "stride": 1}), "BAD_REQUEST"),
    "device without index": (_attach(GOOD_LAYOUT, device="cuda"), "BAD_REQUEST"),
    "unknown device": (_attach(GOOD_LAYOUT, device="tpu:0"), "BAD_REQUEST"),
    "empty pool name": (_attach(GOOD_LAYOUT, pool=""), "BAD_REQUEST"),
    "pool name not printable": (_attach(GOOD_LAYOUT, pool="a\nb"), "BAD_REQUEST"),
    "pool name too long": (_attach(GOOD_LAYOUT, pool="p" * 129), "BAD_REQUEST"),
    "unknown tier": (_attach(GOOD_LAYOUT, tier="disk"), "BAD_REQUEST"),
    "a host tier on a GPU": (_attach(GOOD_LAYOUT, device="cuda:0", tier="host"), "BAD_REQUEST"),
    "release unknown pool": (b'{"op": "release", "pool": "nope"}', "UNKNOWN_POOL"),
}


@pytest.mark.parametrize(("body", "reason"), BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_a_bad_frame_gets_an_error_reply_and_the_connection_goes_on(
    keeper: KeeperServer, body: bytes, reason: str
) -> None:
    with _connect(keeper) as sock:
        reply = _send_raw(sock, body)
        assert reply is not None and reply["ok"] is False
        assert reply["reason"] == reason, reply
        assert _hello_works(sock)
    assert keeper.keeper.list_pools()["pools"] == []  # nothing was allocated by a refused request


@pytest.mark.parametrize("length", [0, MAX_FRAME_BYTES + 1, 2**32 - 1])
def test_a_frame_length_out_of_range_is_refused_and_ends_that_connection_only(
    keeper: KeeperServer, length: int
) -> None:
    with _connect(keeper) as sock:
        reply = _send_raw(sock, b"", length)
        assert reply is not None and reply["reason"] == "BAD_FRAME"
        assert sock.recv(1) == b""  # the stream cannot be resynchronised: closed
    with _connect(keeper) as sock:
        assert _hello_works(sock)


def test_a_frame_cut_short_or_stalled_ends_that_connection_only(
    keeper: KeeperServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _connect(keeper) as sock:
        sock.sendall(struct.pack(">I", 100) + b'{"op":')
        sock.shutdown(socket.SHUT_WR)  # the peer goes inside a frame
        reply = recv_frame(sock, 5)
        assert reply is not None and json.loads(reply)["reason"] == "BAD_FRAME"
    monkeypatch.setattr(keeper_module, "FRAME_TIMEOUT_SECONDS", 0.3)
    with _connect(keeper) as sock:
        sock.sendall(struct.pack(">I", 100)[:3])  # a header begun and never finished
        reply = recv_frame(sock, 5)
        assert reply is not None and "within" in json.loads(reply)["message"]
    with _connect(keeper) as sock:
        assert _hello_works(sock)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(
        st.binary(min_size=1, max_size=200),
        _JSON.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"op": st.sampled_from(["hello", "list", "release", "create_or_attach"])},
            optional={
                "pool": _JSON,
                "layout": _JSON,
                "device": _JSON,
            },
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_any_frame_gets_a_reply_and_the_keeper_answers_on(keeper: KeeperServer, body: bytes) -> None:
    with _connect(keeper) as sock:
        reply = _send_raw(sock, body)
        assert reply is not None and isinstance(reply["ok"], bool)
        if not reply["ok"]:
            assert reply["reason"] in {"BAD_FRAME", "UNKNOWN_OP", "BAD_REQUEST", "UNKNOWN_POOL"}, reply
        assert _hello_works(sock)
    assert keeper.keeper.list_pools()["pools"] == []


def test_the_state_dir_and_the_socket_are_private(keeper: KeeperServer) -> None:
    assert stat.S_IMODE(os.stat(keeper.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keeper.keeper.state_dir / "snapshots").st_mode) == 0o700


def test_attach_is_idempotent_a_held_pool_is_refused_and_the_next_server_gets_the_same_bytes(
    keeper: KeeperServer,
) -> None:
    first = KeeperClient(keeper.path)
    created = first.create_or_attach("default", LAYOUT, "cpu")
    assert created.fresh and created.generation == 1 and created.incarnation == first.incarnation
    again = first.create_or_attach("default", LAYOUT, "cpu")  # the same connection asking twice
    assert again.handle == created.handle and again.fresh and again.generation == 1
    storage = KVStorage.open(created.handle)
    written = torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(7))
    storage.data.copy_(written)
    storage.close()

    second = KeeperClient(keeper.path)
    with pytest.raises(KeeperError) as busy:
        second.create_or_attach("default", LAYOUT, "cpu", busy_timeout=0.2)
    assert busy.value.reason == "POOL_BUSY"
    with pytest.raises(KeeperError) as held:
        second.release("default")
    assert held.value.reason == "POOL_BUSY"
    first.close()  # the first server exits: its hold goes with its connection
    retained = second.create_or_attach("default", LAYOUT, "cpu", busy_timeout=patient(60))
    assert not retained.fresh and retained.generation == 2
    assert retained.handle.name == created.handle.name
    reopened = KVStorage.open(retained.handle)
    assert torch.equal(reopened.data, written)
    reopened.close()
    second.close()


def test_a_layout_or_device_mismatch_is_refused_naming_what_differs(keeper: KeeperServer) -> None:
    client = KeeperClient(keeper.path)
    client.create_or_attach("default", LAYOUT, "cpu")
    client.close()
    other = KeeperClient(keeper.path)
    bigger = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=32, dtype="float16")
    with pytest.raises(KeeperError) as mismatch:
        other.create_or_attach("default", bigger, "cpu")
    assert mismatch.value.reason == "LAYOUT_MISMATCH"
    assert "num_blocks 16 (kept) != 32 (asked)" in mismatch.value.message
    assert "dtype float32 (kept) != float16 (asked)" in mismatch.value.message
    with pytest.raises(KeeperError) as device:
        other.create_or_attach("default", LAYOUT, "cuda:0")
    assert device.value.reason == "LAYOUT_MISMATCH" and "device cpu (kept) != cuda:0 (asked)" in device.value.message
    assert [p["generation"] for p in other.list_pools()] == [1]  # refusals attached nothing
    other.close()


def test_release_frees_the_memory_and_the_next_attach_is_fresh(keeper: KeeperServer) -> None:
    client = KeeperClient(keeper.path)
    segment = client.create_or_attach("default", LAYOUT, "cpu").handle.name
    assert os.path.exists(os.path.join(SHM_DIR, segment))
    client.release("default")
    assert not os.path.exists(os.path.join(SHM_DIR, segment))
    assert client.list_pools() == []
    again = client.create_or_attach("default", LAYOUT, "cpu")
    assert again.fresh and again.generation == 1 and again.handle.name != segment
    client.close()


def test_a_new_keeper_removes_what_a_dead_keeper_left_and_nothing_else(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "snapshots").mkdir(parents=True)
    stale = "radixkv-keeper-0123456789ab-1"  # a segment no process tracks, as if its owner died
    with open(os.path.join(SHM_DIR, stale), "wb") as segment:  # a file under /dev/shm is a POSIX segment on Linux
        segment.truncate(4096)
    bystander = shared_memory.SharedMemory(name="not-radixkv-bystander", create=True, size=4096)
    (state / "snapshots" / "default.snapshot").write_bytes(b"old index")
    pools = [{"pool": "default", "segment": stale}, {"pool": "evil", "segment": "not-radixkv-bystander"}]
    (state / STATE_FILE).write_text(json.dumps({"incarnation": "dead", "pid": 1, "pools": pools}))
    try:
        keeper = Keeper(state)
        assert keeper.num_stale_segments == 1
        assert not os.path.exists(os.path.join(SHM_DIR, stale))
        assert os.path.exists(os.path.join(SHM_DIR, bystander.name))  # a state file names only keeper segments
        assert list((state / "snapshots").iterdir()) == []  # no snapshot outlives its memory
        assert json.loads((state / STATE_FILE).read_text())["incarnation"] == keeper.incarnation
        keeper.close()
        assert not (state / STATE_FILE).exists()
    finally:
        bystander.close()
        bystander.unlink()
        if os.path.exists(os.path.join(SHM_DIR, stale)):  # the keeper failed to remove it
            os.unlink(os.path.join(SHM_DIR, stale))


def test_the_keeper_without_torch_names_the_extra_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None; from radixkv.server.process.keeper import main; "
        f"sys.exit(main(['--state-dir', {str(tmp_path / 'state')!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120))
    assert result.returncode == 2, result.stderr
    assert f"needs the torch package: {install_hint('server')}" in result.stderr
    assert "Traceback" not in result.stderr


def test_past_the_limit_the_longest_idle_connection_makes_room_and_a_holder_never_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keeper_module, "MAX_CONNECTIONS", 2)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    server = KeeperServer(Keeper(state), socket_path(state), idle_seconds=600)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        silent, spoke = _connect(server), _connect(server)
        assert _hello_works(spoke)
        with _connect(server) as third:  # the limit is reached: the one that never spoke goes, not this one
            assert _hello_works(third)
            reply = recv_frame(silent, 5)
            assert reply is not None and json.loads(reply)["reason"] == "TOO_MANY"
            assert silent.recv(1) == b""
        silent.close()
        assert _hello_works(spoke)
        spoke.close()

        holders = [KeeperClient(server.path), KeeperClient(server.path)]
        for i, holder in enumerate(holders):
            holder.create_or_attach(f"pool{i}", LAYOUT, "cpu")
        with _connect(server) as refused:  # every connection holds a pool: none is dropped for a newcomer
            reply = recv_frame(refused, 5)
            assert reply is not None and json.loads(reply)["reason"] == "TOO_MANY"
        assert all(len(h.list_pools()) == 2 for h in holders)
        for holder in holders:
            holder.close()
    finally:
        server.stop()
        thread.join(patient(120))
        server.close()
        server.keeper.close()


def test_a_connection_silent_past_the_idle_timeout_is_dropped_and_one_that_spoke_stays(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    server = KeeperServer(Keeper(state), socket_path(state), idle_seconds=0.2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        spoke, silent = _connect(server), _connect(server)
        assert _hello_works(spoke)
        reply = recv_frame(silent, 5)
        assert reply is not None and json.loads(reply)["reason"] == "IDLE"
        assert silent.recv(1) == b""
        assert _hello_works(spoke)  # idle since, but it spoke once: it stays
        spoke.close()
        silent.close()
    finally:
        server.stop()
        thread.join(patient(120))
        server.close()
        server.keeper.close()


def test_a_state_dir_too_long_for_a_unix_socket_is_refused_clearly(tmp_path: Path) -> None:
    state = tmp_path / ("d" * 120)
    state.mkdir()
    keeper = Keeper(state)
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        KeeperServer(keeper, socket_path(state))
    keeper.close()


def test_a_host_tier_is_kept_apart_from_its_pool_and_released_with_it(keeper: KeeperServer) -> None:
    client = KeeperClient(keeper.path)
    host_layout = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=48, dtype="float32")
    device = client.create_or_attach("default", LAYOUT, "cpu")
    host = client.create_or_attach("default", host_layout, "cpu", tier="host")
    assert host.fresh and host.handle.name != device.handle.name and host.handle.num_blocks == 48
    assert sorted((p["pool"], p["tier"]) for p in client.list_pools()) == [("default", "device"), ("default", "host")]
    client.close()
    other = KeeperClient(keeper.path)
    again = other.create_or_attach("default", host_layout, "cpu", busy_timeout=patient(60), tier="host")
    assert not again.fresh and again.handle.name == host.handle.name
    other.release("default")  # both tiers: they are indexed by one tree
    assert other.list_pools() == []
    for segment in (device.handle.name, host.handle.name):
        assert not os.path.exists(os.path.join(SHM_DIR, segment))
    other.close()
