"""A continuous-batching loop over radixkv, the worker in its own process: the README's example, run by CI.

The orchestrator (this process) schedules through `RadixKVClient` alone. The worker (a child process)
maps the pool with `PoolView(PoolInfo)` and applies what each step hands it (`StepArrays`) with the
kernels. The model is a stand-in whose K/V at position p is a fixed function of tokens[:p + 1], as a
real model's is, so the worker checks every attention it computes against a dense recomputation: a
block served from the cache whose K/V was never written fails that check.

Run it: `python -m radixkv.demo.continuous_batching` (starts its own server).
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
from multiprocessing.connection import Connection

import numpy as np

from radixkv.client import PoolInfo, PoolView, RadixKVClient
from radixkv.errors import OutOfBlocks
from radixkv.memory.layout import PoolLayout
from radixkv.sequences.handoff import StepArrays

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=32, dtype="float32")
NUM_Q_HEADS, VOCAB = 4, 1000
SYSTEM_PROMPT = list(range(1, 17))  # 4 blocks every request shares


@dataclasses.dataclass(kw_only=True)
class Request:
    name: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    seq_id: int | None = None  # while admitted
    num_cached_tokens: int = 0  # what its (last) admission hit

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output


@dataclasses.dataclass(kw_only=True)
class Report:
    num_steps: int = 0
    num_preempted: int = 0
    max_attention_error: float = 0.0
    hits: dict[str, int] = dataclasses.field(default_factory=dict)  # request -> tokens its first admission hit
    finished: list[str] = dataclasses.field(default_factory=list)  # in the order they finished


def sample(token_ids: list[int]) -> int:
    """The stand-in sampler: deterministic, so runs compare."""
    return (token_ids[-1] * 31 + len(token_ids)) % VOCAB


# -- the worker process -------------------------------------------------------------------------------


def worker_main(conn: Connection, info: PoolInfo) -> None:
    """Map the server's pool (`PoolView(PoolInfo)`), then run each step sent until told to stop."""
    pool = PoolView(info)
    while (message := conn.recv()) is not None:
        histories, arrays = message
        conn.send(run_step(pool, histories, arrays))
    pool.close()


def run_step(pool: PoolView, histories: list[list[int]], arrays: StepArrays) -> float:
    """Copies, then every layer's K/V into the slots, then attention checked; returns the largest error."""
    import torch

    from radixkv.kernels import copy_blocks, paged_decode_attention, step_tensors, store_kv

    t = step_tensors(arrays, pool.data.device)
    copy_blocks(pool.data, t.copies)  # copy-on-write first: the slots may lie in the copies
    new = [range(n - c, n) for n, c in zip(arrays.seq_lens.tolist(), arrays.num_new_tokens.tolist(), strict=True)]
    error = 0.0
    for layer in range(pool.layout.num_layers):
        kv_layer = pool.layer(layer)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        k, v = _stand_in_kv(histories, new, layer)  # [num_new_tokens, num_kv_heads, head_dim] each
        store_kv(k, v, kv_layer, t.slots)
        q = torch.randn(len(histories), NUM_Q_HEADS, pool.layout.head_dim)  # [num_seqs, num_q_heads, head_dim]
        scale = pool.layout.head_dim**-0.5
        out = paged_decode_attention(q, kv_layer, t.block_tables, t.seq_lens, scale)
        for i, tokens in enumerate(histories):
            k_all, v_all = _stand_in_kv([tokens], [range(len(tokens))], layer)  # what the cache must hold
            weights = torch.softmax(torch.einsum("hd,thd->ht", q[i], k_all.repeat_interleave(2, 1)) * scale, -1)
            expected = torch.einsum("ht,thd->hd", weights, v_all.repeat_interleave(2, 1))
            error = max(error, float((out[i] - expected).abs().max()))
    return error


