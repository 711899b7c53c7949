"""The token bucket on a fake clock, the admission keys of pools and tenants, and the client's budget columns."""

from __future__ import annotations

import pytest

from radixkv.client import messages as m
from radixkv.errors import InvalidArgument, TokenBudget
from radixkv.server.config import TenantConfig, config_from_mapping, parse_pool_flag
from radixkv.server.tenants import Tenant
from radixkv.server.token_budget import TokenBuckets

LAYOUT = "num_layers=1,num_kv_heads=1,head_dim=4,num_blocks=64"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(rate: float | None) -> Tenant:
    return Tenant.from_config(TenantConfig("t", "tok", max_tokens_per_second=rate))


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
    a = Tenant.from_config(TenantConfig("a", "ta", max_tokens_per_second=10))
    b = Tenant.from_config(TenantConfig("b", "tb", max_tokens_per_second=10))
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
            TenantConfig("acme", "x", max_tokens_per_second=bad)  # type: ignore[arg-type]


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
