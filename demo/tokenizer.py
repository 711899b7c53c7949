"""Text <-> token ids: a GGUF file's vocabulary, a checkpoint's `tokenizer.json`, else bytes (ids 0-255)
plus BOS/EOS."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerModel

from radixkv.demo.checkpoint import ModelConfig
from radixkv.demo.gguf_checkpoint import GGUFVocabulary

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) that split digits one by one before GPT-2's byte-level regex.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r"}


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; BOS, EOS and ids from 256 up decode to nothing."""

    def __init__(self, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> None:
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        specials = {self.bos_token_id, *self.eos_token_ids}
        return bytes(t for t in token_ids if t < 256 and t not in specials).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer (from `tokenizer.json`, or built from a GGUF vocabulary); specials from the config.

    Special tokens written in the text (a chat template's `<|im_start|>`) encode as their own ids.
    """

    def __init__(self, tokenizer: HFTokenizerModel, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], bos_token_id: int | None, eos_token_ids: tuple[int, ...]
    ) -> HFTokenizer:
        return cls(HFTokenizerModel.from_file(str(path)), bos_token_id, eos_token_ids)

    @classmethod
    def from_gguf(cls, vocabulary: GGUFVocabulary) -> HFTokenizer:
        """Byte-level BPE from the file's tokens and merges, as llama.cpp runs it.

        Raises:
            ValueError: a tokenizer model other than byte-level BPE ("gpt2").
        """
        if vocabulary.model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer.ggml.model {vocabulary.model!r} is not supported (only gpt2 byte-level BPE)"
            )
        vocab = {token: i for i, token in enumerate(vocabulary.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in vocabulary.merges]
        tokenizer = HFTokenizerModel(models.BPE(vocab, merges, fuse_unk=False))  # type: ignore[arg-type]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if vocabulary.pre in _DIGIT_SPLITTING_PRE:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [AddedToken(vocabulary.tokens[i], special=True, normalized=False) for i in vocabulary.control_token_ids]
        )
        eos = () if vocabulary.eos_token_id is None else (vocabulary.eos_token_id,)
        return cls(tokenizer, vocabulary.bos_token_id, eos)

    def token(self, token_id: int) -> str | None:
        """The token's text; None for an id outside the vocabulary."""
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | os.PathLike[str], config: ModelConfig) -> Tokenizer:
    """The checkpoint's own tokenizer when `tokenizer.json` is present, else the byte-level one.

    Raises:
        ValueError: no `tokenizer.json` and a vocabulary too small for bytes.
    """
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer.from_file(path, config.bos_token_id, config.eos_token_ids)
    if config.vocab_size < 256:
        raise ValueError(
            f"{model_dir}: no tokenizer.json, and vocab_size {config.vocab_size} cannot hold the 256 byte tokens"
        )
    return ByteTokenizer(config.bos_token_id, config.eos_token_ids)
