"""Issue 32's attacks on tenant limits (items 3-6), one test each, against a real server process: what each now gets.

Eight tenants share one pool with a host tier: `quota` has a 64-block quota; `meter`, `stepper` and `resumer`
a budget of 1,000 tokens a second (unary calls, Session steps, resumes); `streamer` opens Session streams;
`victim` and `watcher` are the others whose shares the attacks took. `--max-session-streams 2`: a share of 1
each, while each tenant's share of all streams (20, from `--max-workers 40`) is 2, so that limit alone would
not stop the attack.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import LimitExceeded, QuotaExceeded, TokenBudget
from radixkv.sequences.step import Append, Step
from radixkv.server.process.spawn import ServerProcess, patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc

BS = 16
NUM_BLOCKS = 8192
HOST_BLOCKS = 4096
QUOTA = 64
RATE = 1000
NAMES = ("quota", "victim", "meter", "stepper", "resumer", "streamer", "watcher", "admin")
TOKENS = {name: f"{name}-token-{i:012d}" for i, name in enumerate(NAMES)}
EXTRA = {
    "quota": f"max_blocks = {QUOTA}",
    "meter": f"max_tokens_per_second = {RATE}",
    "stepper": f"max_tokens_per_second = {RATE}",
    "resumer": f"max_tokens_per_second = {RATE}",
    "admin": "admin = true",
}
TENANTS = "\n".join(f'[tenants.{n}]\ntoken = "{TOKENS[n]}"\n{EXTRA.get(n, "")}' for n in NAMES)
NUM_TENANTS = len(NAMES)
POOL = (
    f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BS},num_blocks={NUM_BLOCKS},dtype=float16,"
    f"host_num_blocks={HOST_BLOCKS}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("tenant-limits")
    (d / "tenants.toml").write_text(TENANTS)
    flags = ["--pool", POOL, "--auth-tokens", str(d / "tenants.toml"), "--max-session-streams", "2",
             "--max-workers", "40", "--debug-rpc"]  # fmt: skip
    proc = ServerProcess(flags, d / "server.log")
    yield proc
    assert proc.stop() == 0, Path(d / "server.log").read_text()[-2000:]


@pytest.fixture
def connect(server: ServerProcess) -> Iterator[Callable[[str], RadixKVClient]]:
    """A client of the named tenant (closed after the test); the ledger and the core are checked after it."""
    opened: list[RadixKVClient] = []

    def client(name: str) -> RadixKVClient:
        opened.append(RadixKVClient(server.address, token=TOKENS[name], timeout=patient(30)))
        return opened[-1]

    yield client
    for c in opened:
        c.close()
    with grpc.insecure_channel(server.address) as channel:
        check = debug_pb2_grpc.DebugStub(channel).CheckInvariants(
            debug_pb2.CheckInvariantsRequest(), metadata=[("authorization", f"Bearer {TOKENS['admin']}")], timeout=30
        )
    assert not check.violation, check.violation


def retry_budget(call: Callable[[], object], timeout: float = 30.0) -> object:
    """`call()`, retried while the tenant's bucket refills (TOKEN_BUDGET says when to retry)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except TokenBudget as e:
            assert time.monotonic() < deadline, "the token bucket never refilled"
            time.sleep(min(e.retry_delay or 0.05, 1.0))


# -- item 3: reservations count against the block quota ----------------------------------------------------------


