"""Hugging Face-format Llama checkpoints: read `config.json` + `*.safetensors`, and make the tiny default one.

The default model needs no download: its weights are seeded random numbers, written once in the same
format any Llama-family checkpoint uses, so the demo loads it through the same path as a real one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TINY_LLAMA_SEED = 0
# The embedded default: small enough that the whole demo runs in seconds on two CPU cores, yet with
# every feature of the family (GQA 8:2, RoPE, RMSNorm, SwiGLU). Vocabulary: bytes 0-255, BOS, EOS.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "dtype": "float32",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The fields of a Llama/Mistral/Qwen2 `config.json` that the model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # Mistral: attend to the last `sliding_window` tokens only
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a `config.json` dict; refuse what the model would get silently wrong.

        Raises:
            ValueError: an activation other than SiLU or a RoPE scaling other than the default.
        """
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        rope = raw.get("rope_parameters") or {}  # transformers 5 nests RoPE settings here
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if raw.get("rope_scaling") or rope_type != "default":
            raise ValueError(f"config.json: RoPE scaling {raw.get('rope_scaling') or rope_type!r} is not supported")
        if raw.get("use_sliding_window") and raw.get("max_window_layers", 0) < raw["num_hidden_layers"]:
            raise ValueError(
                "config.json: a sliding window on only some layers (Qwen2 max_window_layers) is not supported"
            )
        num_q_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_q_heads=num_q_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_q_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_q_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases without saying so in its config; Llama's attention_bias adds o_proj's.
            qkv_bias=raw.get("attention_bias", False) or raw.get("model_type") == "qwen2",
            o_proj_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            # Qwen2 writes a window it applies only to layers from max_window_layers on (refused above).
            sliding_window=None if "use_sliding_window" in raw else raw.get("sliding_window"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the HF-named weights of a checkpoint directory (every `*.safetensors` shard).

    Raises:
        FileNotFoundError: no `config.json` or no `*.safetensors` in `path`.
    """
    path = Path(path)
    with open(path / "config.json") as f:
        raw = json.load(f)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))
    # Biases as the weights have them: configs of this family disagree on how they say so.
    config = dataclasses.replace(
        ModelConfig.from_hf(raw),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        o_proj_bias="model.layers.0.self_attn.o_proj.bias" in weights,
        mlp_bias="model.layers.0.mlp.up_proj.bias" in weights,
    )
    return config, weights


def default_model_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "radixkv" / "tiny-llama"


def ensure_tiny_llama(model_dir: str | os.PathLike[str] | None = None) -> Path:
    """The default checkpoint's directory, creating it (seeded, so identical everywhere) on first use.

    Written to a temporary sibling and renamed, so a concurrent or interrupted first run never leaves
    a half-written checkpoint behind.
    """
    target = Path(model_dir) if model_dir is not None else default_model_dir()
    if _is_checkpoint(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with open(staging / "config.json", "w") as f:
            json.dump(TINY_LLAMA, f, indent=2)
        save_file(_tiny_llama_weights(ModelConfig.from_hf(TINY_LLAMA)), staging / "model.safetensors")
        try:
            staging.rename(target)  # replaces an empty directory; fails on a non-empty one
        except OSError:
            if not _is_checkpoint(target):  # not another process's finished checkpoint: something else is there
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _tiny_llama_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded weights scaled so activations keep unit size: logits that are neither flat nor one-hot."""
    generator = torch.Generator().manual_seed(TINY_LLAMA_SEED)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) / in_features**0.5

    h, q, kv = config.hidden_size, config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    weights = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=generator)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": linear(q, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, q),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "mlp.gate_proj.weight": linear(config.intermediate_size, h),
            p + "mlp.up_proj.weight": linear(config.intermediate_size, h),
            p + "mlp.down_proj.weight": linear(h, config.intermediate_size),
        }
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = (
        linear(config.vocab_size, h) * 4.0
    )  # sharper than uniform: samples differ, greedy has clear winners
    return weights
