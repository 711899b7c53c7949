"""Live sequences: what each one holds, how far its K/V is written, and the registry that names them.

The computed watermark (`num_computed_tokens`): only full blocks below it are ever cached (by
`cache`, `release(cache=True)` and `fork`), so a later request never hits K/V the worker has not
written. `append` raises it to the tokens before the appended ones; `commit` raises it for the rest
(after a prefill, before caching, forking or releasing a sequence whose last tokens are written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, SequencePreempted, UnknownSequence
from radixkv.memory.block_table import BlockTable
from radixkv.sequences.decode_run import DecodeRun, same_ids
from radixkv.tree.radix_node import Node


@dataclasses.dataclass(slots=True, eq=False)
class LiveSequence:
    seq_id: int
    namespace: str
    # Tokens past the locked path (int32 bytes): all a sequence must keep of its history, since the
    # tree holds the rest. After a fork (which caches first) that is less than one block per child.
    tail_bytes: bytearray
    block_table: BlockTable
    lock_node: Node  # deepest tree node on this sequence's prefix that it keeps locked (root: none)
    num_tree_blocks: int  # leading blocks of the table that the locked path covers
    # Blocks this sequence holds by ref_count: the table past the locked path, plus its own copies of
    # locked-path blocks when the tree already held that prefix in other blocks (duplicates).
    private_prefix: npt.NDArray[np.int32]  # never written in place: replaced when it grows
    num_tokens: int
    # Tokens whose K/V the worker has written (`commit`, or implied by the next `append`): only
    # full blocks below this watermark are ever published to the tree.
    num_computed_tokens: int
    priority: int = 0  # victims go lowest priority first (see `radixkv.pressure.preemption.victims`)
    # The table length its admission reserved growth up to (see `radixkv.pressure.budget`); blocks it appends
    # below this draw on its reservation first. 0: no reservation.
    reserve_until: int = 0

    def private_blocks(self) -> npt.NDArray[np.int32]:
        """The blocks this sequence holds by count (a view or a fresh array: use it at once)."""
        own = self.block_table[self.num_tree_blocks :]
        return np.concatenate((self.private_prefix, own)) if len(self.private_prefix) else own

    def fork_child(self, seq_id: int) -> LiveSequence:
        """A copy sharing every block (the caller adds the child's holds on them) and the priority; it
        reserves nothing, as its growth was never budgeted."""
        return LiveSequence(
            seq_id, self.namespace, bytearray(self.tail_bytes), self.block_table.copy(), self.lock_node,
            self.num_tree_blocks, self.private_prefix, self.num_tokens, self.num_computed_tokens,
            self.priority,
        )  # fmt: skip


@dataclasses.dataclass(slots=True, eq=False)
class PreemptedSequence:
    """A sequence that holds nothing on the device: its tokens, and what `resume` needs to bring it back."""

    seq_id: int
    namespace: str
    token_bytes: bytes  # every token (int32 LE)
    num_computed_tokens: int  # the watermark when preempted (a swap brings that K/V back)
    priority: int
    reserve_until: int
    mode: str  # "swap" or "recompute"
    host: object = None  # swap: what the host tier keeps for it (see `radixkv.pressure.preemption.SwapTier`)

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4


class Sequences:
    """The live sequences by id, and the preempted ones apart; ids are never reused within one run.

    A decode loop's batch may run ahead of its sequences' fields (`decode_run`): every way to a live
    sequence here settles that run first.
    """

    def __init__(self, first_seq_id: int) -> None:
        self._live: dict[int, LiveSequence] = {}
        self.preempted: dict[int, PreemptedSequence] = {}
        self.next_seq_id = first_seq_id  # the id the next sequence gets (a snapshot keeps it)
        # The last batch found, (its ids, its sequences): a decode loop asks for the same batch step after step.
        # Dropped whenever the live set changes.
        self._last_batch: tuple[list[int], list[LiveSequence]] | None = None
        self._run: DecodeRun | None = None  # the decode loop's batch, in columns

    def next_id(self) -> int:
        seq_id = self.next_seq_id
        self.next_seq_id = seq_id + 1
        return seq_id

    def add(self, seq: LiveSequence) -> None:
        self._live[seq.seq_id] = seq
        self._last_batch = None

    def remove(self, seq: LiveSequence) -> None:
        self._settle()
        del self._live[seq.seq_id]
        self._last_batch = None

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveSequence]:
        self._settle()
        return iter(self._live.values())

    def ids(self) -> list[int]:
        return list(self._live)

    def get(self, seq_id: int, field: str = "seq_id") -> LiveSequence:
        """The live sequence `seq_id`, or the error naming `field`."""
        if self._run is not None:
            self._settle()
        seq = self._live.get(seq_id) if isinstance(seq_id, int) else None
        if seq is None:
            if not isinstance(seq_id, int) or isinstance(seq_id, bool):
                raise InvalidArgument(field, f"must be an integer, got {type(seq_id).__name__}")
            if seq_id in self.preempted:
                raise SequencePreempted(seq_id, field)
            raise UnknownSequence(seq_id)
        return seq

    def batch(self, seq_ids: Sequence[int]) -> list[LiveSequence]:
        """The live sequences of a batch, each once, or the error naming the first bad entry."""
        self._settle()
        last = self._last_batch
        if last is not None and same_ids(seq_ids, last[0]):  # and no sequence came or went since
            return list(last[1])
        try:  # a decode step's hundreds of ids: no Python-level loop when all are fine
            found: list[LiveSequence] | None = list(map(self._live.__getitem__, seq_ids))
        except (KeyError, TypeError):  # one is not live (or not hashable)
            found = None
        if found is None or set(map(type, seq_ids)) - {int}:  # 2.0 finds sequence 2 as a key, yet is refused
            for i, seq_id in enumerate(seq_ids):
                self.get(seq_id, f"seq_ids[{i}]")  # raises at the first entry that is not a live sequence's id
        assert found is not None  # an entry not found raised above
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("seq_ids", "a sequence appears twice in one batch")
        self._last_batch = (list(seq_ids), found)
        return list(found)

    def decode_run(self, seq_ids: Sequence[int]) -> DecodeRun:
        """The run of the batch `seq_ids` (the one the last decode step left, or a new one), or the error
        naming its first bad entry."""
        run = self._run
        if run is not None and run.matches(seq_ids):
            return run
        live = self.batch(seq_ids)  # settles the run of another batch
        self._run = run = DecodeRun(list(seq_ids), live)
        return run

    def _settle(self) -> None:
        """Write the decode run back into its sequences and end it (its columns go stale once they are out)."""
        run, self._run = self._run, None
        if run is not None:
            run.settle()

    def for_release(self, seq_ids: Sequence[int]) -> tuple[list[LiveSequence], list[PreemptedSequence]]:
        """The live and the preempted sequences of a release batch (both may be released), each once."""
        live, parked = [], []
        for i, seq_id in enumerate(seq_ids):
            record = self.preempted.get(seq_id) if isinstance(seq_id, int) else None
            if record is None:
                live.append(self.get(seq_id, f"seq_ids[{i}]"))
            else:
                parked.append(record)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("seq_ids", "a sequence appears twice in one batch")
        return live, parked

    def for_commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[LiveSequence]:
        """The sequences `commit(seq_ids, num_tokens)` would move, or the error it would raise."""
        if len(num_tokens) != len(seq_ids):
            raise InvalidArgument(
                "num_tokens", f"needs one entry per seq_ids entry ({len(seq_ids)}), got {len(num_tokens)}"
            )
        sequences = self.batch(seq_ids)
        check_watermarks(sequences, num_tokens)
        return sequences


def path_runs(node: Node) -> list[npt.NDArray[np.int32]]:
    """The block arrays of the tree path ending at `node`, top-down: a locked sequence's table head.

    One entry per node, never a step per block; `np.concatenate` joins them.
    """
    runs = []
    while node.parent is not None:
        runs.append(node.block_ids)
        node = node.parent
    runs.reverse()
    return runs


def check_watermarks(sequences: list[LiveSequence], num_tokens: Sequence[int]) -> None:
    """Raise unless each `num_tokens[i]` is a valid new computed watermark for `sequences[i]`."""
    for i, (seq, n) in enumerate(zip(sequences, num_tokens, strict=True)):
        if not isinstance(n, int | np.integer) or isinstance(n, bool):
            raise InvalidArgument(f"num_tokens[{i}]", f"must be an integer, got {type(n).__name__}")
        if n < seq.num_computed_tokens:
            raise InvalidArgument(
                f"num_tokens[{i}]", f"{n} is below the {seq.num_computed_tokens} tokens already computed"
            )
        if n > seq.num_tokens:
            raise InvalidArgument(f"num_tokens[{i}]", f"{n} is past the sequence's {seq.num_tokens} tokens")
