"""Per-tenant token budgets: a token bucket each open pays `prompt + max_new_tokens` from.

Admission by blocks (the core's NOT_ADMITTED) bounds what fits now; the token budget bounds how
fast one tenant may ask, as serving guides budget by tokens rather than requests per second. A
tenant with `max_tokens_per_second` R has a bucket of R tokens (one second's worth) refilled at R
per second. An open of n tokens needs min(n, R) in the bucket and takes n: an open larger than
one second's worth is admitted from a full bucket and leaves it in debt, so it is possible but
the tenant then waits. A refusal says when the bucket will hold enough (`TokenBudget.retry_after_ms`,
sent as a google.rpc.RetryInfo).

`take` and `refund` are atomic under the buckets' own lock, a leaf: the pools' opens call them under
their pool's lock, and one tenant's bucket serves every pool.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from radixkv.errors import TokenBudget
from radixkv.server.tenants import Tenant


class TokenBuckets:
    """Every tenant's bucket: (tokens, when last refilled), created full on first use."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, tenant: Tenant, num_tokens: int) -> None:
        """Charge `num_tokens` to the tenant's bucket, or raise TokenBudget and charge nothing."""
        rate = tenant.max_tokens_per_second
        if rate is None or num_tokens <= 0:
            return
        with self._lock:
            level = self._level(tenant.name, rate)
            needed = min(num_tokens, rate)
            if level < needed:
                retry_after_ms = max(1, math.ceil((needed - level) / rate * 1000))
                raise TokenBudget(tenant.name, num_tokens, retry_after_ms)
            self._buckets[tenant.name] = (level - num_tokens, self._clock())

    def refund(self, tenant: Tenant, num_tokens: int) -> None:
        """Give back what `take` charged for an open that was refused after it (nothing was opened)."""
        rate = tenant.max_tokens_per_second
        if rate is None or num_tokens <= 0:
            return
        with self._lock:
            self._buckets[tenant.name] = (min(rate, self._level(tenant.name, rate) + num_tokens), self._clock())

    def level(self, tenant: Tenant) -> float | None:
        """Tokens in the tenant's bucket now (None: no budget); for tests and operators."""
        rate = tenant.max_tokens_per_second
        if rate is None:
            return None
        with self._lock:
            return self._level(tenant.name, rate)

    def _level(self, name: str, rate: float) -> float:
        level, since = self._buckets.get(name, (rate, self._clock()))
        return min(rate, level + (self._clock() - since) * rate)
