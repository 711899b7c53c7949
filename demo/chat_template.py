"""Chat prompts as the model was trained to read them: its Jinja chat template, rendered in a sandbox.

The template comes from the model (GGUF `tokenizer.chat_template`, or a checkpoint's
`tokenizer_config.json` / `chat_template.jinja`); a model without one (the tiny random model) gets a
plain "System: / User: / Assistant:" template. Rendering follows transformers' `apply_chat_template`:
a sandboxed environment with `trim_blocks` and `lstrip_blocks`, `raise_exception` available, and the
BOS/EOS token strings passed in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": text}

PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
_ANSWER_MARK = "\x00radixkv-answer\x00"  # stands for an answer not yet generated


class ChatTemplate:
    """A compiled chat template; `render` turns messages into the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        self.source = source
        self._template = env.from_string(source)
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation; with `add_generation_prompt`, it ends where the answer starts.

        Raises:
            ValueError: the template refuses the conversation (its `raise_exception`).
        """
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def continuation(self, messages: list[Message], question: str) -> str:
        """The text that follows the answer to `messages` in the next turn, up to where the next answer starts.

        A multi-turn conversation's next prompt is then the first prompt, the answer's tokens as the
        model generated them (not re-tokenized: the cache holds exactly those), and this text, so the
        second turn hits the whole first one.

        Raises:
            ValueError: the template does not render a conversation as its first turn followed by more.
        """
        first = self.render(messages) + _ANSWER_MARK
        both = self.render(
            [*messages, {"role": "assistant", "content": _ANSWER_MARK}, {"role": "user", "content": question}]
        )
        if not both.startswith(first):
            raise ValueError("chat template: the second turn does not start with the first turn's prompt and answer")
        return both[len(first) :]


def load_chat_template(model_dir: str | os.PathLike[str]) -> str | None:
    """A Hugging Face checkpoint's chat template: `chat_template.jinja`, else `tokenizer_config.json`'s, else None."""
    path = Path(model_dir)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    if config.is_file():
        template: Any = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None
    return None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
