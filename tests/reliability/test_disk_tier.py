"""The disk tier with real processes: committed blocks reach the directory in the background; after SIGKILL of the
server and its keeper (host memory gone), a fresh server on the same --disk-dir rebuilds its index, Match reports
the disk tokens, and an open loads them through the host tier bit for bit. A damaged object is refused, counted,
removed and recomputed; a disk slower than the stated prefill rate is not read; a bad directory is an error at
start."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

from radixkv.client import PoolView, RadixKVClient
from radixkv.disk.object_format import OBJECT_SUFFIX
from radixkv.kernels import swap_blocks
from radixkv.server.process.spawn import KeeperProcess, ServerProcess, patient
from radixkv.tree.block_hash import chain_hashes, wire_hash

BS, H, D = 4, 2, 8
POOL = f"disk:num_layers=2,num_kv_heads={H},head_dim={D},block_size={BS},num_blocks=16,dtype=float32,host_num_blocks=16"
PROMPT = list(range(1, 15))  # 3 full blocks and 2 tokens
WAIT_S = 300.0  # generous: a loaded CI machine; the writer's window is 0.5 s


def serve(log: Path, disk_dir: Path, *extra: str, keeper: Path | None = None) -> ServerProcess:
    args = ["--pool", POOL, *extra, "--disk-dir", str(disk_dir), "--disk-capacity", "64MiB", "--metrics-port", "0"]
    return ServerProcess(args, log, keeper=keeper)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(30)) as r:
        text = r.read().decode()
    wanted = {"pool": "disk", **labels}
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:_total)?\{{(.*)\}} (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == wanted:
            return float(m.group(2))
    return 0.0


def wait_for(server: ServerProcess, name: str, at_least: float) -> None:
    deadline = time.monotonic() + patient(WAIT_S)
    while metric(server, name) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed below {at_least}"
        time.sleep(0.05)


def write_prompt(server: ServerProcess, prompt: list[int], seed: int) -> torch.Tensor:
    """Open `prompt`, write its K/V as a worker would, commit and release it cached; returns the K/V per slot."""
    with RadixKVClient(server.address, pool="disk") as client, PoolView.from_client(client) as view:
        opened = client.open(prompt)
        kv = torch.randn(2, 2, len(prompt), H, D, generator=torch.Generator().manual_seed(seed))
        slots = torch.tensor([opened.block_table[p // BS] * BS + p % BS for p in range(len(prompt))])
        view.data.view(2, 2, -1, H, D)[:, :, slots] = kv
        client.commit([opened.seq_id], [len(prompt)])
        client.release(opened.seq_id)
    return kv


def load_prompt(server: ServerProcess, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """Open `prompt` as a worker would (applying the loads); returns the host hit and the cached K/V per slot."""
    with RadixKVClient(server.address, pool="disk") as client, PoolView.from_client(client) as view:
        opened = client.open(prompt)
        swap_blocks(view.data, view.host_data, opened.offloads)
        swap_blocks(view.host_data, view.data, opened.loads)
        n = opened.num_cached_tokens
        slots = torch.tensor([opened.block_table[p // BS] * BS + p % BS for p in range(n)], dtype=torch.int64)
        kv = view.data.view(2, 2, -1, H, D)[:, :, slots].clone()
        client.release(opened.seq_id, cache=False)
    return opened.num_host_hit_tokens, kv


def objects(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.glob(f"disk/objects/*/*{OBJECT_SUFFIX}"))


def test_warm_from_disk_alone_after_sigkill_of_server_and_keeper(tmp_path: Path) -> None:
    disk_dir = tmp_path / "disk-tier"
    keeper = KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log")
    first = serve(tmp_path / "a.log", disk_dir, keeper=keeper.socket)
    try:
        written = write_prompt(first, PROMPT, seed=1)
        wait_for(first, "radixkv_disk_written_blocks", 3)
    finally:
        first.kill()
        keeper.kill()
    with serve(tmp_path / "b.log", disk_dir) as second:
        assert second.announcement["disk"]["disk"]["blocks"] == 3
        with RadixKVClient(second.address, pool="disk") as client:
            match = client.match(PROMPT, explain=True)
            assert (match.num_cached_tokens, match.num_host_cached_tokens, match.num_disk_cached_tokens) == (0, 0, 12)
            assert client.match_loadable(PROMPT) == 12, "what an open would hold: the vLLM connector's promise"
        hit, kv = load_prompt(second, PROMPT)
        assert hit == 12 and torch.equal(kv, written[:, :, :12]), "the committed K/V, bit for bit, from disk alone"
        assert metric(second, "radixkv_disk_hit_tokens") == 12
        hit_again, _ = load_prompt(second, PROMPT)  # now on the device: nothing read twice
        assert hit_again == 0 and metric(second, "radixkv_disk_read_blocks") >= 3
        assert metric(second, "radixkv_disk_written_blocks") == 0, "blocks loaded from disk are not written again"
        assert second.stop() == 0


def test_a_flipped_bit_on_disk_is_refused_counted_removed_and_recomputed(tmp_path: Path) -> None:
    disk_dir = tmp_path / "disk-tier"
    with serve(tmp_path / "a.log", disk_dir) as first:
        write_prompt(first, PROMPT, seed=2)
        wait_for(first, "radixkv_disk_written_blocks", 3)
        first.kill()
    (victim,) = objects(disk_dir)
    with open(victim, "r+b") as f:  # a bit of the first block's K/V, past the header
        f.seek(-3 * 1024 - 100, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    with serve(tmp_path / "b.log", disk_dir) as second:
        hit, _ = load_prompt(second, PROMPT)
        assert hit == 0, "a damaged object is never served"
        assert metric(second, "radixkv_disk_refused_objects", why="corrupt") == 1 and not victim.exists()
        with RadixKVClient(second.address, pool="disk") as client:
            assert client.match(PROMPT, explain=True).num_disk_cached_tokens == 0


def test_a_disk_slower_than_the_prefill_rate_is_not_read(tmp_path: Path) -> None:
    """Throttled to 1 kB/s (RADIXKV_DISK_THROTTLE_BYTES_PER_S, read by the store's I/O), a 1 KiB block takes ~1 s
    to read against a stated prefill of 1M tokens/s: the load is skipped, counted, and the prompt recomputed."""
    disk_dir = tmp_path / "disk-tier"
    with serve(tmp_path / "a.log", disk_dir) as first:
        write_prompt(first, PROMPT, seed=3)
        wait_for(first, "radixkv_disk_written_blocks", 3)
    os.environ["RADIXKV_DISK_THROTTLE_BYTES_PER_S"] = "1000"
    try:
        slow = POOL.replace("disk:", "disk:disk_prefill_tokens_per_s=1000000,", 1)
        args = ["--pool", slow, "--disk-dir", str(disk_dir), "--disk-capacity", "64MiB", "--metrics-port", "0"]
        with ServerProcess(args, tmp_path / "b.log") as second:
            assert 0 < metric(second, "radixkv_disk_read_bytes_per_second") < 10_000, "the start's probe measured it"
            hit, _ = load_prompt(second, PROMPT)
            assert hit == 0 and metric(second, "radixkv_disk_skipped_loads") == 1
    finally:
        del os.environ["RADIXKV_DISK_THROTTLE_BYTES_PER_S"]


@pytest.mark.parametrize("bad", ["other_shape", "not_a_directory"])
def test_a_directory_that_cannot_serve_is_an_error_at_start(tmp_path: Path, bad: str) -> None:
    disk_dir = tmp_path / "disk-tier"
    if bad == "other_shape":
        with serve(tmp_path / "a.log", disk_dir):
            pass
        args = ["--pool", POOL.replace("dtype=float32", "dtype=float16"), "--disk-dir", str(disk_dir),
                "--disk-capacity", "64MiB"]  # fmt: skip
        why = "dtype"
    else:
        disk_dir.write_text("a file")
        args = ["--pool", POOL, "--disk-dir", str(disk_dir), "--disk-capacity", "64MiB"]
        why = "cannot write"
    with pytest.raises(RuntimeError, match="exited"):
        ServerProcess(args, tmp_path / "b.log")
    assert why in (tmp_path / "b.log").read_text()


def test_committed_blocks_reach_disk_within_the_window_and_the_cap_holds(tmp_path: Path) -> None:
    disk_dir = tmp_path / "disk-tier"
    cap = 4 * 8192  # four objects of two 1 KiB blocks (a 4 KiB header, the data padded to 4 KiB)
    args = ["--pool", POOL, "--disk-dir", str(disk_dir), "--disk-capacity", f"{cap}B", "--metrics-port", "0"]
    with ServerProcess(args, tmp_path / "a.log") as server:
        for seed in range(6):
            write_prompt(server, [1000 * (seed + 1) + t for t in range(9)], seed)  # 2 full blocks each
            wait_for(server, "radixkv_disk_written_blocks", 2 * (seed + 1))
        assert metric(server, "radixkv_disk_bytes") <= cap
        assert sum(p.stat().st_size for p in objects(disk_dir)) <= cap
        assert metric(server, "radixkv_disk_evicted_blocks") > 0
    assert np.all([p.stat().st_size % 4096 == 0 for p in objects(disk_dir)])


def test_blocks_written_to_disk_are_kv_events_of_medium_storage(tmp_path: Path) -> None:
    """vLLM's medium names: the device's blocks are "GPU" events, the disk tier's "STORAGE" ones (hashes only, as
    vLLM's offloading connector reports a tier's blocks it has no tokens for)."""
    disk_dir = tmp_path / "disk-tier"
    extra = ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-topic", "disk-test"]
    with serve(tmp_path / "a.log", disk_dir, *extra) as server, zmq.Context() as ctx:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(server.announcement["kv_events"]["disk"]["endpoint"])
        write_prompt(server, PROMPT, seed=4)
        expected = {wire_hash(h) for h in chain_hashes(PROMPT[:12], BS)}
        on_disk: set[int] = set()
        deadline = time.monotonic() + patient(WAIT_S)
        while not expected <= on_disk:
            assert time.monotonic() < deadline, f"no STORAGE events for {expected - on_disk}"
            if not sub.poll(1000):
                continue
            _, _, payload = sub.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:
                if event.get("medium") == "STORAGE" and event["type"] == "BlockStored":
                    on_disk.update(event["block_hashes"])
        sub.close(linger=0)
