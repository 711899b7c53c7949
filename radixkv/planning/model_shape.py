"""A model's KV shape (layers, KV heads, head_dim) from a known name, a Hugging Face config.json or a GGUF file.

Shared by `radixkv plan` and `radixkv serve --model`: the shape is all the KV cache needs of a model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} must be a positive integer, got {value!r}")


# The shape `radixkv serve` gives its default pool: the demo's model.
DEFAULT_MODEL = "smollm2-135m"

# KV-relevant shapes of well-known models, from their config.json (weights are deployment-specific).
MODEL_SHAPES: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(32, 32, 128),
    "llama-2-70b": ModelShape(80, 8, 128),
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(80, 8, 128),
    "llama-3.1-8b": ModelShape(32, 8, 128),
    "llama-3.1-70b": ModelShape(80, 8, 128),
    "llama-3.1-405b": ModelShape(126, 8, 128),
    "llama-3.2-1b": ModelShape(16, 8, 64),
    "llama-3.2-3b": ModelShape(28, 8, 128),
    "llama-3.3-70b": ModelShape(80, 8, 128),
    "mistral-7b": ModelShape(32, 8, 128),
    "qwen2-7b": ModelShape(28, 4, 128),
    "qwen2.5-7b": ModelShape(28, 4, 128),
    "smollm2-135m": ModelShape(30, 3, 64),
    "smollm2-360m": ModelShape(32, 5, 64),
    "smollm2-1.7b": ModelShape(24, 32, 64),
}


def known_model(name: str) -> ModelShape | None:
    """The shape of a known model, spelled as on the Hub or not: "meta-llama/Llama-3.1-8B-Instruct" -> llama-3.1-8b."""
    key = name.lower().rsplit("/", 1)[-1].removeprefix("meta-")
    key = re.sub(r"-(instruct|chat|base|hf)$", "", key)
    return MODEL_SHAPES.get(key)


def resolve_model(name_or_path: str) -> tuple[str, ModelShape]:
    """(a display name, the shape) of a known model name, a Hugging Face directory or config.json, or a GGUF file.

    Raises:
        ValueError: neither a known name nor a readable model file (the message says which names exist).
    """
    if os.path.exists(name_or_path):
        return name_or_path, read_model_shape(name_or_path)
    shape = known_model(name_or_path)
    if shape is None:
        raise ValueError(
            f"--model {name_or_path!r}: no such file, and not a known model; known: {', '.join(MODEL_SHAPES)} "
            "(or give a Hugging Face directory with config.json, or a .gguf file)"
        )
    return name_or_path, shape


def read_model_shape(path: str) -> ModelShape:
    """The shape in a Hugging Face checkpoint directory (its config.json), a config.json itself, or a GGUF file."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"--model: {os.path.dirname(path)!r} holds no config.json")
    if path.endswith(".gguf"):
        return _gguf_shape(path)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model: cannot read {path!r} as a config.json ({e})") from None
    return shape_from_hf_config(config, path)


def shape_from_hf_config(config: Mapping[str, Any], source: str = "config.json") -> ModelShape:
    """num_hidden_layers, num_key_value_heads (default: num_attention_heads), head_dim (default: hidden / heads)."""
    config = config.get("text_config", config)  # multimodal checkpoints nest the language model's config
    try:
        num_heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // num_heads
        return ModelShape(
            int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or num_heads), int(head_dim)
        )
    except KeyError as e:
        raise ValueError(f"--model: {source} has no {e.args[0]!r}: not a decoder's config.json") from None


def _gguf_shape(path: str) -> ModelShape:
    """`{arch}.block_count`, `{arch}.attention.head_count_kv`, `{arch}.attention.key_length` (or embedding / heads)."""
    try:
        import gguf
    except ImportError:
        from radixkv.extras import install_hint

        raise ValueError(f"--model: reading a GGUF file needs the gguf package: {install_hint('server')}") from None
    try:
        fields = gguf.GGUFReader(path).fields
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: cannot read {path!r} as GGUF ({e})") from None

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    num_heads, num_layers = value(f"{arch}.attention.head_count"), value(f"{arch}.block_count")
    if arch is None or num_heads is None or num_layers is None:
        raise ValueError(f"--model: {path!r} has no {arch}.block_count / attention.head_count: not a decoder")
    head_dim = value(f"{arch}.attention.key_length") or int(value(f"{arch}.embedding_length")) // int(num_heads)
    return ModelShape(int(num_layers), int(value(f"{arch}.attention.head_count_kv") or num_heads), int(head_dim))
