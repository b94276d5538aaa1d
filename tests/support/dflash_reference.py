"""z-lab's `dflash_generate` (the `dflash` package, CPU) as the oracle of DFlash greedy decoding: blockspec's tokens and
per-cycle acceptance lengths for PROMPTS equal the reference's. Importing this module skips the importing test module
where `dflash` is not installed."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from blockspec import Engine
from tests.support.draft_training import full_block_cycles

dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 40, 41], [60, 61, 62, 63, 64, 65], [22] * 12]
MAX_NEW = 40


def reference(draft: torch.nn.Module, target: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[int]]:
    """dflash_generate's greedy tokens after `prompt` (MAX_NEW of them) and its per-cycle acceptance lengths."""
    stats = dflash_model.dflash_generate(
        draft, target, torch.tensor([prompt]), MAX_NEW, None, temperature=0.0, return_stats=True
    )
    return stats.output_ids[0, len(prompt):].tolist(), list(stats.acceptance_lengths)


def run_blockspec(target_dir: Path, draft_dir: Path, page_size: int) -> tuple[list[list[int]], list[list[int]], Engine]:
    """PROMPTS greedy (MAX_NEW tokens each) on a DFlash engine, stepped to the end: each request's output, its
    per-cycle accept lengths, and the engine."""
    engine = Engine(
        model_path=str(target_dir), device="cpu", dtype="float32", page_size=page_size, max_total_tokens=2048,
        skip_tokenizer_init=True, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
        chunked_prefill_size=8,
    )
    reqs, _ = engine.make_requests(
        input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    )
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    return [r.output_ids for r in reqs], [r.spec_accept_lengths for r in reqs], engine


def assert_matches_reference(
    draft: torch.nn.Module, target: torch.nn.Module, root: Path, block: int
) -> list[list[int]]:
    """blockspec on root/target + root/draft gives dflash_generate's tokens and per-cycle acceptance for PROMPTS;
    KV fully free after. Returns blockspec's cycle lengths per prompt."""
    outputs, lengths, engine = run_blockspec(root / "target", root / "draft", page_size=4)
    for prompt, output, cycle_lengths in zip(PROMPTS, outputs, lengths):
        ref_output, ref_lengths = reference(draft, target, prompt)
        assert output == ref_output
        expected = full_block_cycles(ref_lengths, MAX_NEW, block)
        assert cycle_lengths[: len(expected)] == expected
        assert sum(cycle_lengths) == len(output) - 1  # the first token comes from prefill
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    return lengths
