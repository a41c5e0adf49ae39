"""TextTokenizer: text <-> ids with `tokenizers`, chat templates rendered with jinja2."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from specgen.errors import InputError


def _raise_exception(message: str) -> None:
    raise InputError(f"chat template: {message}")


@dataclass
class TextTokenizer:
    """A fast tokenizer plus what is needed to render chat prompts the way the checkpoint expects."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False  # prepend bos to plain-text prompts (the HF tokenizer's own setting)
    _template: Any = field(default=None, init=False, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos_id = self.tokenizer.token_to_id(self.bos_token)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids = [bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """Render messages with the checkpoint's template and `add_generation_prompt=True`."""
        if not self.chat_template:
            raise InputError("this model has no chat template; "
                             "give 'prompt' or 'input_ids' instead of 'messages'")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes any bos itself, so no special tokens are added here (HF does the same).
        return self.encode(self.render_chat(messages), add_special_tokens=False)
