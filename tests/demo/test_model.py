"""The model and its loader against Hugging Face transformers, on checkpoints written by transformers."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from radixkv.demo import reference
from radixkv.demo.checkpoint import ModelConfig, ensure_tiny_llama
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.reference import DenseAttention, DenseKV
from radixkv.demo.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
PROMPT = [1, 17, 42, 99, 7, 250, 31, 5, 64, 128, 11]


def all_logprobs(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """Log-probabilities after every prompt token, through the dense reference cache."""
    c = model.config
    attention = DenseAttention(
        [DenseKV(model, len(prompt))],
        num_new_tokens=[len(prompt)],
        scale=c.head_dim**-0.5,
        sliding_window=c.sliding_window,
    )
    n = len(prompt)
    return model(torch.tensor(prompt), torch.arange(n), attention, torch.arange(n))  # [n, vocab_size]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "num_key_value_heads": 1,
            "rope_theta": 500.0,
        },
    ],
    ids=["gqa", "mqa-tied-biases"],
)
def test_logits_match_transformers(
    tmp_path: Path, hf_llama_factory: Callable[..., Path], overrides: dict[str, object]
) -> None:
    path = hf_llama_factory(tmp_path, **overrides)
    ours = LlamaForCausalLM.from_pretrained(path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT])).logits[0].log_softmax(-1)  # [n, vocab_size]
    torch.testing.assert_close(all_logprobs(ours, PROMPT), expected, atol=2e-5, rtol=1e-5)


def test_dense_greedy_matches_transformers_generate(hf_llama_dir: Path, model: LlamaForCausalLM) -> None:
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()
    generated = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert reference.greedy(model, PROMPT, 12) == generated[0, len(PROMPT) :].tolist()


def test_tiny_llama_is_seeded_hf_format_and_written_once(tmp_path: Path) -> None:
    a, b = ensure_tiny_llama(tmp_path / "a"), ensure_tiny_llama(tmp_path / "b")
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_llama(a) == a and (a / "model.safetensors").stat().st_mtime_ns == stamp
    # Written in Hugging Face's format: transformers itself loads it and agrees with our model.
    ours = LlamaForCausalLM.from_pretrained(a)
    assert (ours.config.num_q_heads, ours.config.num_kv_heads) == (8, 2)
    theirs = transformers.LlamaForCausalLM.from_pretrained(a).eval()
    prompt = list(b"radixkv shares prefixes")
    with torch.no_grad():
        expected = theirs(torch.tensor([prompt])).logits[0].log_softmax(-1)
    torch.testing.assert_close(all_logprobs(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def test_loader_refuses_a_checkpoint_with_a_missing_weight(hf_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(hf_llama_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(RuntimeError, match="up_proj"):
        LlamaForCausalLM.from_pretrained(broken)


def test_config_refuses_what_the_model_would_get_wrong() -> None:
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_hf(base).num_kv_heads == 2  # absent: multi-head attention
    with pytest.raises(ValueError, match="RoPE scaling"):
        ModelConfig.from_hf(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(base | {"hidden_act": "gelu"})
    assert ModelConfig.from_hf(base | {"model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096


def test_tokenizer_json_is_used_when_present(hf_llama_dir: Path, tmp_path: Path) -> None:
    config = LlamaForCausalLM.from_pretrained(hf_llama_dir).config
    fallback = load_tokenizer(hf_llama_dir, config)
    assert isinstance(fallback, ByteTokenizer)
    assert fallback.encode("hé") == [104, 195, 169] and fallback.decode([104, 195, 169, 2]) == "hé"
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path, config)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("hello world") == [5, 6]
    assert tokenizer.eos_token_ids == (2,)
