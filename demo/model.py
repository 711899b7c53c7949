"""A Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention is supplied by the caller.

The model never holds K/V itself. Each layer hands its new q, k, v to an `Attention`, which stores
k and v wherever its cache lives (the paged pool, or a dense reference cache) and attends. Tokens are
flat (`[num_tokens, ...]`, several sequences back to back), as in vLLM; positions say where each sits.
Module names follow Hugging Face's, so a checkpoint's state dict loads as is.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.demo.checkpoint import ModelConfig, load_checkpoint
from radixkv.demo.gguf_checkpoint import is_gguf, load_gguf


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v for the batch's tokens, attend, return `[num_tokens, num_q_heads, head_dim]`.

        q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        """
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size]; normalised in fp32 as HF does, so half-precision weights match it
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in HF's rotate-half layout (the first and second halves of head_dim form the pairs)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [head_dim // 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] -> cos, sin: [num_tokens, 1, head_dim] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, num_heads, head_dim // 2] each
    rotated = torch.cat((-x2, x1), dim=-1)  # [num_tokens, num_heads, head_dim]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_q_heads, self.num_kv_heads, self.head_dim = config.num_q_heads, config.num_kv_heads, config.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_q_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        # x: [num_tokens, hidden_size]
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_q_heads, self.head_dim)  # q: [num_tokens, num_q_heads, head_dim]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # k: [num_tokens, num_kv_heads, head_dim]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # v: [num_tokens, num_kv_heads, head_dim]
        out = attention(
            layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        )  # [num_tokens, num_q_heads, head_dim]
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size]; SwiGLU
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        # x: [num_tokens, hidden_size]
        x = x + self.self_attn(layer, self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; `forward` returns log-probabilities only for the rows asked for."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
        """Load a HF-format checkpoint directory or a Llama GGUF file; every parameter must be present, and
        nothing else.

        Raises:
            RuntimeError: missing or unexpected weights (the state dict does not fit a Llama).
        """
        if is_gguf(path):
            config, weights, _ = load_gguf(path)
        else:
            config, weights = load_checkpoint(path)
        return cls.from_weights(config, weights, dtype)

    @classmethod
    def from_weights(
        cls, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> LlamaForCausalLM:
        """The model holding `weights` (HF names); tied embeddings may leave `lm_head.weight` out.

        Raises:
            RuntimeError: missing or unexpected weights.
        """
        weights = {name: w for name, w in weights.items() if not name.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        with torch.device("meta"):  # no random initialisation of weights about to be replaced
            model = cls(config)
        model.load_state_dict(weights, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta
        )  # its buffer is not in the state dict
        return model.to(dtype).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """Run every token through the decoder (its K/V go to `attention`); log-softmax of `logit_rows`' outputs.

        Args:
            token_ids: int64 `[num_tokens]`, several sequences back to back.
            positions: int64 `[num_tokens]`, each token's position in its sequence (for RoPE).
            attention: where K/V are stored and read.
            logit_rows: int64 `[num_rows]`, the tokens whose next-token distribution is wanted.

        Returns:
            fp32 `[num_rows, vocab_size]` log-probabilities.
        """
        cos, sin = self.model.rotary_emb(positions)  # [num_tokens, 1, head_dim] each
        x = self.model.embed_tokens(token_ids)  # x: [num_tokens, hidden_size]
        for i, layer in enumerate(self.model.layers):
            x = layer(i, x, cos, sin, attention)
        h = self.model.norm(x[logit_rows])  # h: [num_rows, hidden_size]
        return torch.log_softmax(self.lm_head(h).float(), dim=-1)  # [num_rows, vocab_size]
