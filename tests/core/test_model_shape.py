"""The model-shape reader shared by `radixkv plan` and `radixkv serve --model`: names, config.json, GGUF."""

from __future__ import annotations

import json

import pytest

from radixkv.planning.model_shape import ModelShape, known_model, read_model_shape, resolve_model

LLAMA_32_1B = {  # the fields of meta-llama/Llama-3.2-1B's config.json that matter
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("llama-3.1-8b", ModelShape(32, 8, 128)),
        ("meta-llama/Llama-3.1-70B-Instruct", ModelShape(80, 8, 128)),
        ("Llama-3.2-1B", ModelShape(16, 8, 64)),
        ("meta-llama/Llama-3.2-3B-Instruct", ModelShape(28, 8, 128)),
        ("Llama-3.3-70B-Instruct", ModelShape(80, 8, 128)),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ModelShape(30, 3, 64)),
    ],
)
def test_known_names_as_the_hub_spells_them(name, shape):
    assert known_model(name) == shape


def test_hf_directory_and_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    assert read_model_shape(str(tmp_path)) == ModelShape(16, 8, 64)
    assert resolve_model(str(tmp_path / "config.json")) == (str(tmp_path / "config.json"), ModelShape(16, 8, 64))


def test_hf_config_defaults_and_nesting(tmp_path):
    mha = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32}  # no kv heads, no head_dim
    (tmp_path / "config.json").write_text(json.dumps({"text_config": mha, "model_type": "llava"}))
    assert read_model_shape(str(tmp_path)) == ModelShape(32, 32, 128)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"hidden_size": 8}', "has no 'num_attention_heads'"),
        ("not json", "cannot read"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_model_shape(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="holds no config.json"):
        read_model_shape(str(tmp_path))


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"not a known model; known: .*llama-3\.3-70b"):
        resolve_model("llama-9-1t")


def test_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "smollm2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(30)
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    writer.add_embedding_length(576)  # head_dim = 576 / 9 = 64, no key_length given
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_model_shape(str(path)) == ModelShape(30, 3, 64)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match="cannot read .* as GGUF"):
        read_model_shape(str(tmp_path / "broken.gguf"))