def _stand_in_kv(histories: list[list[int]], positions: list[range], layer: int) -> tuple:
    """K and V of the tokens at `positions` of each history: functions of the prefix up to each token."""
    import torch

    rows = []
    for tokens, wanted in zip(histories, positions, strict=True):
        prefix_hash = np.cumsum(np.asarray(tokens, dtype=np.float64) * (1 + np.arange(len(tokens)) % 7))
        rows.append(prefix_hash[list(wanted)])
    h = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0))[:, None]  # [num_tokens, 1]
    width = LAYOUT.num_kv_heads * LAYOUT.head_dim
    freqs = torch.arange(1, width + 1, dtype=torch.float64)[None, :] * (0.001 * (layer + 1))  # [1, width]
    k, v = torch.cos(h * freqs), torch.sin(h * freqs + 0.5)  # [num_tokens, width]
    shape = (-1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return k.float().reshape(shape), v.float().reshape(shape)


# -- the orchestrator ---------------------------------------------------------------------------------


class Orchestrator:
    """Admits, prefills, decodes and preempts through the client; the worker does the tensor work."""

    def __init__(self, client: RadixKVClient, worker: Connection) -> None:
        self.client, self.worker = client, worker
        self.report = Report()

    def step_worker(self, requests: list[Request], arrays: StepArrays) -> None:
        self.worker.send(([r.token_ids for r in requests], arrays))
        self.report.max_attention_error = max(self.report.max_attention_error, self.worker.recv())

    def admit(self, waiting: collections.deque[Request], max_batch: int) -> list[Request]:
        """Open the head of the queue, as many as fit; prefill them; commit; sample their next tokens."""
        batch = [waiting.popleft() for _ in range(min(max_batch, len(waiting)))]
        while batch:
            try:
                opened = self.client.open_many([(r.token_ids, "chat") for r in batch])
                break
            except OutOfBlocks:
                waiting.appendleft(batch.pop())  # admit fewer this step
        else:
            return []
        for r, o in zip(batch, opened, strict=True):
            r.seq_id, r.num_cached_tokens = o.seq_id, o.num_cached_tokens
            self.report.hits.setdefault(r.name, o.num_cached_tokens)
        self.step_worker(batch, StepArrays.from_opens(opened))  # writes only the uncached tokens
        self.client.commit([r.seq_id for r in batch], [len(r.token_ids) for r in batch])  # type: ignore[misc]
        for r in batch:
            r.output.append(sample(r.token_ids))  # the prefill's last logits
        return batch

    def decode(self, running: list[Request], waiting: collections.deque[Request]) -> None:
        """Append every running sequence's newest token; on OutOfBlocks, preempt whoever frees most."""
        while running:
            ids = [r.seq_id for r in running]
            try:
                batch = self.client.append_batch(ids, [1] * len(running), [r.output[-1] for r in running])  # type: ignore[arg-type]
                break
            except OutOfBlocks:
                victim = max(running, key=lambda r: self.client.freeable_blocks([r.seq_id]))  # type: ignore[list-item]
                self.release(victim, cache=True)  # its written blocks stay cached: resuming hits them
                running.remove(victim)
                waiting.appendleft(victim)
                self.report.num_preempted += 1
        if not running:
            return
        self.step_worker(running, batch.step_arrays(self.client.block_table))
        for r in running:
            r.output.append(sample(r.token_ids))

    def release(self, r: Request, cache: bool) -> None:
        """Everything the sequence holds is written (the newest sampled token is not in it yet)."""
        assert r.seq_id is not None
        self.client.commit([r.seq_id], [len(r.token_ids) - 1])
        self.client.release(r.seq_id, cache=cache)
        r.seq_id = None

    def run(self, requests: list[Request], max_batch: int = 8) -> None:
        """Serve `requests` to completion. The first is admitted alone and cached once prefilled, so
        the others, which share its system prompt, hit it: in one open_many they would share nothing."""
        waiting, running = collections.deque(requests), []
        running += self.admit(waiting, 1)
        for r in running:
            self.client.cache(r.seq_id)  # type: ignore[arg-type]  # committed above: its full blocks publish
        while waiting or running:
            self.report.num_steps += 1
            for r in [r for r in running if len(r.output) >= r.max_new_tokens]:
                self.release(r, cache=True)
                running.remove(r)
                self.report.finished.append(r.name)
            if running:
                self.decode(running, waiting)
            running += self.admit(waiting, max_batch - len(running))
            if not running and waiting:
                raise RuntimeError("the pool cannot hold even one waiting request")


def run_example(address: str) -> tuple[Report, list[Request]]:
    """Eight requests with a shared system prompt, then a second turn of the last to finish; returns what happened."""
    with RadixKVClient(address) as client:
        receive, send = multiprocessing.get_context("spawn").Pipe()
        worker = multiprocessing.get_context("spawn").Process(target=worker_main, args=(receive, client.get_pool()))
        worker.start()
        try:
            orchestrator = Orchestrator(client, send)
            requests = [
                Request(name=f"r{i}", prompt=SYSTEM_PROMPT + [100 + 10 * i + j for j in range(6)], max_new_tokens=12)
                for i in range(8)
            ]
            orchestrator.run(requests)
            last = next(r for r in requests if r.name == orchestrator.report.finished[-1])
            second_turn = Request(name=f"{last.name}-turn2", prompt=last.token_ids + [900, 901, 902], max_new_tokens=4)
            orchestrator.run([second_turn])
            assert client.stats().num_live_sequences == 0
            return orchestrator.report, [*requests, second_turn]
        finally:
            send.send(None)
            worker.join(60)


def main() -> None:
    from radixkv.demo.server_process import ServerProcess

    with ServerProcess(LAYOUT) as address:
        report, requests = run_example(address)
    for r in requests:
        print(f"{r.name:<9} prompt {len(r.prompt):>3}  hit {report.hits[r.name]:>3}  generated {len(r.output)}")
    print(
        f"{report.num_steps} steps, {report.num_preempted} preemptions, max attention error "
        f"{report.max_attention_error:.1e}"
    )


if __name__ == "__main__":
    main()
