"""A worker process writes K/V through `PoolView`; the server's own storage holds exactly those bytes."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.server.process.spawn import patient

WORKER = Path(__file__).with_name("kv_worker.py")


def _worker_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kv_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_written_by_a_worker_is_what_the_server_holds(server, debug) -> None:  # type: ignore[no-untyped-def]
    seed = 1234
    with RadixKVClient(server.address) as client:
        opened = client.open(list(range(40, 50)), "pool-view")  # 10 tokens: 3 blocks, the last partly written
        slots = np.asarray(opened.slots).tolist()
        table = opened.block_table.tolist()
        untouched = [b for b in range(256) if b not in table][:3]
        before_untouched = debug.checksum(untouched)
        result = subprocess.run(
            [sys.executable, str(WORKER), server.address, json.dumps(slots), json.dumps(table), str(seed)],
            capture_output=True, text=True, timeout=patient(120), check=True,
        )  # fmt: skip
        worker_checksum = result.stdout.strip()
        # The server hashes its own mapping of the pool: the worker's writes landed there, bit for bit.
        assert debug.checksum(table) == worker_checksum
        assert debug.checksum(untouched) == before_untouched  # and nowhere else

        with PoolView.from_client(client) as view:
            layout = view.layout
            assert view.data.shape == (
                layout.num_layers,
                2,
                layout.num_blocks,
                layout.block_size,
                layout.num_kv_heads,
                layout.head_dim,
            )
            expected = _worker_module().seeded_kv(
                len(slots), layout.num_layers, layout.num_kv_heads, layout.head_dim, seed, view.data.dtype
            )
            index = torch.tensor(slots, dtype=torch.long)
            for layer in range(layout.num_layers):
                k_cache, v_cache = view.layer(layer)
                assert torch.equal(k_cache.reshape(-1, layout.num_kv_heads, layout.head_dim)[index], expected[layer, 0])
                assert torch.equal(v_cache.reshape(-1, layout.num_kv_heads, layout.head_dim)[index], expected[layer, 1])
            mine = view.data[:, :, torch.tensor(table)].contiguous().view(torch.uint8).numpy().tobytes()
            assert hashlib.sha256(mine).hexdigest() == worker_checksum
        client.release(opened.seq_id, cache=False)