def test_a_reservation_counts_against_the_block_quota_unary_and_step(connect: Callable[[str], RadixKVClient]) -> None:
    quota, victim = connect("quota"), connect("victim")
    huge = (NUM_BLOCKS - 100) * BS  # the attack: reserve nearly the whole pool behind a 1-token prompt
    with pytest.raises(QuotaExceeded) as unary:
        quota.open([1], max_new_tokens=huge)
    assert unary.value.needed == NUM_BLOCKS - 100 + 1 and unary.value.available == QUOTA
    with pytest.raises(QuotaExceeded):
        quota.step(Step(opens=[([1], "")], max_new_tokens=[huge]))
    # What the attack took from the others: their opens inside their quota (here, half the pool) go through.
    victim.open(list(range(1, 1 + BS)), max_new_tokens=(NUM_BLOCKS // 2) * BS)

    # Inside the quota: a reservation of exactly 64 blocks, then nothing more, by either path.
    seq = quota.open([1], max_new_tokens=QUOTA * BS - 1).seq_id
    with pytest.raises(QuotaExceeded):
        quota.open([2])
    with pytest.raises(QuotaExceeded):
        quota.step(Step(opens=[([2], "")]))
    # Appends into the reservation are not charged twice: the table grows into what was charged.
    quota.append(seq, list(range(QUOTA * BS - 1)))
    quota.step(Step())  # the stream is up before the refusal below
    with pytest.raises(QuotaExceeded):
        quota.step(Step(append=Append([seq], [1], [7])))
    quota.release(seq)
    quota.open([3], max_new_tokens=QUOTA * BS - 1)  # released: the whole quota is back


# -- item 4: every path that adds tokens is charged to the token budget --------------------------------------------


def test_fork_and_append_are_charged_to_the_token_budget_unary(connect: Callable[[str], RadixKVClient]) -> None:
    meter = connect("meter")
    seq = meter.open([1, 2, 3, 4]).seq_id
    children = meter.fork(seq, 8)
    big = 20 * RATE  # the attack pushed 6M tokens a second through forks' appends; one call now leaves ~19 s of debt
    retry_budget(lambda: meter.append(children[0], list(range(big))))
    with pytest.raises(TokenBudget) as refused:
        meter.append(children[1], [1])
    assert refused.value.retry_delay is not None and refused.value.retry_delay > 1.0  # the debt to pay back
    with pytest.raises(TokenBudget):
        meter.append_batch(children[2:4], [1, 1], [5, 6])


def test_fork_and_append_are_charged_to_the_token_budget_in_session_steps(
    connect: Callable[[str], RadixKVClient],
) -> None:
    stepper = connect("stepper")
    # type: ignore[attr-defined]
    opened = retry_budget(lambda: stepper.step(Step(opens=[([1, 2, 3, 4], "")], max_new_tokens=[100]))).opened
    seq = opened[0].seq_id
    # Tokens the open paid for (its max_new_tokens) are not charged again when they come.
    stepper.step(Step(append=Append([seq], [100], list(range(100)))))
    children = stepper.step(Step(forks=[(seq, 4)])).forked[0]
    big = 20 * RATE
    retry_budget(lambda: stepper.step(Step(append=Append([children[0]], [big], list(range(big))))))
    with pytest.raises(TokenBudget):
        stepper.step(Step(append=Append([children[1]], [1], [1])))
    with pytest.raises(TokenBudget):  # past the prepaid 100: charged
        stepper.step(Step(append=Append([seq], [1], [1])))


def test_a_resume_after_a_recompute_preemption_is_charged(connect: Callable[[str], RadixKVClient]) -> None:
    resumer = connect("resumer")
    # 5,000 tokens: the open leaves 4 s of debt, and so does the resume
    seq = retry_budget(lambda: resumer.open(list(range(1, 1 + 5 * RATE)))).seq_id  # type: ignore[attr-defined]
    resumer.preempt([seq], "recompute")
    with pytest.raises(TokenBudget):  # 5,000 tokens handed back to compute: the attack got 100k of them free
        resumer.resume(seq)
    resumed = retry_budget(lambda: resumer.resume(seq))
    assert resumed.num_cached_tokens == 0  # type: ignore[attr-defined]  # nothing was committed: all recomputed
    with pytest.raises(TokenBudget):  # the resume left the bucket in debt
        resumer.open([1])


# -- item 5: the host tier is shared per tenant ---------------------------------------------------------------------


def test_swapped_host_blocks_are_shared_per_tenant(connect: Callable[[str], RadixKVClient]) -> None:
    quota, victim = connect("quota"), connect("victim")
    share = HOST_BLOCKS // NUM_TENANTS
    per_seq = QUOTA - 1  # blocks of each sequence the attacker swaps out (inside its device quota)
    swapped = []
    with pytest.raises(LimitExceeded) as refused:
        for i in range(HOST_BLOCKS // per_seq + 1):  # the attack: 65 of them filled the host tier
            seq = quota.open([i + 1] * (per_seq * BS)).seq_id
            quota.preempt([seq], "swap")
            swapped.append(seq)
    assert refused.value.limit == "host_blocks_per_tenant", refused.value
    assert len(swapped) == share // per_seq
    # The other tenant's swap goes through.
    other = victim.open([7] * (per_seq * BS)).seq_id
    victim.preempt([other], "swap")
    assert victim.resume(other).seq_id == other
    quota.release_many(swapped)  # swapped-out sequences release their host blocks
    assert quota.stats().num_host_blocks_swapped == 0


# -- item 6: Session streams are shared per tenant ------------------------------------------------------------------


def test_session_streams_are_shared_per_tenant(connect: Callable[[str], RadixKVClient]) -> None:
    streamer = connect("streamer")
    streamer.step(Step())  # its one stream, held open and idle
    second = connect("streamer")
    with pytest.raises(LimitExceeded) as refused:
        second.step(Step())
    assert refused.value.limit == "max_session_streams_per_tenant"
    watcher = connect("watcher")
    assert watcher.step(Step()).opened == []  # another tenant's only stream is not refused
