"""Tokenizer loading, chat templates and incremental detokenisation."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from blockspec.config.chat_templates import chat_template_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False,
                   chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    """The fast tokenizer in `path`; `chat_template` (a shipped template's name or a Jinja file, chat_templates.py)
    replaces its own chat template."""
    from transformers import AutoTokenizer  # NOTE: here: modules that only detokenise or parse flags skip its import

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    if not (root / "tokenizer.json").is_file() and not (root / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {root}; "
            "pass tokenizer_path or skip_tokenizer_init=True"
        )
    if chat_template is None:
        return AutoTokenizer.from_pretrained(str(root), trust_remote_code=trust_remote_code)
    return AutoTokenizer.from_pretrained(str(root), trust_remote_code=trust_remote_code,
                                         chat_template=chat_template_text(chat_template))


class ToolsIgnoredError(ValueError):
    pass


def chat_to_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None
) -> list[int]:
    """The prompt of `messages` (and OpenAI-shaped `tools`, which the template must render) by the chat template."""
    return list(tokenizer.encode(render_chat(tokenizer, messages, tools), add_special_tokens=False))


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None
) -> str:
    """The chat template's text for `messages` (+ `tools`) up to the assistant's turn; encode it without adding
    special tokens (the template wrote them)."""
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(VALID_ROLES)}")
    if tokenizer.chat_template is None:
        raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if tools and rendered == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True):
        raise ToolsIgnoredError("this model's chat template does not render tools")
    return str(rendered)


def backend_of(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The `tokenizers` Tokenizer behind a fast HF tokenizer (what DecodeStream decodes with)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(
            f"{type(tokenizer).__name__} has no `tokenizers` backend; blockspec needs a fast tokenizer (tokenizer.json)"
        )
    return backend


class TextStream:
    """Incremental detokenisation of one request's output with `tokenizers`' DecodeStream: text appears as soon as
    its bytes are complete; `flush` gives what an unfinished multi-byte character left pending at the end."""

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # NOTE: ids pushed since the stream last produced text

    def push(self, ids: list[int]) -> str:
        """Adds tokens; returns the text they completed (maybe empty)."""
        if not ids:
            return ""
        text = self._stream.step(self.backend, ids if len(ids) > 1 else ids[0])
        if text is None:
            self._pending += ids
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Text still held back at the end of a request (an incomplete byte sequence decodes to U+FFFD)."""
        if not self._pending:
            return ""
        text = self.backend.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending = []
        return text


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into one of `stops` (streamed text holds it back
    until the next tokens decide)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


def find_stop(text: str, stops: list[str], search_from: int) -> Optional[tuple[int, str]]:
    """Earliest occurrence of any stop string that ends after `search_from`."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
