"""One slow step holds back only the calls that need its pool's lock (issue 32 item 9).

A Session step of tenant alpha is held inside the lock of pool `default` (Debug.StallSteps, served
only with --debug-rpc). While it is held: Health/Check answers, alpha's and beta's calls on pool
`other` (unary and Session steps) answer, beta's calls that take no pool lock answer. Beta's unary
call on `default` waits: it completes only after the held step is let go, and after it (the held
step's sequence is opened first). Ordering facts, no clock: everything that must not wait completes
while the step is still held (a call on `default` is still pending when they are done).
Before: steps were answered on gRPC's completion-queue thread, so Health/Check and every other
call on the server waited behind the held step.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixkv.client import RadixKVClient
from radixkv.sequences.step import Append, Step
from radixkv.v1 import debug_pb2, debug_pb2_grpc, kvcache_pb2_grpc
from radixkv.v1 import kvcache_pb2 as pb
from tests.reliability.conftest import Debug, ServerProcess

TOKENS = {"alpha": "alpha-slow-step-0001", "beta": "beta-slow-step-00002", "root": "root-slow-step-00003"}
POOL = "num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=256,dtype=float16"
TIMEOUT = 60  # a call that stalls behind the held step would time out long before the hold (60 s) ends


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d: Path = tmp_path_factory.mktemp("slow-step")
    tenants = "".join(f'[tenants.{name}]\ntoken = "{token}"\n' for name, token in TOKENS.items())
    (d / "tenants.toml").write_text(tenants + "admin = true\n")  # the last one, root, is the admin
    proc = ServerProcess(
        ["--pool", f"default:{POOL}", "--pool", f"other:{POOL}", "--auth-tokens", str(d / "tenants.toml"),
         "--max-workers", "16", "--debug-rpc"],
        d / "server.log",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


def _metadata(tenant: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def test_a_step_held_in_its_pools_lock_delays_only_the_calls_that_need_that_lock(server: ServerProcess) -> None:
    with (
        grpc.insecure_channel(server.address) as channel,
        RadixKVClient(server.address, token=TOKENS["alpha"]) as alpha,
        RadixKVClient(server.address, token=TOKENS["alpha"], pool="other") as alpha_other,
        RadixKVClient(server.address, token=TOKENS["beta"], pool="other") as beta_other,
        concurrent.futures.ThreadPoolExecutor(2) as pool_threads,
    ):
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        beta_session = stub.OpenSession(pb.OpenSessionRequest(), metadata=_metadata("beta"), timeout=TIMEOUT)
        stall = debug_pb2_grpc.DebugStub(channel).StallSteps(
            debug_pb2.StallStepsRequest(pool="default", max_seconds=60), metadata=_metadata("root"), timeout=TIMEOUT
        )
        assert not next(stall).stalled, "armed"
        held = alpha.submit(Step(opens=[([1, 2, 3, 4, 5], "held")]))  # a Session step on `default`
        assert next(stall).stalled, "the step is held inside the lock of `default`"

        # Beta's unary call on `default` needs the held lock: it waits.
        open_default = pb.OpenSequencesRequest(
            session_id=beta_session.session_id, pool="default", prompts=[pb.Prompt(token_ids=[9, 9, 9])]
        )
        waiting = pool_threads.submit(stub.OpenSequences, open_default, metadata=_metadata("beta"), timeout=TIMEOUT)

        # What does not need that lock answers while the step is held.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        mine = alpha_other.open([1, 2, 3, 4, 5, 6])  # the same tenant, another pool: unary
        grown = alpha_other.step(Step(append=Append([mine.seq_id], [1], [7])))  # and a Session step there
        assert grown.appended is not None and grown.appended.num_tokens == [7]
        theirs = beta_other.open([8, 8, 8])  # another tenant, another pool
        beta_other.release(theirs.seq_id)
        assert (
            stub.KeepAlive(
                pb.KeepAliveRequest(session_id=beta_session.session_id), metadata=_metadata("beta"), timeout=TIMEOUT
            ).ttl_seconds
            > 0
        )  # no pool lock at all
        alpha_other.release(mine.seq_id)
        assert not waiting.done(), "the call on `default` is still waiting: the step was held throughout"

        stall.cancel()  # let the held step go
        opened = held.result().opened[0]
        after = waiting.result(timeout=TIMEOUT).sequences[0]
        assert opened.num_cached_tokens == 0 and after.seq_id > opened.seq_id, "the held step applied first"
        alpha.release(opened.seq_id, cache=False)
        stub.CloseSession(
            pb.CloseSessionRequest(session_id=beta_session.session_id), metadata=_metadata("beta"), timeout=TIMEOUT
        )
    debug = Debug(server.address, token=TOKENS["root"])
    for pool in ("default", "other"):
        debug.check(pool)
    debug.close()
