"""What serving_vs_engine.py sends beyond random token ids (GSM8K chat prompts), the arrival wait the server runs,
and what a row says of its weights."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def gsm8k_chat_prompts(tokenizer_path: Path, count: int) -> list[list[int]]:
    """The first `count` GSM8K test questions, each the user turn of a chat, as the chat template's token ids."""
    from benchmarks.greedy_drift import load_questions

    from blockspec.tokenizer import chat_to_ids, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    return [chat_to_ids(tokenizer, [{"role": "user", "content": question}]) for question in load_questions(None, count)]


def serve_dflash_wait_steps(extra_tokens: list[str]) -> int:
    """`--max-prefill-wait-steps` as `blockspec serve` resolves it under DFlash with these extra flags."""
    from blockspec.server.args import parse_serve_args

    dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "unused"]
    return int(parse_serve_args(["--model-path", "unused", *dflash, *extra_tokens]).engine["max_prefill_wait_steps"])


def row_weights(engine_kwargs: dict[str, Any]) -> str:
    """A row's `weights`: "dummy" (random weights of the shape's config) or "real" (a checkpoint's)."""
    return "dummy" if engine_kwargs.get("load_format") == "dummy" else "real"
