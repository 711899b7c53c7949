"""Generation with a plain contiguous KV cache per sequence: what the paged path must reproduce.

No pool, no block tables, no kernels: each sequence owns a `[num_layers, 2, capacity, H, D]` slab,
and a beam that survives into several beams is copied whole, as systems before paging did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixkv.demo import beam_search
from radixkv.demo.beam_search import Hypothesis
from radixkv.demo.model import LlamaForCausalLM


class DenseKV:
    """One sequence's K/V in one contiguous slab."""

    def __init__(self, model: LlamaForCausalLM, capacity: int) -> None:
        c = model.config
        # kv: [num_layers, 2, capacity, num_kv_heads, head_dim]
        self.kv = torch.zeros(c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim, dtype=model.dtype)
        self.num_tokens = 0

    def clone(self) -> DenseKV:
        copy = DenseKV.__new__(DenseKV)
        copy.kv, copy.num_tokens = self.kv.clone(), self.num_tokens
        return copy


class DenseAttention:
    """Attention for several sequences' new tokens (back to back), each over its own slab."""

    def __init__(
        self, caches: list[DenseKV], *, num_new_tokens: list[int], scale: float, sliding_window: int | None
    ) -> None:
        self.caches, self.num_new_tokens, self.scale, self.sliding_window = (
            caches,
            num_new_tokens,
            scale,
            sliding_window,
        )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        out = torch.empty_like(q)  # [num_tokens, num_q_heads, head_dim]
        start = 0
        for cache, n in zip(self.caches, self.num_new_tokens, strict=True):
            past, stop = cache.num_tokens, start + n
            cache.kv[layer, 0, past : past + n] = k[start:stop]
            cache.kv[layer, 1, past : past + n] = v[start:stop]
            positions = torch.arange(past + n)  # [num_context]
            query_pos = positions[past:, None]  # [n, 1]
            mask = positions[None, :] <= query_pos  # [n, num_context]
            if self.sliding_window is not None:
                mask &= positions[None, :] > query_pos - self.sliding_window
            ks = cache.kv[layer, 0, : past + n].transpose(0, 1)  # [num_kv_heads, num_context, head_dim]
            vs = cache.kv[layer, 1, : past + n].transpose(0, 1)  # [num_kv_heads, num_context, head_dim]
            qs = q[start:stop].transpose(0, 1)  # [num_q_heads, n, head_dim]
            attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start:stop] = attended.transpose(0, 1)
            start = stop
        return out


def forward(model: LlamaForCausalLM, caches: list[DenseKV], new_tokens: list[list[int]]) -> torch.Tensor:
    """Feed each sequence its new tokens; the next-token log-probs after each, fp32 `[num_seqs, vocab_size]`."""
    c = model.config
    token_ids = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.int64)  # [num_tokens]
    positions = torch.cat(
        [torch.arange(kv.num_tokens, kv.num_tokens + len(t)) for kv, t in zip(caches, new_tokens, strict=True)]
    )
    last_rows = torch.tensor([len(t) for t in new_tokens]).cumsum(0) - 1  # [num_seqs]
    attention = DenseAttention(
        caches, num_new_tokens=[len(t) for t in new_tokens], scale=c.head_dim**-0.5, sliding_window=c.sliding_window
    )
    logprobs = model(token_ids, positions, attention, last_rows)  # [num_seqs, vocab_size]
    for kv, tokens in zip(caches, new_tokens, strict=True):
        kv.num_tokens += len(tokens)
    return logprobs


def greedy(
    model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, eos_token_ids: tuple[int, ...] | None = None
) -> list[int]:
    """Greedy continuation of `prompt`: argmax each step, stopping early at EOS (included; default: the model's)."""
    eos = model.config.eos_token_ids if eos_token_ids is None else eos_token_ids
    kv = DenseKV(model, len(prompt) + max_new_tokens)
    logprobs = forward(model, [kv], [prompt])[0]  # [vocab_size]
    generated: list[int] = []
    while True:
        generated.append(int(logprobs.argmax()))
        if len(generated) == max_new_tokens or generated[-1] in eos:
            return generated
        logprobs = forward(model, [kv], [generated[-1:]])[0]


def beam_search_dense(
    model: LlamaForCausalLM, prompt: list[int], width: int, max_new_tokens: int, length_penalty: float = 1.0
) -> list[Hypothesis]:
    """Beam search of `width` beams for `max_new_tokens` steps; the `width` best hypotheses, best first."""
    eos = model.config.eos_token_ids
    root = DenseKV(model, len(prompt) + max_new_tokens)
    beams: list[tuple[DenseKV, tuple[int, ...]]] = [(root, ())]
    scores = torch.zeros(1)  # [num_beams]
    logprobs = forward(model, [root], [prompt])  # [num_beams, vocab_size]
    hypotheses: list[Hypothesis] = []
    for step in range(max_new_tokens):
        continuing, finished = beam_search.select(scores, logprobs, width, eos)
        hypotheses += [Hypothesis(beams[c.parent][1] + (c.token_id,), c.score) for c in finished]
        if step == max_new_tokens - 1 or not continuing:
            hypotheses += [Hypothesis(beams[c.parent][1] + (c.token_id,), c.score) for c in continuing]
            break
        taken: set[int] = set()
        next_beams = []
        for c in continuing:  # a parent's first survivor takes its slab, the others copy it
            kv = beams[c.parent][0] if c.parent not in taken else beams[c.parent][0].clone()
            taken.add(c.parent)
            next_beams.append((kv, beams[c.parent][1] + (c.token_id,)))
        # The copies must be made before any survivor writes its new token: clone above, feed below.
        beams = next_beams
        scores = torch.tensor([c.score for c in continuing])
        logprobs = forward(model, [kv for kv, _ in beams], [[tokens[-1]] for _, tokens in beams])
    return beam_search.best(hypotheses, width, length_penalty)
