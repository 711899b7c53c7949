"""The token bucket on a fake clock, what each call pays (in process, unary and step), the admission keys of pools
and tenants, and the client's budget columns."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from radixkv.client.session import messages as m
from radixkv.errors import InvalidArgument, TokenBudget, UnknownSequence
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.rules.checks import Reply
from radixkv.server.rules.config import ServerConfig, TenantConfig, config_from_mapping, parse_pool_flag
from radixkv.server.rules.service import KVService, run_step
from radixkv.server.rules.sessions import Session
from radixkv.server.rules.tenants import Tenant, TokenBuckets

LAYOUT = "num_layers=1,num_kv_heads=1,head_dim=4,num_blocks=64"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(rate: float | None) -> Tenant:
    return Tenant.from_config(TenantConfig(name="t", token="tok", max_tokens_per_second=rate))


def test_the_bucket_refills_at_its_rate_and_says_when_to_retry() -> None:
    clock = Clock()
    buckets, t = TokenBuckets(clock), tenant(100)
    buckets.take(t, 70)
    assert buckets.level(t) == 30
    with pytest.raises(TokenBudget) as refused:
        buckets.take(t, 50)
    assert (refused.value.num_tokens, refused.value.retry_after_ms) == (50, 200)  # 20 short at 100/s
    assert refused.value.retry_delay == 0.2
    assert buckets.level(t) == 30, "a refusal charges nothing"
    clock.now += 0.2
    buckets.take(t, 50)
    assert buckets.level(t) == pytest.approx(0)
    clock.now += 10
    assert buckets.level(t) == 100, "the bucket holds one second of tokens at most"


def test_an_open_larger_than_the_bucket_needs_a_full_one_and_leaves_debt() -> None:
    clock = Clock()
    buckets, t = TokenBuckets(clock), tenant(100)
    buckets.take(t, 1)
    with pytest.raises(TokenBudget) as refused:
        buckets.take(t, 250)
    assert refused.value.retry_after_ms == 10  # 1 token short of a full bucket
    clock.now += 0.01
    buckets.take(t, 250)
    assert buckets.level(t) == pytest.approx(-150)
    with pytest.raises(TokenBudget) as refused:
        buckets.take(t, 1)
    assert refused.value.retry_after_ms == 1510  # 151 tokens to refill


def test_a_refund_restores_what_a_refused_open_paid_but_never_past_full() -> None:
    clock = Clock()
    buckets, t = TokenBuckets(clock), tenant(100)
    buckets.take(t, 80)
    buckets.refund(t, 80)
    assert buckets.level(t) == 100
    buckets.refund(t, 80)
    assert buckets.level(t) == 100


def test_a_tenant_without_a_budget_is_never_refused() -> None:
    buckets, t = TokenBuckets(Clock()), tenant(None)
    buckets.take(t, 10**9)
    assert buckets.level(t) is None


def test_tenants_have_separate_buckets() -> None:
    buckets = TokenBuckets(Clock())
    a = Tenant.from_config(TenantConfig(name="a", token="ta", max_tokens_per_second=10))
    b = Tenant.from_config(TenantConfig(name="b", token="tb", max_tokens_per_second=10))
    buckets.take(a, 10)
    buckets.take(b, 10)
    with pytest.raises(TokenBudget):
        buckets.take(a, 1)


def test_pool_keys_set_the_admission_budget() -> None:
    pool = parse_pool_flag(f"p:{LAYOUT},reserve_fraction=0.5,watermark_fraction=0.05")
    assert (pool.reserve_fraction, pool.watermark_fraction) == (0.5, 0.05)
    assert (parse_pool_flag(f"q:{LAYOUT}").reserve_fraction, parse_pool_flag(f"q:{LAYOUT}").watermark_fraction) == (
        1.0,
        0.01,
    )
    for bad in ("reserve_fraction=1.5", "reserve_fraction=-1", "watermark_fraction=1"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            parse_pool_flag(f"p:{LAYOUT},{bad}")


def test_the_auth_file_sets_max_tokens_per_second() -> None:
    config = config_from_mapping(
        {
            "pools": {"default": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "num_blocks": 8}},
            "tenants": {"acme": {"token": "x", "max_tokens_per_second": 2500}},
        }
    )
    assert Tenant.from_config(config.tenants[0]).max_tokens_per_second == 2500
    for bad in (0, -5, "fast", True):
        with pytest.raises(ValueError, match="max_tokens_per_second"):
            TenantConfig(name="acme", token="x", max_tokens_per_second=bad)  # type: ignore[arg-type]


def test_the_client_checks_its_budget_columns_before_sending() -> None:
    prompts = [([1, 2], "a"), ([3], "b")]
    request = m.open_request("p", "s", prompts, [5, 0], [1, -2])
    assert [(p.max_new_tokens, p.priority) for p in request.prompts] == [(5, 1), (0, -2)]
    with pytest.raises(InvalidArgument) as refused:
        m.open_request("p", "s", prompts, [5])
    assert refused.value.field == "max_new_tokens"
    with pytest.raises(InvalidArgument) as refused:
        m.open_request("p", "s", prompts, [5, -1])
    assert refused.value.field == "prompts[1].max_new_tokens"
    with pytest.raises(InvalidArgument) as refused:
        m.preempt_request("p", "s", [1], "evict")
    assert refused.value.field == "mode"


def _step(service: KVService, session: Session, step: Step) -> StepResult:
    """As a Session stream runs a step."""
    return run_step(
        service.checks, service.pool("default", session.tenant), session, step, Reply(service.max_message_bytes)
    )


@pytest.fixture
def metered() -> Iterator[tuple[KVService, Clock, Tenant, str]]:
    """A service whose buckets run on a fake clock, a tenant of 100 tokens a second, and a session of its."""
    config = ServerConfig(pools=(parse_pool_flag(f"default:{LAYOUT},block_size=4"),))
    service = KVService(config, {p.name: build_pool(p, config.watch_queue_size, None) for p in config.pools})
    clock = Clock()
    service.checks.token_buckets = TokenBuckets(clock)
    t = tenant(100)
    try:
        yield service, clock, t, service.open_session(t, 60.0).session_id
    finally:
        service.close()


@pytest.mark.parametrize("stepped", [False, True], ids=["unary", "step"])
def test_appends_pay_past_what_the_open_prepaid_and_a_forks_children_pay_all(
    metered: tuple[KVService, Clock, Tenant, str], stepped: bool
) -> None:
    service, _, t, session_id = metered
    session = service.sessions.get(session_id, t)

    def append(seq_id: int, n: int) -> None:
        if stepped:
            _step(service, session, Step(append=Append([seq_id], [n], [1] * n)))
        else:
            service.step(t, session_id, "default", Step(append=Append([seq_id], [n], [1] * n)))

    if stepped:
        seq_id = _step(service, session, Step(opens=[([1] * 4, "")], max_new_tokens=[10])).opened[0]
        seq_id = seq_id.seq_id
    else:
        seq_id = (
            service.step(t, session_id, "default", Step(opens=[([1] * 4, "")], max_new_tokens=[10])).opened[0].seq_id
        )
    assert service.checks.token_buckets.level(t) == 86  # the prompt and its max_new_tokens
    append(seq_id, 6)
    append(seq_id, 4)
    assert service.checks.token_buckets.level(t) == 86, "the tokens the open paid for are not charged again"
    append(seq_id, 5)
    assert service.checks.token_buckets.level(t) == 81, "past them, each token is"
    if stepped:
        (child,) = _step(service, session, Step(forks=[(seq_id, 1)])).forked[0]
    else:
        (child,) = service.step(t, session_id, "default", Step(forks=[(seq_id, 1)])).forked[0]
    assert service.checks.token_buckets.level(t) == 81  # a fork adds no token
    append(child, 3)
    assert service.checks.token_buckets.level(t) == 78, "a child prepaid nothing"
    with pytest.raises(TokenBudget):
        append(child, 79)
    assert service.checks.token_buckets.level(t) == 78, "a refused append charges nothing"
    with pytest.raises(UnknownSequence):
        append(child + 1000, 1)
    assert service.checks.token_buckets.level(t) == 78, "nor does one the core refuses"


def test_a_resume_pays_for_the_tokens_it_hands_back_to_compute(metered: tuple[KVService, Clock, Tenant, str]) -> None:
    service, clock, t, session_id = metered
    (opened,) = service.step(t, session_id, "default", Step(opens=[(list(range(1, 81)), "")])).opened
    service.step(
        t, session_id, "default", Step(commit=Commit([opened.seq_id], [72]))
    )  # 18 blocks written: cached at the preemption
    service.preempt(t, session_id, "default", [opened.seq_id], "recompute")
    assert service.checks.token_buckets.level(t) == 20
    with pytest.raises(TokenBudget) as refused:  # it needs what an open of its 80 tokens would need
        service.resume(t, session_id, "default", opened.seq_id)
    assert refused.value.num_tokens == 80
    clock.now += 0.7  # 90 in the bucket
    resumed = service.resume(t, session_id, "default", opened.seq_id)
    assert resumed.num_cached_tokens == 72
    assert service.checks.token_buckets.level(t) == pytest.approx(90 - 8), "charged only the 8 tokens to recompute"
