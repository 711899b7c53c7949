"""The keeper with real processes: a server restart keeps the pool's memory and its bytes; a keeper SIGKILL
means a clean cold start; a layout mismatch stops the server with a clear error; `serve --state-dir` starts a
keeper that outlives the server.

(Adopting the radix tree from a snapshot is the snapshot's business: here a restarted server starts with an
empty index over the same bytes.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.memory.layout import PoolLayout
from radixkv.memory.shm_segment import SHM_DIR
from radixkv.server.keeper.keeper_client import KeeperClient
from radixkv.server.process.spawn import KeeperProcess, ServerProcess, patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

POOL = "default:num_layers=2,num_kv_heads=2,head_dim=8,block_size=4,num_blocks=64,dtype=float32"
FLAGS = ["--pool", POOL, "--debug-rpc"]
BYTES_PER_BLOCK = PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64, dtype="float32"
).bytes_per_block


def _zeros_checksum(num_blocks: int) -> str:
    """What Debug.ChecksumBlocks says of `num_blocks` blocks nobody wrote."""
    return hashlib.sha256(bytes(num_blocks * BYTES_PER_BLOCK)).hexdigest()


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state directory; whatever keeper still runs on it at the end is stopped."""
    path = tmp_path / "state"
    yield path
    try:
        pid = KeeperClient(path / "keeper.sock").info["pid"]
    except OSError:
        return
    os.kill(pid, signal.SIGTERM)


def _write_and_checksum(server: ServerProcess, seed: int) -> tuple[list[int], str, str]:
    """Open a sequence, write seeded K/V into its blocks as a worker would; returns (block_table, the server's
    checksum of those blocks, the shared-memory segment)."""
    with RadixKVClient(server.address) as client:
        opened = client.open(list(range(100, 112)), "keeper")
        table = opened.block_table.tolist()
        info = client.get_pool()
        with PoolView(info) as view:
            generator = torch.Generator().manual_seed(seed)
            view.data[:, :, table] = torch.randn(view.data[:, :, table].shape, generator=generator)
        checksum = _checksum(server, table)
        client.release(opened.seq_id, cache=False)
    return table, checksum, info.handle.shared_memory.name


def _checksum(server: ServerProcess, block_ids: list[int]) -> str:
    """SHA-256 of the blocks as the server's own mapping holds them (Debug.ChecksumBlocks)."""
    with grpc.insecure_channel(server.address) as channel:
        request = debug_pb2.ChecksumBlocksRequest(pool="default", block_ids=block_ids)
        return str(debug_pb2_grpc.DebugStub(channel).ChecksumBlocks(request, timeout=patient(10)).sha256)


def test_a_restarted_server_attaches_the_same_memory_and_the_kv_bytes_are_identical(tmp_path: Path) -> None:
    with KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log") as keeper:
        first = ServerProcess(FLAGS, tmp_path / "first.log", keeper=keeper.socket)
        assert first.announcement["keeper"]["pools"] == {"default": "fresh"}
        table, checksum, segment = _write_and_checksum(first, seed=3)
        assert _checksum(first, [61, 62, 63]) == _zeros_checksum(3)  # the checksum of fresh memory, as computed here
        assert checksum != _zeros_checksum(len(table))
        assert first.stop() == 0  # SIGTERM: the server stops, the memory stays with the keeper

        second = ServerProcess(FLAGS, tmp_path / "second.log", keeper=keeper.socket)
        assert second.announcement["keeper"] == {
            "socket": str(keeper.socket),
            "incarnation": keeper.incarnation,
            "pools": {"default": "retained"},
        }
        assert _checksum(second, table) == checksum
        with RadixKVClient(second.address) as client:
            assert client.get_pool().handle.shared_memory.name == segment
        second.kill()  # a crash of the server loses nothing the keeper holds either

        third = ServerProcess(FLAGS, tmp_path / "third.log", keeper=keeper.socket)
        assert third.announcement["keeper"]["pools"] == {"default": "retained"}
        assert _checksum(third, table) == checksum
        assert third.stop() == 0
        assert keeper.stop() == 0
    assert not os.path.exists(os.path.join(SHM_DIR, segment))  # a keeper's SIGTERM frees the memory


