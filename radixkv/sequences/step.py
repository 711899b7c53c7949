"""A scheduler step as one request: its items (a commit, opens, an append, forks, caches, releases) and results.

The records the Session stream carries, shared by the server (which applies a step all or none,
items in this order) and the clients (`step(...)`). Items refer to sequences live before the step;
what the step opens or forks comes back in its `StepResult`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from radixkv.memory.block_pairs import NO_PAIRS, Pairs
from radixkv.sequences.results import AppendBatch, OpenResult
from radixkv.tree.radix_tree import TokenIds


@dataclasses.dataclass(frozen=True, slots=True)
class Append:
    """One decode step in columns, as `append_batch` takes it: sequence i appends the next `num_token_ids[i]` tokens."""

    seq_ids: Sequence[int]
    num_token_ids: Sequence[int]
    token_ids: TokenIds


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    """Computed watermarks in columns, as `commit` takes them: `seq_ids[i]`'s first `num_tokens[i]` tokens
    are written."""

    seq_ids: Sequence[int]
    num_tokens: Sequence[int]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """What one step asks for, applied in this order: commit, opens, append, forks, caches, releases.

    `commit`: what the worker wrote in the step before, so that this step's caches, forks and cached
    releases publish it; `opens`: (token_ids, namespace) prompts, with `max_new_tokens[i]` and
    `priorities[i]` as `KVCache.open_many` takes them (empty: none), and `explain[i]`: also say why
    prompt i's cached prefix ends where it does, as `open(..., explain=True)` does (empty: none);
    `forks`: (seq_id, num_children); `caches`: seq ids; `releases`: (seq_ids, cache) batches.
    """

    opens: Sequence[tuple[TokenIds, str]] = ()
    append: Append | None = None
    forks: Sequence[tuple[int, int]] = ()
    caches: Sequence[int] = ()
    releases: Sequence[tuple[Sequence[int], bool]] = ()
    commit: Commit | None = None
    max_new_tokens: Sequence[int] = ()
    priorities: Sequence[int] = ()
    explain: Sequence[bool] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """Per kind of item, in request order: `forked[i]` is forks[i]'s children, `num_cached_tokens[i]` caches[i]'s.

    `explanations`: when the step asked to explain any open, one per open (None where it did not ask):
    `radixkv.client.MatchExplanation` on the client, the server's `MissExplanation` inside it.
    `offloads` and `loads` are the whole step's host-tier transfers (its opens' and append's, in order: over the
    wire they come only here): before running the step the worker applies the offloads, then
    `appended.copies`, then the loads (see `radixkv.tree.host_tier`).
    """

    opened: list[OpenResult]
    appended: AppendBatch | None
    forked: list[list[int]]
    num_cached_tokens: list[int]
    num_released_sequences: int
    explanations: Sequence[Any] = ()
    offloads: Pairs = dataclasses.field(default_factory=lambda: NO_PAIRS)  # int64 [n, 2] (device, host)
    loads: Pairs = dataclasses.field(default_factory=lambda: NO_PAIRS)  # int64 [n, 2] (host, device)
