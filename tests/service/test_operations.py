"""Running the server: health, reflection, metrics, graceful shutdown on SIGTERM, and configuration errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from radixkv.client import RadixKVClient
from radixkv.errors import UnknownSequence
from radixkv.sequences.results import OpenResult
from radixkv.sequences.step import Append, Step
from radixkv.server.process.spawn import patient


def test_health_reports_serving_for_the_server_and_the_service(server) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "radixkv.v1.KVCache"):
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=patient(10)).status
                == health_pb2.HealthCheckResponse.SERVING
            )


def test_reflection_lists_the_service_and_a_generic_client_can_call_it(server) -> None:  # type: ignore[no-untyped-def]
    # What grpcurl does: learn the schema from the server, then call with dynamic messages.
    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "radixkv.v1.KVCache" in database.get_services()
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("radixkv.v1.KVCache").FindMethodByName("Stats")
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            "/radixkv.v1.KVCache/Stats",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        response = call(request_class(pool="default"), timeout=patient(10))
        assert response.stats.num_blocks_total == 256


def _scrape(server) -> str:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=patient(10)) as r:
        return r.read().decode()


def _sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not exposed"
    return float(match.group(1))


def test_metrics_expose_pool_gauges_counters_and_rpc_latency(server) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client:
        prompt = list(range(700, 716))
        client.release(_written(client, client.open(prompt, "metrics")))
        client.release(_written(client, client.open(prompt + [1], "metrics")))
        held = client.open([1, 2, 3, 4, 5], "metrics")
        stats = client.stats()
        text = _scrape(server)
        pool = '{pool="default"}'
        assert _sample(text, "radixkv_pool_blocks", pool) == 256
        for name in (
            "radixkv_blocks_free",
            "radixkv_blocks_cached",
            "radixkv_blocks_evictable",
            "radixkv_blocks_in_use",
            "radixkv_block_usage_ratio",
        ):
            _sample(text, name, pool)
        assert _sample(text, "radixkv_live_sequences", pool) == stats.num_live_sequences >= 1
        assert _sample(text, "radixkv_hit_tokens_total", pool) == stats.num_hit_tokens >= 16
        assert _sample(text, "radixkv_requested_tokens_total", pool) == stats.num_requested_tokens
        ratio = _sample(text, "radixkv_prefix_hit_ratio", pool)
        assert 0 < ratio == stats.num_hit_tokens / stats.num_requested_tokens, "hits / requested, since the start"
        for name in ("radixkv_evicted_blocks_total", "radixkv_allocation_failures_total", "radixkv_cow_copies_total"):
            _sample(text, name, pool)
        assert _sample(text, "radixkv_sessions") >= 1
        assert _sample(text, "radixkv_rpc_duration_seconds_count", '{method="OpenSequences",pool="default"}') >= 3
        assert _sample(text, "radixkv_rpcs_total", '{code="OK",method="OpenSequences",pool="default"}') >= 3
        client.release(held.seq_id)


def test_metrics_count_each_session_step_by_its_code(server) -> None:  # type: ignore[no-untyped-def]
    """A stream's steps are timed and counted one by one, a refused step under its own code; they are kept just
    after each response leaves, so the scrape may trail the last step by a moment."""
    ok, missing = '{code="OK",method="Session",pool="default"}', '{code="NOT_FOUND",method="Session",pool="default"}'
    timed = '{method="Session",pool="default"}'

    def counts() -> tuple[float, float, float]:
        text = _scrape(server)
        return tuple(  # type: ignore[return-value]
            _sample(text, name, labels) if f"{name}{labels} " in text else 0.0
            for name, labels in (("radixkv_rpcs_total", ok), ("radixkv_rpcs_total", missing),
                                 ("radixkv_rpc_duration_seconds_count", timed))
        )  # fmt: skip

    before = counts()
    with RadixKVClient(server.address) as client:
        seq_id = client.step(Step(opens=[([1, 2, 3, 4, 5], "metrics-steps")])).opened[0].seq_id
        for token in range(3):
            client.step(Step(append=Append([seq_id], [1], [token])))
        with pytest.raises(UnknownSequence):
            client.step(Step(append=Append([seq_id + 10_000], [1], [0])))
        client.step(Step(releases=[([seq_id], False)]))
        expected = (before[0] + 5, before[1] + 1, before[2] + 6)
        deadline = time.monotonic() + patient(60)
        while counts() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counts() == expected


def test_sigterm_stops_gracefully_and_frees_the_pool_memory(start_server) -> None:  # type: ignore[no-untyped-def]
    proc = start_server("--grace", "5")
    client = RadixKVClient(proc.address)
    client.release(_written(client, client.open([1, 2, 3, 4, 5])))  # one cached block
    client.open([6, 7, 8])
    segment = client.get_pool().handle.shared_memory.name
    assert os.path.exists(f"/dev/shm/{segment}")
    events = iter(client.watch_events(include_snapshot=True))
    assert next(events).snapshot  # the stream is open on the server
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=patient(120)) == 0
    assert list(events) == []  # the stream ended cleanly (OK), not cut off
    assert not os.path.exists(f"/dev/shm/{segment}")
    client.close()  # the server and its sessions are gone: closing still succeeds
    log = proc.log_path.read_text()
    assert '"msg": "stopping"' in log and '"msg": "stopped"' in log


def test_a_bad_configuration_exits_2_naming_the_problem(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = [
        ["--pool", "default:num_layers=2,num_kv_heads=2,head_dim=8,num_blocks=8,colour=blue"],
        ["--pool", "default:num_layers=2,num_kv_heads=2,head_dim=8"],  # no size
        ["--model", "no-such-model"],  # the default pool's shape from a model neither known nor on disk
    ]
    for args in bad:
        result = subprocess.run(
            [sys.executable, "-m", "radixkv.server.process.app", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("radixkv serve: ")


def _written(client: RadixKVClient, opened: OpenResult) -> int:
    """As a worker that wrote every token of `opened` would: commit them (only written blocks are cached)."""
    client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
    return opened.seq_id
