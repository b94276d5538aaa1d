"""Tokenizer loading, chat templates and incremental detokenisation."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    if not (root / "tokenizer.json").is_file() and not (root / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {root}; "
            "pass tokenizer_path or skip_tokenizer_init=True"
        )
    return AutoTokenizer.from_pretrained(str(root), trust_remote_code=trust_remote_code)


def chat_to_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(VALID_ROLES)}")
    if tokenizer.chat_template is None:
        raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


class IncrementalDetokenizer:
    """Decodes a growing id list piece by piece; never emits half of a multi-byte character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the newly completed text (maybe empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of a request (e.g. an incomplete byte sequence)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]


def find_stop(text: str, stops: list[str], search_from: int) -> Optional[tuple[int, str]]:
    """Earliest occurrence of any stop string that ends after `search_from`."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
