"""The online audit (`--audit-interval`): on a real server process it runs, passes a healthy pool under traffic,
and catches a ref count corrupted through the Debug service, logging the block and going on; in process, the
digest recount names a drifted namespace and a busy pool skips its slice."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from prometheus_client import CollectorRegistry

from radixkv.client import RadixKVClient
from radixkv.server.process.app import parse_args
from radixkv.server.process.audit import PoolAuditor, check_digests, check_pool
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.process.spawn import ServerProcess, patient
from radixkv.server.rules.config import PoolConfig
from radixkv.v1 import debug_pb2, debug_pb2_grpc


def _metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as r:
        return str(r.read().decode())


def _value(text: str, name: str, pool: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{pool="{pool}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _divergences(server: ServerProcess) -> list[dict[str, object]]:
    assert server.log_path is not None
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    return [entry for entry in lines if entry.get("msg") == "audit divergence"]


def _workload(client: RadixKVClient) -> list[int]:
    """Cached prefixes in two namespaces, forks and one sequence left open: every ledger the audit recounts moves."""
    for namespace in ("a", "b"):
        for i in range(4):
            opened = client.open([1, 2, 3, 4, 5, 6, 7, 8, 9, i], namespace)
            client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
            client.release(opened.seq_id)
    held = client.open([9, 9, 9, 9, 8, 8, 8, 8, 7], "a")
    return held.block_table.tolist()


def test_the_audit_runs_and_a_healthy_pool_passes(
    start_server: Callable[..., ServerProcess], wait_until: Callable[..., bool]
) -> None:
    server = start_server("--audit-interval", "0.02", "--metrics-port", "0")
    with RadixKVClient(server.address) as client:
        _workload(client)
        for pool in ("default", "tiny"):
            assert wait_until(lambda pool=pool: _value(_metrics(server), "radixkv_audit_runs_total", pool) >= 3)
        text = _metrics(server)
    assert _value(text, "radixkv_audit_failures_total", "default") == 0
    assert _value(text, "radixkv_audit_slice_seconds_count", "default") >= 3
    assert _value(text, "radixkv_audit_max_slice_seconds", "default") > 0  # how short a hold is: bench_audit.py
    assert _divergences(server) == []


def test_the_audit_catches_a_corrupted_ref_count_and_keeps_running(
    start_server: Callable[..., ServerProcess], wait_until: Callable[..., bool]
) -> None:
    server = start_server("--audit-interval", "0.02", "--metrics-port", "0", "--debug-rpc")
    with RadixKVClient(server.address) as client, grpc.insecure_channel(server.address) as channel:
        block_id = _workload(client)[0]
        assert wait_until(lambda: _value(_metrics(server), "radixkv_audit_runs_total", "default") >= 2)
        assert _value(_metrics(server), "radixkv_audit_failures_total", "default") == 0
        debug = debug_pb2_grpc.DebugStub(channel)
        corrupted = debug.CorruptRefCount(debug_pb2.CorruptRefCountRequest(pool="default", block_id=block_id, delta=1))
        assert corrupted.ref_count == 2
        assert wait_until(lambda: _value(_metrics(server), "radixkv_audit_failures_total", "default") >= 2)
        runs = _value(_metrics(server), "radixkv_audit_runs_total", "default")
        assert wait_until(lambda: _value(_metrics(server), "radixkv_audit_runs_total", "default") > runs)
        assert _value(_metrics(server), "radixkv_audit_failures_total", "tiny") == 0  # the other pool is audited apart
        client.open([3, 1, 4, 1, 5], "a")  # still serving
    divergences = _divergences(server)
    assert len(divergences) == 1, divergences  # the first divergence is logged once, not every slice
    assert divergences[0]["pool"] == "default"
    assert divergences[0]["level"] == "error"
    assert f"block {block_id}: ref_count 2 != holders 1" in str(divergences[0]["violation"])
    assert isinstance(divergences[0]["at"], float)


def test_corrupt_ref_count_refuses_a_bad_block_id_and_a_zero_delta(server: ServerProcess) -> None:
    """On the suite's shared server (its Debug service on, "default" of 256 blocks): a refusal changes nothing."""
    with grpc.insecure_channel(server.address) as channel:
        debug = debug_pb2_grpc.DebugStub(channel)
        for request, field in (
            (debug_pb2.CorruptRefCountRequest(pool="default", block_id=256, delta=1), "block_id"),
            (debug_pb2.CorruptRefCountRequest(pool="default", block_id=0, delta=0), "delta"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                debug.CorruptRefCount(request, timeout=patient(10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in str(info.value.details())


# type: ignore[no-untyped-def]
def test_audit_interval_comes_from_the_flag_or_the_toml_and_must_not_be_negative(tmp_path) -> None:
    pool = ["--pool", "p:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8"]
    assert parse_args([*pool])[0].audit_interval_seconds == 0
    assert parse_args([*pool, "--audit-interval", "2.5"])[0].audit_interval_seconds == 2.5
    toml = tmp_path / "server.toml"
    toml.write_text("audit_interval_seconds = 7.0\n")
    assert parse_args([*pool, "--config", str(toml)])[0].audit_interval_seconds == 7.0
    with pytest.raises(ValueError, match="audit_interval_seconds"):
        parse_args([*pool, "--audit-interval", "-1"])
    assert parse_args([*pool])[0].audit_slice_ms == 2.0
    assert parse_args([*pool, "--audit-slice-ms", "0.5"])[0].audit_slice_ms == 0.5
    with pytest.raises(ValueError, match="audit_slice_ms"):
        parse_args([*pool, "--audit-slice-ms", "0"])


# type: ignore[no-untyped-def]
def test_corrupt_ref_count_is_for_admins_only(auth_server: ServerProcess, tls_files, tokens) -> None:
    credentials = grpc.ssl_channel_credentials(tls_files[0].read_bytes())
    with grpc.secure_channel(auth_server.address, credentials) as channel:
        debug = debug_pb2_grpc.DebugStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            debug.CorruptRefCount(
                debug_pb2.CorruptRefCountRequest(pool="default", block_id=0, delta=1),
                metadata=(("authorization", f"Bearer {tokens['acme']}"),),
                timeout=patient(10),
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_digest_recount_names_a_namespace_whose_digest_or_count_drifted() -> None:
    pool = build_pool(PoolConfig(name="p", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=32), 16)
    try:
        for namespace in ("a", "b"):
            opened = pool.cache.open(list(range(1, 14)), namespace)
            pool.cache.commit([opened.seq_id], [13])
            pool.cache.release(opened.seq_id)
        check_pool(pool)  # a healthy pool passes every recount
        assert pool.events.num_blocks == {"a": 3, "b": 3}
        pool.events.digests["b"] ^= 1
        with pytest.raises(AssertionError, match="namespace 'b': event hub digest"):
            check_digests(pool)
        pool.events.digests["b"] ^= 1
        pool.events.num_blocks["a"] += 1
        with pytest.raises(AssertionError, match="event hub block counts"):
            check_digests(pool)
    finally:
        pool.close()


def test_a_busy_pool_skips_its_slice_instead_of_waiting() -> None:
    pool = build_pool(PoolConfig(name="p", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=8), 16)
    registry = CollectorRegistry()
    auditor = PoolAuditor({"p": pool}, interval=1.0, registry=registry)
    try:
        with pool.lock:  # an RPC holds the pool
            assert auditor.audit(pool) is None
        assert registry.get_sample_value("radixkv_audit_skipped_total", {"pool": "p"}) == 1
        assert registry.get_sample_value("radixkv_audit_runs_total", {"pool": "p"}) is None
        assert auditor.audit(pool) is True
        assert registry.get_sample_value("radixkv_audit_runs_total", {"pool": "p"}) == 1
        assert not pool.lock.locked()
    finally:
        pool.close()


def test_the_audit_under_a_load_of_opens_appends_and_releases_reports_no_divergence(
    start_server: Callable[..., ServerProcess], wait_until: Callable[..., bool]
) -> None:
    """Slices of 50 us copy a node or a few per lock hold, so every run's copy races the load's writes."""
    server = start_server("--audit-interval", "0.001", "--audit-slice-ms", "0.05", "--metrics-port", "0")
    with RadixKVClient(server.address, pool="default") as client:
        runs_before = _value(_metrics(server), "radixkv_audit_runs_total", "default")
        for i in range(150):
            stem = [i % 5 + 1] * 16 * (1 + i % 3)  # shared stems: splits, locks and unlocks on shared nodes
            opened = client.open([*stem, i, i + 1, i + 2], "ab"[i % 2])
            client.append(opened.seq_id, [7] * (1 + i % 20))
            client.commit([opened.seq_id], [len(stem) + 3])
            if i % 4:
                client.release(opened.seq_id, cache=i % 3 != 0)
        assert wait_until(lambda: _value(_metrics(server), "radixkv_audit_runs_total", "default") > runs_before + 3)
        text = _metrics(server)
    assert _value(text, "radixkv_audit_failures_total", "default") == 0
    assert _value(text, "radixkv_audit_slice_seconds_count", "default") > _value(
        text, "radixkv_audit_runs_total", "default"
    )  # runs took several holds each
    assert _divergences(server) == []
