"""Admission by token budget: a request states `max_new_tokens`, and its growth is reserved when it is admitted.

A sequence admitted with a budget reserves the blocks its table will grow by (`reserve_fraction` of
the blocks `max_new_tokens` needs past the prompt's last block), so its appends never fail for
lack of blocks: the reservation is a count in the `Allocator` that every other allocation must
leave alone. It shrinks as the table grows into it, and what is left returns at release or preempt.

Admitting a budgeted batch needs its uncached prompt blocks, the cached blocks it newly locks and
its reservations to fit in the free and evictable blocks less everyone's reservations and the
watermark (`NotAdmitted` otherwise). The watermark applies only to budgeted requests: a request
that states no budget keeps the older contract (it takes what fits, and its caller handles
`OutOfBlocks`), so pools filled exactly by unbudgeted opens behave as before. Reservations count
against both kinds.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from radixkv.errors import InvalidArgument, LimitExceeded, NotAdmitted
from radixkv.memory.block_pool import cdiv
from radixkv.pressure.limits import Limits
from radixkv.sequences.admission import PlannedOpen, plan_open
from radixkv.sequences.allocation import Allocator
from radixkv.tree.radix_node import Node
from radixkv.tree.token_ids import TokenKey


@dataclasses.dataclass(frozen=True, slots=True)
class Budget:
    """A pool's admission settings: the share of stated growth reserved, and the blocks kept free of admissions."""

    reserve_fraction: float = 1.0  # 1.0: never a preemption; lower overcommits and relies on preemption
    watermark_blocks: int = 0

    @classmethod
    def of(cls, num_blocks: int, reserve_fraction: float, watermark_fraction: float) -> Budget:
        if not 0.0 <= reserve_fraction <= 1.0:
            raise ValueError(f"reserve_fraction must lie in [0, 1], got {reserve_fraction}")
        if not 0.0 <= watermark_fraction < 1.0:
            raise ValueError(f"watermark_fraction must lie in [0, 1), got {watermark_fraction}")
        return cls(reserve_fraction, int(watermark_fraction * num_blocks))  # as vLLM's block manager rounds it

    def reserve_until(self, num_tokens: int, max_new_tokens: int, block_size: int) -> int:
        """The table length a sequence of `num_tokens` admitted with `max_new_tokens` reserves growth up to."""
        if not max_new_tokens:
            return 0
        prompt = cdiv(num_tokens, block_size)
        growth = cdiv(num_tokens + max_new_tokens, block_size) - prompt
        return prompt + math.ceil(round(self.reserve_fraction * growth, 9))  # 0.07 * 100 reserves 7, not 8

    def admit(self, blocks: Allocator, needed: int, newly_locked: int, reserved: int, budgeted: bool) -> None:
        """Raise unless `needed` new blocks, `newly_locked` cached ones and `reserved` growth fit (see the module)."""
        if budgeted:
            available = blocks.num_available() - blocks.num_reserved - self.watermark_blocks
            if needed + newly_locked + reserved > available:
                blocks.stats.num_admission_refusals += 1
                raise NotAdmitted(needed + newly_locked + reserved, max(0, available))
        else:
            blocks.refuse_unless(needed, max(0, blocks.num_available() - blocks.num_reserved - newly_locked))


def budget_args(
    num_requests: int,
    max_new_tokens: Sequence[int] | None,
    priorities: Sequence[int] | None,
    num_tokens: Sequence[int],
    max_tokens: int,
) -> tuple[list[int], list[int]]:
    """`open_many`'s per-request budgets and priorities checked (one entry per request; None: all 0)."""
    columns = []
    for name, column in (("max_new_tokens", max_new_tokens), ("priorities", priorities)):
        if column is None:
            columns.append([0] * num_requests)
            continue
        if len(column) != num_requests:
            raise InvalidArgument(name, f"needs one entry per request ({num_requests}), got {len(column)}")
        for i, value in enumerate(column):
            if type(value) is not int and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise InvalidArgument(f"{name}[{i}]", f"must be an integer, got {type(value).__name__}")
        columns.append([int(v) for v in column])
    budgets, ranks = columns
    if max_new_tokens is None:
        return budgets, ranks
    for i, (n, budget) in enumerate(zip(num_tokens, budgets, strict=True)):
        if budget < 0:
            raise InvalidArgument(f"max_new_tokens[{i}]", f"must be >= 0, got {budget}")
        if n + budget > max_tokens:
            raise LimitExceeded("max_tokens_per_request", n + budget, max_tokens)
    return budgets, ranks


def plan_admission(
    blocks: Allocator, budget: Budget, limits: Limits, keys: list[tuple[TokenKey, Node]],
    max_new_tokens: Sequence[int] | None, priorities: Sequence[int] | None,
) -> tuple[list[PlannedOpen], list[tuple[int, int]], int]:  # fmt: skip
    """Match a batch of opens (each prompt under its namespace's root) and admit it before anything changes.

    Returns the plan, each item's (priority, reserve_until), and what it takes from the unreserved blocks
    (allocated, newly locked, reserved). Raises as `KVCache.open_many` does.
    """
    reserved, ranks, budgeted = 0, [(0, 0)] * len(keys), False  # (priority, reserve_until): plain opens' fast path
    if max_new_tokens is not None or priorities is not None:
        bs, num_tokens = blocks.tree.block_size, [key.num_tokens for key, _ in keys]
        limit = limits.max_tokens_per_request
        budgets, priority = budget_args(len(keys), max_new_tokens, priorities, num_tokens, limit)
        until = [budget.reserve_until(n, m, bs) for n, m in zip(num_tokens, budgets, strict=True)]
        reserved = sum(max(0, u - cdiv(n, bs)) for n, u in zip(num_tokens, until, strict=True))
        ranks, budgeted = list(zip(priority, until, strict=True)), any(budgets)
    planned, needed, newly_locked = plan_open(blocks.tree, keys)
    budget.admit(blocks, needed, newly_locked, reserved, budgeted)
    return planned, ranks, needed + newly_locked + reserved
