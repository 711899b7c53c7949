"""`ServerProcess`, the one way tests, the demo and the benchmarks start a server: ready when built, gone
when stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.client import RadixKVClient
from radixkv.server.process.spawn import ServerProcess, patient

POOL = ["--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8,dtype=float16"]


def test_the_address_serves_once_built_and_a_stop_is_graceful(tmp_path: Path) -> None:
    with ServerProcess(POOL, tmp_path / "server.log") as server:
        assert server.announcement["event"] == "serving" and server.address == f"127.0.0.1:{server.port}"
        with RadixKVClient(server.address, timeout=patient(10)) as client:
            assert client.stats().num_blocks_total == 8
    assert server.proc.returncode == 0  # SIGTERM: drained and exited cleanly


def test_a_server_that_exits_before_serving_raises_with_its_status_and_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited \(2\) before serving; log: .*colour") as failed:
        ServerProcess(["--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,num_blocks=8,colour=blue"],
                      tmp_path / "server.log")  # fmt: skip
    assert "colour" in (tmp_path / "server.log").read_text(), failed.value
