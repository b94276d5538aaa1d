"""What serving_vs_engine.py sends: each prompt a one-turn chat (GSM8K test questions, or random words of the
tokenizer's vocabulary) and the token ids its chat template makes of it. The streaming chat client sends the
messages, the /generate client and the offline engine the ids, so every side runs the same tokens. And what a row
says of its weights."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, str]]
    ids: list[int]  # NOTE: the chat template's ids, as the server renders and encodes the messages


def chat_prompts(tokenizer_path: Path, dataset: str, count: int, prompt_len: int, seed: int) -> list[ChatPrompt]:
    """`count` one-turn chats: "gsm8k" the first GSM8K test questions; "random" a user turn of random tokens of the
    tokenizer's own vocabulary (no special tokens), decoded to text and cut so that the whole chat is about
    `prompt_len` tokens."""
    from blockspec.tokenizer import chat_to_ids, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    if dataset == "gsm8k":
        from benchmarks.greedy_drift import load_questions

        return [_chat(tokenizer, question) for question in load_questions(None, count)]
    rng = random.Random(seed)
    overhead = len(chat_to_ids(tokenizer, [{"role": "user", "content": ""}]))
    prompts = []
    for _ in range(count):
        words = max(1, prompt_len - overhead)
        ids = [rng.randrange(10, tokenizer.vocab_size) for _ in range(words)]
        prompt = _chat(tokenizer, _text_of(tokenizer, ids, words))
        for _ in range(8):  # NOTE: the text's edges may merge with the template's tokens: cut until it fits
            if len(prompt.ids) <= prompt_len or words == 1:
                break
            words = max(1, words - (len(prompt.ids) - prompt_len))
            prompt = _chat(tokenizer, _text_of(tokenizer, ids, words))
        prompts.append(prompt)
    return prompts


def _chat(tokenizer: Any, text: str) -> ChatPrompt:
    from blockspec.tokenizer import chat_to_ids

    messages = [{"role": "user", "content": text}]
    return ChatPrompt(messages, chat_to_ids(tokenizer, messages))


def _text_of(tokenizer: Any, ids: list[int], length: int) -> str:
    """Text of `ids` that encodes back to at most `length` tokens (decoded text may re-encode longer)."""
    text = tokenizer.decode(ids[:length], skip_special_tokens=True)
    for _ in range(8):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) <= length:
            break
        text = tokenizer.decode(encoded[:length], skip_special_tokens=True)
    return text.strip() or "hello"


def row_weights(engine_kwargs: dict[str, Any]) -> str:
    """A row's `weights`: "dummy" (random weights of the shape's config) or "real" (a checkpoint's)."""
    return "dummy" if engine_kwargs.get("load_format") == "dummy" else "real"
