"""What the server keeps beside the core for one pool: whose each sequence is, what each tenant holds,
each session's pins.

The core knows blocks and sequences; it does not know sessions or tenants. `PoolLedger` is the one
place that does, for one pool: the session owning each sequence, what each sequence is charged to
its tenant and each tenant's total (device blocks: the block quota; host blocks: its share of the host
tier), the tokens each sequence's open prepaid (the token budget, `tenants.Prepaid`), and each
session's pins with the blocks they charge. A sequence's lengths, reservation and host blocks are the
core's facts, read from it (`KVCache.num_table_blocks`, `reserve_until`, `swap_blocks`); a charge is
the ledger's own, kept to be undone when the core has forgotten the sequence. The ledger is read and
changed only under the pool's lock, and only after the core call it follows succeeded, so it always
agrees with the core; `check_invariants` recounts the charges from the core and proves it.

A live sequence charges its block table or, while it is longer, the table length its admission
reserved growth up to (`device_charge`): reserved blocks are kept from everyone else as surely as
allocated ones, so a `max_new_tokens` cannot take the pool past the quota. A preempted sequence
charges no device block; swapped out, it charges its host blocks instead.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixkv.errors import LimitExceeded, NotPinned, QuotaExceeded, UnknownSequence
from radixkv.sequences.admission import budget_args
from radixkv.server.rules.tenants import Prepaid

if TYPE_CHECKING:
    from radixkv.kv_cache import KVCache
    from radixkv.sequences.results import AppendBatch, OpenResult
    from radixkv.server.rules.sessions import Session
    from radixkv.server.rules.tenants import Tenant


_NONE: frozenset[int] = frozenset()


def device_charge(cache: KVCache, seq_id: int) -> int:
    """The device blocks live sequence `seq_id` charges its tenant: its table or its reservation, whichever is more."""
    return max(cache.num_table_blocks(seq_id), cache.reserve_until(seq_id))


@dataclasses.dataclass(frozen=True, slots=True)
class Pin:
    """One Pin call's hold: the core namespace, the pinned tokens (int32 bytes), the blocks it charges its tenant."""

    namespace: str
    token_bytes: bytes
    num_blocks: int


