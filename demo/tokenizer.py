"""Text <-> token ids: a checkpoint's `tokenizer.json` when it has one, else bytes (ids 0-255) plus BOS/EOS."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizerModel

from radixkv.demo.checkpoint import ModelConfig


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
    """A `tokenizers` tokenizer loaded from `tokenizer.json`; specials come from the model's config."""

    def __init__(self, path: str | os.PathLike[str], bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = HFTokenizerModel.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

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
        return HFTokenizer(path, config.bos_token_id, config.eos_token_ids)
    if config.vocab_size < 256:
        raise ValueError(f"{model_dir}: no tokenizer.json, and vocab_size {config.vocab_size} cannot hold the 256 byte tokens")
    return ByteTokenizer(config.bos_token_id, config.eos_token_ids)
