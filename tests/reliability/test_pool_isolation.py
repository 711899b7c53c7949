"""No tenant gets a writable mapping of another tenant's blocks, against a real server process.

A pool handle (GetPool, `map_pools`) maps the pool's memory read and write, so the server grants it only for a
pool that serves the caller alone (`tenants = [NAME]`, server/rules/tenants.py). Tenants alice and bob may both map
pools; each has its own; carol may map none; "shared" serves all three. bob can neither use alice's pool nor map
the shared one, so no mapping he can obtain holds a byte of alice's K/V, and alice's blocks, written through her
own mapping, are exactly what she wrote after bob has done all he can.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixkv.client import PoolView, RadixKVClient
from radixkv.errors import PermissionDenied
from radixkv.server.process.spawn import ServerProcess
from radixkv.server.rules.config import config_from_mapping
from radixkv.server.rules.tenants import PoolAccess

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789", "carol": "carol-token-0123456789"}
SHAPE = "num_layers=2,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=32,dtype=float32"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("isolation")
    tokens = d / "tokens.toml"
    tokens.write_text(
        "".join(
            f'[tenants.{name}]\ntoken = "{token}"\nmap_pools = {"true" if name != "carol" else "false"}\n'
            for name, token in TOKENS.items()
        )
    )
    pools = [f"alice:{SHAPE},tenants=alice", f"bob:{SHAPE},tenants=bob", f"shared:{SHAPE}", f"default:{SHAPE}"]
    flags = [arg for p in pools for arg in ("--pool", p)]
    with ServerProcess([*flags, "--auth-tokens", str(tokens)], Path(d) / "server.log") as proc:
        yield proc


def connect(server: ServerProcess, tenant: str, pool: str) -> RadixKVClient:
    return RadixKVClient(server.address, pool=pool, token=TOKENS[tenant])


def test_no_tenant_maps_another_tenants_blocks(server: ServerProcess) -> None:
    prompt = list(range(100, 117))  # 4 full blocks
    with connect(server, "alice", "alice") as alice, PoolView(alice.get_pool()) as mine:
        opened = alice.open(prompt, "chat")
        secret = torch.randn(len(opened.block_table), *mine.data.shape[3:])
        for i, block in enumerate(opened.block_table):
            mine.data[:, :, block] = secret[i]  # alice's worker writes her K/V through her own mapping
        alice.commit([opened.seq_id], [len(prompt)])
        alice.release(opened.seq_id, cache=True)
        alices_segment = alice.get_pool().handle.shared_memory.name

        with pytest.raises(PermissionDenied, match="may not use pool 'alice'") as refused:
            connect(server, "bob", "alice")  # not even a session on her pool
        assert refused.value.metadata["field"] == "pool"
        with connect(server, "bob", "shared") as bob, pytest.raises(PermissionDenied) as refused:
            bob.get_pool()  # a pool alice also uses: never mapped
        assert "'shared' also serves tenants ['alice', 'carol']" in str(refused.value)
        with connect(server, "bob", "bob") as bob, PoolView(bob.get_pool()) as his:
            assert bob.get_pool().handle.shared_memory.name != alices_segment  # his own memory, none of hers
            his.data.fill_(7.0)  # all bob can write
        with pytest.raises(PermissionDenied, match="may not use pool 'alice'"):
            connect(server, "carol", "alice")
        with connect(server, "carol", "shared") as carol, pytest.raises(PermissionDenied, match="map_pools"):
            carol.get_pool()

        again = alice.open(prompt, "chat")
        assert again.num_cached_tokens == 16
        for i, block in enumerate(again.block_table[:4]):
            assert torch.equal(mine.data[:, :, block], secret[i].expand_as(mine.data[:, :, block]))
        alice.release(again.seq_id, cache=False)


def test_a_pool_naming_an_unknown_tenant_is_refused_at_start() -> None:
    data = {
        "pools": {"p": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "num_blocks": 8, "tenants": ["zed"]}},
        "tenants": {"alice": {"token": "t"}},
    }
    with pytest.raises(ValueError, match=r"pool 'p': tenants \['zed'\] are not configured tenants"):
        config = config_from_mapping(data)
        PoolAccess(config.tenants, config.pools)  # as the server builds it, before it serves
    data["pools"]["p"]["tenants"] = [3]
    with pytest.raises(ValueError, match="pool 'p': tenants=\\[3\\] must be tenant names"):
        config_from_mapping(data)