def _restart_safe(server: ServerProcess) -> float:
    """The server's `radixkv_pool_restart_safe` gauge for the default pool."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as response:
        text = response.read().decode()
    match = re.search(r'^radixkv_pool_restart_safe\{pool="default"\} (\S+)$', text, re.MULTILINE)
    assert match is not None, "the gauge is exported"
    return float(match.group(1))


def test_a_keeper_killed_under_a_running_server_leaves_it_serving_but_not_restart_safe(
    tmp_path: Path, wait_until: Callable[..., bool]
) -> None:
    state = tmp_path / "state"
    keeper = KeeperProcess(state, log_path=tmp_path / "keeper.log")
    server = ServerProcess([*FLAGS, "--metrics-port", "0"], tmp_path / "server.log", keeper=keeper.socket)
    table, checksum, _ = _write_and_checksum(server, seed=5)
    assert _restart_safe(server) == 1

    keeper.kill()
    log = tmp_path / "server.log"
    assert wait_until(lambda: "keeper lost" in log.read_text(), timeout=60)
    assert _restart_safe(server) == 0
    # The server serves on from its own mapping (CPU memory stays mapped until it exits)...
    assert _checksum(server, table) == checksum
    with RadixKVClient(server.address) as client:
        opened = client.open(list(range(200, 210)), "after-the-keeper")
        assert len(opened.block_table) == 3
        client.commit([opened.seq_id], [10])
        client.release(opened.seq_id)
    # ...but its graceful stop writes no snapshot: the memory it would describe dies with this server.
    assert server.stop() == 0
    assert list((state / "snapshots").glob("*.snapshot")) == []


def test_sigkill_of_the_keeper_then_a_clean_cold_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    prompt = list(range(300, 313))  # 3 full blocks of 4 and one token more
    keeper = KeeperProcess(state, log_path=tmp_path / "keeper.log")
    server = ServerProcess(FLAGS, tmp_path / "server.log", keeper=keeper.socket)
    table, _, segment = _write_and_checksum(server, seed=7)
    with RadixKVClient(server.address) as client:
        opened = client.open(prompt, "cold")
        client.commit([opened.seq_id], [len(prompt)])
        client.release(opened.seq_id)
        assert client.match(prompt, "cold") == 12
    assert server.stop() == 0
    assert (state / "snapshots" / "default.snapshot").exists()  # adoptable, had the keeper lived

    keeper.kill()
    # The next keeper starts cold: the dead keeper's segment and every snapshot are gone, the memory is fresh...
    with KeeperProcess(state, log_path=tmp_path / "keeper2.log") as second_keeper:
        assert second_keeper.incarnation != keeper.incarnation
        assert not os.path.exists(os.path.join(SHM_DIR, segment))
        assert list((state / "snapshots").iterdir()) == []
        restarted = ServerProcess(FLAGS, tmp_path / "restarted.log", keeper=second_keeper.socket)
        assert restarted.announcement["keeper"]["pools"] == {"default": "fresh"}
        # ...so nothing is adopted: no prefix hits, and what was written died with the keeper.
        with RadixKVClient(restarted.address) as client:
            assert client.match(prompt, "cold") == 0
        assert _checksum(restarted, table) == _zeros_checksum(len(table))
        assert restarted.stop() == 0


def test_a_layout_mismatch_stops_the_server_with_a_clear_error(tmp_path: Path) -> None:
    with KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log") as keeper:
        ServerProcess(FLAGS, tmp_path / "first.log", keeper=keeper.socket).stop()
        bigger = ["--pool", POOL.replace("num_blocks=64", "num_blocks=128"), "--debug-rpc"]
        with pytest.raises(RuntimeError, match=r"exited \(1\) before serving") as refused:
            ServerProcess(bigger, tmp_path / "second.log", keeper=keeper.socket)
        assert "LAYOUT_MISMATCH" in str(refused.value)
        assert "num_blocks 64 (kept) != 128 (asked)" in str(refused.value)
        again = ServerProcess(FLAGS, tmp_path / "third.log", keeper=keeper.socket)  # the kept pool is intact
        assert again.announcement["keeper"]["pools"] == {"default": "retained"}
        assert again.stop() == 0

        # To change the layout, the operator releases the kept pool (its cache is lost).
        listed = _keeper_cli(tmp_path / "state", "--list")
        assert listed.returncode == 0 and [p["layout"]["num_blocks"] for p in json.loads(listed.stdout)["pools"]] == [
            64
        ]
        assert _keeper_cli(tmp_path / "state", "--release", "default").returncode == 0
        assert json.loads(_keeper_cli(tmp_path / "state", "--list").stdout)["pools"] == []
        resized = ServerProcess(bigger, tmp_path / "fourth.log", keeper=keeper.socket)
        assert resized.announcement["keeper"]["pools"] == {"default": "fresh"}
        assert resized.stop() == 0


def _keeper_cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "radixkv.cli", "keeper", "--state-dir", str(state), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=patient(120))


def test_serve_without_a_keeper_listening_refuses(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited \(1\) before serving.*no keeper answers"):
        ServerProcess(FLAGS, tmp_path / "server.log", keeper=tmp_path / "nothing.sock")


def test_serve_with_a_state_dir_starts_a_detached_keeper_that_outlives_the_server(
    tmp_path: Path, state_dir: Path
) -> None:
    first = ServerProcess(FLAGS, tmp_path / "first.log", state_dir=state_dir)
    assert first.announcement["keeper"]["pools"] == {"default": "fresh"}
    table, checksum, _ = _write_and_checksum(first, seed=9)
    assert first.stop() == 0
    info = KeeperClient(state_dir / "keeper.sock").info  # the keeper lives on without its starter
    assert os.getsid(info["pid"]) == info["pid"]  # in a session of its own
    second = ServerProcess(FLAGS, tmp_path / "second.log", state_dir=state_dir)
    assert second.announcement["keeper"]["incarnation"] == info["incarnation"]
    assert second.announcement["keeper"]["pools"] == {"default": "retained"}
    assert _checksum(second, table) == checksum
    assert second.stop() == 0


def test_a_second_keeper_on_the_same_state_dir_refuses_and_check_probes_the_first(tmp_path: Path) -> None:
    with KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log") as keeper:
        second = subprocess.run(
            [sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=patient(120),
        )  # fmt: skip
        assert second.returncode == 1
        assert "another keeper is running" in second.stderr
        assert KeeperClient(keeper.socket).info["incarnation"] == keeper.incarnation
        probe = _keeper_cli(tmp_path / "state", "--check")
        assert probe.returncode == 0 and json.loads(probe.stdout)["incarnation"] == keeper.incarnation
        unknown = _keeper_cli(tmp_path / "state", "--release", "nothing")
        assert unknown.returncode == 1 and json.loads(unknown.stdout)["reason"] == "UNKNOWN_POOL"
    probe = _keeper_cli(tmp_path / "state", "--check")
    assert probe.returncode == 1 and "no keeper answers" in probe.stderr


@pytest.mark.gpu
def test_a_cuda_pool_kept_by_the_keeper_survives_a_server_restart(tmp_path: Path) -> None:
    """CUDA IPC: the keeper allocates and exports; servers and workers open its handle."""
    cuda_flags = ["--pool", POOL + ",device=cuda:0", "--debug-rpc"]
    with KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log") as keeper:
        first = ServerProcess(cuda_flags, tmp_path / "first.log", keeper=keeper.socket)
        with RadixKVClient(first.address) as client:
            opened = client.open(list(range(100, 112)), "keeper")
            table = opened.block_table.tolist()
            info = client.get_pool()
            assert info.handle.WhichOneof("memory") == "cuda_ipc"
            with PoolView(info) as view:  # this process opens the keeper's allocation
                generator = torch.Generator().manual_seed(11)
                values = torch.randn(view.data[:, :, table].shape, generator=generator)
                view.data[:, :, table] = values.to(view.data.device)
                torch.cuda.synchronize()
        checksum = _checksum(first, table)
        assert checksum != _zeros_checksum(len(table))
        assert first.stop() == 0
        time.sleep(0.5)
        second = ServerProcess(cuda_flags, tmp_path / "second.log", keeper=keeper.socket)
        assert second.announcement["keeper"]["pools"] == {"default": "retained"}
        assert _checksum(second, table) == checksum
        assert second.stop() == 0
        kept = json.loads((tmp_path / "state" / "keeper.json").read_text())["pools"]
        assert [(p["pool"], p["generation"]) for p in kept] == [("default", 2)]


def test_the_keeper_keeps_the_host_tier_too(tmp_path: Path) -> None:
    """A pool's host tier (issue 11) is the keeper's own allocation beside the device memory: the same bytes after
    a server restart, listed as its own tier, freed with the pool."""
    state = tmp_path / "state"
    flags = ["--pool", POOL + ",host_num_blocks=32", "--debug-rpc"]
    with KeeperProcess(state, log_path=tmp_path / "keeper.log") as keeper:
        first = ServerProcess(flags, tmp_path / "first.log", keeper=keeper.socket)
        with RadixKVClient(first.address) as client:
            info = client.get_pool()
            assert info.host is not None
            host_segment = info.host.handle.shared_memory.name
            with PoolView(info) as view:
                view.host_data.copy_(torch.randn(view.host_data.shape, generator=torch.Generator().manual_seed(13)))
                written = hashlib.sha256(view.host_data.view(torch.uint8).numpy().tobytes()).hexdigest()
        assert first.stop() == 0
        kept = json.loads(_keeper_cli(state, "--list").stdout)["pools"]
        assert sorted((p["tier"], p["layout"]["num_blocks"]) for p in kept) == [("device", 64), ("host", 32)]

        second = ServerProcess(flags, tmp_path / "second.log", keeper=keeper.socket)
        with RadixKVClient(second.address) as client:
            info = client.get_pool()
            assert info.host is not None and info.host.handle.shared_memory.name == host_segment
            with PoolView(info) as view:
                assert hashlib.sha256(view.host_data.view(torch.uint8).numpy().tobytes()).hexdigest() == written
        assert second.stop() == 0
        assert _keeper_cli(state, "--release", "default").returncode == 0
        assert not os.path.exists(os.path.join(SHM_DIR, host_segment))
