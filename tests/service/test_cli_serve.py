"""`radixkv serve` as a new user meets it: --help lists every pool key, mistakes are one line, no flags serve a pool."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import UnknownPool
from radixkv.kv_cache import Limits
from radixkv.memory.layout import PoolLayout
from radixkv.server.events.kv_events_config import KVEventsConfig
from radixkv.server.process import flags
from radixkv.server.process.app import main, parse_args
from radixkv.server.rules.config import PoolConfig

SMOLLM2 = (30, 3, 64)


def test_help_lists_every_pool_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    keys = [
        (f.name, f.default)
        for f in (*dataclasses.fields(PoolConfig), *dataclasses.fields(Limits))
        if f.name not in ("name", "limits", "kv_events")
    ]
    stream = [f for f in dataclasses.fields(KVEventsConfig) if f.name != "withheld_tenants"]  # kv_events_* keys
    keys += [(f"kv_events_{f.name}", f.default) for f in stream]
    for name, value in keys:
        default = "required" if value is dataclasses.MISSING else "unset" if value is None else str(value) or '""'
        line = next((line for line in out.splitlines() if line.split()[:1] == [name]), None)
        assert line is not None, f"--help does not list pool key {name}"
        assert line.split()[1] == default and len(line.split()) > 2, f"{name}: default and meaning: {line!r}"
    assert 'one pool named "default"' in out and "0.9" in out and "512 MiB" in out and "smollm2-135m" in out


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            "p:num_blocks=4",
            "pool 'p': missing num_layers, num_kv_heads, head_dim; radixkv serve --help lists every key",
        ),
        (
            "p:num_layer=2,num_kv_heads=1,head_dim=8,num_blocks=4",
            "pool 'p': unknown key 'num_layer' (did you mean num_layers?); radixkv serve --help lists every key",
        ),
        (
            "p:num_layers=x,num_kv_heads=1,head_dim=8,num_blocks=4",
            "pool 'p': num_layers='x' must be a whole number >= 0",
        ),
        (
            "p:num_layers=2,num_kv_heads=1,head_dim=8,num_blocks=4,block_size=24",
            "pool 'p': block_size must be a power of two, got 24",
        ),
        ("p:num_layers=2,num_kv_heads=1,head_dim=8,num_blocks=4,dtype=int4", "pool 'p': dtype must be one of"),
        (
            "p:num_layers=2,num_kv_heads=1,head_dim=8",
            "pool 'p': give exactly one of num_blocks, memory_bytes, memory_fraction",
        ),
    ],
)
def test_a_wrong_or_missing_key_is_one_line(capsys, flag, message):
    assert main(["serve", "--pool", flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixkv serve: {message}") and err.count("\n") == 1, err


def test_a_bad_pool_never_reaches_a_traceback():
    # A real process: the message is all a user sees, with no traceback in the logs either.
    done = subprocess.run(
        [sys.executable, "-m", "radixkv.cli", "serve", "--pool", "p:num_blocks=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr
        == "radixkv serve: pool 'p': missing num_layers, num_kv_heads, head_dim; radixkv serve --help lists every key\n"
    )


def test_no_pool_flags_give_the_default_pool(monkeypatch):
    monkeypatch.setattr(flags, "_default_device", lambda: "cpu")
    (pool,) = parse_args(["serve"])[0].pools
    assert (pool.name, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size) == ("default", *SMOLLM2, 16)
    assert (pool.device, pool.memory_bytes, pool.memory_fraction) == ("cpu", 512 * 2**20, None)
    monkeypatch.setattr(flags, "_default_device", lambda: "cuda")
    (pool,) = parse_args(["serve"])[0].pools
    assert (pool.device, pool.memory_fraction, pool.reserved_bytes, pool.memory_bytes) == ("cuda", 0.9, 2**30, None)
    (pool,) = parse_args(["serve", "--memory-fraction", "0.5"])[0].pools
    assert pool.memory_fraction == 0.5


def test_model_shapes_the_default_pool(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 16})
    )
    (pool,) = parse_args(["serve", "--model", str(tmp_path), "--device", "cpu"])[0].pools
    assert (pool.name, pool.num_layers, pool.num_kv_heads, pool.head_dim) == ("default", 16, 8, 64)
    assert (
        main(["serve", "--model", str(tmp_path), "--pool", "p:num_layers=1,num_kv_heads=1,head_dim=8,num_blocks=4"])
        == 2
    )
    assert "--model, --device, --memory-fraction, --block-size, --kv-dtype and --num-blocks shape the default pool" in (
        capsys.readouterr().err
    )
    assert main(["serve", "--model", str(tmp_path / "nothing.gguf")]) == 2
    assert "not a known model" in capsys.readouterr().err


def test_block_size_dtype_and_blocks_shape_the_default_pool_for_an_engine(tmp_path, capsys):
    """What vLLM's connector needs: the engine's block size (a multiple of 32 on its CPU backend) and KV dtype."""
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30})
    )
    flags = ["serve", "--model", str(tmp_path), "--device", "cpu", "--block-size", "32", "--kv-dtype", "float32"]
    (pool,) = parse_args([*flags, "--num-blocks", "100"])[0].pools
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype) == (
        30,
        3,
        64,
        32,
        "float32",
    )
    assert (pool.num_blocks, pool.memory_bytes) == (100, None)
    (pool,) = parse_args(flags)[0].pools
    assert (pool.num_blocks, pool.memory_bytes) == (None, 512 * 2**20)  # sized by memory as before
    assert main(["serve", "--block-size", "48"]) == 2
    assert "block_size must be a power of two, got 48" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--kv-dtype", "int7"])
    assert exited.value.code == 2 and "'int7' is not a KV dtype" in capsys.readouterr().err


def test_serve_without_pool_flags_serves_default(start_server):
    proc = start_server("--device", "cpu", pool_flags=False)
    with RadixKVClient(proc.address) as client:
        layout = client.get_pool().layout
        assert layout == PoolLayout(
            **dict(zip(("num_layers", "num_kv_heads", "head_dim"), SMOLLM2, strict=True)),
            block_size=16,
            num_blocks=(512 * 2**20) // layout.bytes_per_block,
            dtype="float16",
        )
        assert client.stats().num_blocks_total == layout.num_blocks == 1456
    assert proc.stop() == 0


def test_client_checks_its_pool_name_at_construction(server):
    with pytest.raises(UnknownPool, match="defualt"):
        RadixKVClient(server.address, pool="defualt")
    with RadixKVClient(server.address, pool="tiny") as client:
        assert client.stats().num_blocks_total == 8