class PoolLedger:
    """Ownership and quota for one pool: sequences by session, blocks by tenant, pins by session.

    A tenant's blocks are the block tables (or reservations) of its live sequences plus the prefixes its
    sessions pin: a pin keeps blocks resident as surely as a sequence does, so it counts against the same quota.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._owners: dict[int, Session] = {}
        self._charged: dict[int, int] = {}  # live seq_id -> device blocks charged to its tenant (`device_charge`)
        self._host_charged: dict[int, int] = {}  # swapped-out seq_id -> host blocks charged to its tenant (> 0 only)
        self.prepaid = Prepaid()
        self._sequences: dict[Session, set[int]] = {}
        self._pins: dict[Session, list[Pin]] = {}
        self._tenant_blocks: dict[str, int] = {}
        self._tenant_sequences: dict[str, int] = {}
        self._tenant_pinned: dict[str, int] = {}
        self._tenant_host_blocks: dict[str, int] = {}

    # -- reading ----------------------------------------------------------------------------------

    def owner(self, seq_id: int) -> Session | None:
        return self._owners.get(seq_id)

    def check_owner(self, session: Session, seq_id: int, field: str = "seq_id") -> None:
        """Raises UnknownSequence for a sequence that is absent *or another session's*: the two answers are the
        same, so probing ids tells a caller nothing about other sessions' sequences."""
        if self._owners.get(seq_id) is not session:
            raise UnknownSequence(seq_id)

    def check_owners(self, session: Session, seq_ids: Sequence[int], field: str = "seq_ids") -> None:
        # A decode step: checked fast, in one C loop of set lookups (5 us for 256 ids, a quarter of a loop calling
        # a function per id); the culprit named slowly.
        if not self._sequences.get(session, _NONE).issuperset(seq_ids):
            for i, seq_id in enumerate(seq_ids):
                self.check_owner(session, seq_id, f"{field}[{i}]")

    def sequences_of(self, session: Session) -> list[int]:
        return sorted(self._sequences.get(session, ()))

    def num_sequences(self, session: Session) -> int:
        return len(self._sequences.get(session, ()))

    def num_tenant_sequences(self, tenant: Tenant) -> int:
        return self._tenant_sequences.get(tenant.name, 0)

    def tenant_blocks(self, tenant: Tenant) -> int:
        return self._tenant_blocks.get(tenant.name, 0)

    def num_sequences_total(self) -> int:
        return len(self._owners)

    def tenant_host_blocks(self, tenant: Tenant) -> int:
        return self._tenant_host_blocks.get(tenant.name, 0)

    def tenant_pinned_blocks(self, tenant: Tenant) -> int:
        return self._tenant_pinned.get(tenant.name, 0)

    def pins(self, session: Session) -> list[Pin]:
        return list(self._pins.get(session, ()))

    def check_quota(self, tenant: Tenant, needed: int) -> None:
        """Raises QuotaExceeded when `needed` more blocks would take the tenant past its quota."""
        if tenant.max_blocks is None:
            return
        held = self._tenant_blocks.get(tenant.name, 0)
        if held + needed > tenant.max_blocks:
            raise QuotaExceeded(tenant.name, needed, max(0, tenant.max_blocks - held))

    def check_host_blocks(self, tenant: Tenant, needed: int, share: int | None) -> None:
        """Raises LimitExceeded when `needed` more host blocks would take the tenant past its `share` of the host
        tier (None: no share, one tenant)."""
        held = self._tenant_host_blocks.get(tenant.name, 0)
        if share is not None and needed and held + needed > share:
            raise LimitExceeded("host_blocks_per_tenant", held + needed, share)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_open(self, cache: KVCache, num_tokens: Sequence[int], max_new_tokens: Sequence[int] | None) -> int:
        """Blocks opening prompts of `num_tokens` with these budgets charges: each prompt's blocks or its reserved
        table length, whichever is more. Raises what the core's open would for malformed budgets."""
        blocks = sum(map(self.blocks_for, num_tokens))
        if not max_new_tokens:
            return blocks
        budgets, _ = budget_args(len(num_tokens), max_new_tokens, None, num_tokens, cache.limits.max_tokens_per_request)
        for n, m in zip(num_tokens, budgets, strict=True):
            if m:
                blocks += max(0, cache.budget.reserve_until(n, m, self.block_size) - self.blocks_for(n))
        return blocks

    def append_growth(
        self, cache: KVCache, seq_ids: Sequence[int], counts: Sequence[int], tables: dict[int, int] | None = None
    ) -> int:
        """Blocks appending `counts[i]` tokens to each `seq_ids[i]` adds to their tenant's charge: the table growth
        past what each charges already (its reservation included). `tables` receives each table's length after."""
        growth = 0
        charged = self._charged
        for seq_id, count in zip(seq_ids, counts, strict=False):
            after = self.blocks_for(cache.num_tokens(seq_id) + count)
            growth += max(0, after - charged.get(seq_id, 0))
            if tables is not None:
                tables[seq_id] = after  # a table is as long as its tokens need (the core's invariant)
        return growth

    def blocks_to_resume(self, cache: KVCache, seq_id: int) -> int:
        """Blocks resuming a preempted sequence charges again: its table or its reservation, whichever is more."""
        return max(self.blocks_for(cache.num_tokens(seq_id)), cache.reserve_until(seq_id))

    # -- changing (after the core call succeeded) --------------------------------------------------

    def adopt(self, session: Session, cache: KVCache, seq_id: int, prepaid: int = 0) -> None:
        """A sequence the core holds (opened, a fork's child, or a previous server's adopted from its snapshot, live or
        preempted) becomes `session`'s, charged what it holds, with `prepaid` tokens."""
        tenant = session.tenant.name
        self._owners[seq_id] = session
        self._sequences.setdefault(session, set()).add(seq_id)
        if cache.is_preempted(seq_id):
            self._charge_host(tenant, seq_id, cache.swap_blocks(seq_id))
        else:
            self._charge_device(tenant, seq_id, device_charge(cache, seq_id))
        self.prepaid.grant(seq_id, prepaid)
        self._tenant_sequences[tenant] = self._tenant_sequences.get(tenant, 0) + 1

    def adopt_opened(
        self, session: Session, cache: KVCache, opened: Sequence[OpenResult], max_new_tokens: Sequence[int] | None
    ) -> None:
        """After opens applied: each sequence is `session`'s, its `max_new_tokens` prepaid where its tenant has a
        token budget."""
        budgeted = bool(max_new_tokens) and session.tenant.max_tokens_per_second is not None
        for i, result in enumerate(opened):
            prepaid = int(max_new_tokens[i]) if budgeted and max_new_tokens is not None else 0
            self.adopt(session, cache, result.seq_id, prepaid)

    def preempted(self, cache: KVCache, seq_id: int) -> None:
        """After a preempt: the sequence charges no device block (nor reservation); swapped out, its host blocks."""
        tenant = self._owners[seq_id].tenant.name
        self._charge(tenant, -self._charged.pop(seq_id))
        self._charge_host(tenant, seq_id, cache.swap_blocks(seq_id))

    def resumed(self, cache: KVCache, seq_id: int) -> None:
        """After a resume: back on the device, charging its table (or its reservation, taken again), no host block."""
        tenant = self._owners[seq_id].tenant.name
        self._uncharge_host(tenant, seq_id)
        self._charge_device(tenant, seq_id, device_charge(cache, seq_id))

    def _charge_device(self, tenant: str, seq_id: int, num_blocks: int) -> None:
        self._charged[seq_id] = num_blocks
        self._charge(tenant, num_blocks)

    def _charge_host(self, tenant: str, seq_id: int, host_blocks: int) -> None:
        if host_blocks:
            self._host_charged[seq_id] = host_blocks
            self._tenant_host_blocks[tenant] = self._tenant_host_blocks.get(tenant, 0) + host_blocks

    def _uncharge_host(self, tenant: str, seq_id: int) -> None:
        host_blocks = self._host_charged.pop(seq_id, 0)
        if host_blocks:
            self._tenant_host_blocks[tenant] -= host_blocks
            if not self._tenant_host_blocks[tenant]:
                del self._tenant_host_blocks[tenant]

    def follow_append(self, session: Session, batch: AppendBatch) -> None:
        """After an append of `session`'s sequences: sequence i's table is now `table_offsets[i] + num_block_ids[i]`
        blocks long, and it spent `num_appended[i]` of its prepaid tokens.

        Only a sequence that got blocks changed length (one in `block_size` per decode step), so only those are visited.
        A table only grows while its reservation stays put, so its charge is the longer of its charge and its length.
        """
        seq_ids, num_block_ids = batch.seq_ids, batch.num_block_ids
        if session.tenant.max_tokens_per_second is not None:  # only a budgeted tenant's sequences prepaid anything
            self.prepaid.draw(seq_ids, batch.num_appended)
        if not any(num_block_ids):  # no table grew (most decode steps of a batch that started aligned)
            return
        charged, offsets = self._charged, batch.table_offsets
        growth = 0  # charged once, not once per sequence
        for i in itertools.compress(range(len(num_block_ids)), num_block_ids):
            seq_id, length = seq_ids[i], offsets[i] + num_block_ids[i]
            if length > charged[seq_id]:  # past its reservation (or its table before, without one)
                growth += length - charged[seq_id]
                charged[seq_id] = length
        if growth:
            self._charge(session.tenant.name, growth)

    def forget(self, seq_id: int) -> None:
        session = self._owners.pop(seq_id)
        tenant = session.tenant.name
        held = self._sequences[session]
        held.discard(seq_id)
        if not held:
            del self._sequences[session]
        self._charge(tenant, -self._charged.pop(seq_id, 0))
        self._uncharge_host(tenant, seq_id)
        self.prepaid.forget(seq_id)
        self._tenant_sequences[tenant] -= 1
        if not self._tenant_sequences[tenant]:
            del self._tenant_sequences[tenant]

    def add_pin(self, session: Session, pin: Pin) -> None:
        self._pins.setdefault(session, []).append(pin)
        self._charge(session.tenant.name, pin.num_blocks, pinned=True)

    def take_pin(self, session: Session, namespace: str, token_bytes: bytes) -> Pin:
        """Remove and return the session's longest pin on a prefix of `token_bytes`.

        Raises:
            NotPinned: the session holds no such pin.
        """
        held = [
            p for p in self._pins.get(session, ()) if p.namespace == namespace and token_bytes.startswith(p.token_bytes)
        ]
        if not held:
            raise NotPinned(session.tenant.unscope(namespace))
        pin = max(held, key=lambda p: len(p.token_bytes))
        self._pins[session].remove(pin)
        if not self._pins[session]:
            del self._pins[session]
        self._charge(session.tenant.name, -pin.num_blocks, pinned=True)
        return pin

    def take_session(self, session: Session) -> tuple[list[int], list[Pin]]:
        """Everything `session` holds in this pool, forgotten here: (its sequence ids, its pins) for the core
        to drop."""
        seq_ids = sorted(self._sequences.get(session, ()))
        for seq_id in seq_ids:
            self.forget(seq_id)
        pins = self._pins.pop(session, [])
        for pin in pins:
            self._charge(session.tenant.name, -pin.num_blocks, pinned=True)
        return seq_ids, pins

    def _charge(self, tenant: str, num_blocks: int, pinned: bool = False) -> None:
        for counts in (self._tenant_blocks, self._tenant_pinned) if pinned else (self._tenant_blocks,):
            total = counts.get(tenant, 0) + num_blocks
            if total:
                counts[tenant] = total
            else:
                counts.pop(tenant, None)

    # -- checking ----------------------------------------------------------------------------------

    def check_invariants(self, cache: KVCache) -> None:
        """Recount each sequence's charges and each tenant's totals from the core; raises AssertionError naming what
        broke."""
        live, preempted = set(cache.sequence_ids()), set(cache.preempted_sequence_ids())
        assert set(self._owners) == live | preempted, "owned sequences != the core's live and preempted sequences"
        assert set(self._charged) == live, "device charges != the core's live sequences"
        assert set(self._host_charged) <= preempted, "a host charge without its swapped-out sequence"
        blocks: dict[str, int] = {}
        host_blocks: dict[str, int] = {}
        sequences: dict[str, int] = {}
        for seq_id, session in self._owners.items():
            assert seq_id in self._sequences.get(session, ()), f"sequence {seq_id} missing from its session"
            name = session.tenant.name
            if seq_id in preempted:
                held = cache.swap_blocks(seq_id)
                charged = self._host_charged.get(seq_id, 0)
                assert charged == held, f"sequence {seq_id}: charged {charged} host blocks, holds {held}"
                host_blocks[name] = host_blocks.get(name, 0) + held
            else:
                held = device_charge(cache, seq_id)
                charged = self._charged[seq_id]
                assert charged == held, f"sequence {seq_id}: charged {charged} blocks, holds (or reserved) {held}"
                blocks[name] = blocks.get(name, 0) + held
            sequences[name] = sequences.get(name, 0) + 1
        for session, seq_ids in self._sequences.items():
            assert seq_ids, "a session kept with no sequences"
            for seq_id in seq_ids:
                assert self._owners.get(seq_id) is session, f"session holds sequence {seq_id} it does not own"
        pinned: dict[str, int] = {}
        for session, pins in self._pins.items():
            assert pins, "a session kept with no pins"
            name = session.tenant.name
            pinned[name] = pinned.get(name, 0) + sum(p.num_blocks for p in pins)
            blocks[name] = blocks.get(name, 0) + sum(p.num_blocks for p in pins)
        assert self._tenant_pinned == {n: b for n, b in pinned.items() if b}, "tenant pinned-block counts stale"
        blocks = {name: n for name, n in blocks.items() if n}
        assert self._tenant_blocks == blocks, f"tenant block counts {self._tenant_blocks} != recounted {blocks}"
        assert self._tenant_sequences == sequences, f"tenant sequence counts {self._tenant_sequences} != {sequences}"
        host_blocks = {name: n for name, n in host_blocks.items() if n}
        assert self._tenant_host_blocks == host_blocks, (
            f"tenant host blocks {self._tenant_host_blocks} != {host_blocks}"
        )
