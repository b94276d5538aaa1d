"""Warm start on a GPU (issue 25): after the engine's start-up, serving compiles no Triton kernel. Each engine is
driven through varied prompt lengths, batch sizes (beyond the largest captured graph too), chunked prefill,
arrivals while others decode, DFlash cycles (greedy: the overlapped cycle graph; sampled: the synchronous path),
penalties and logprobs; the process's compile log must gain nothing. `scripts/device_warm_start.sh` runs this file
and the 8B-shape server measurement."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import Engine  # noqa: E402
from blockspec.engine.compiles import kernel_compile_log  # noqa: E402

PROMPT_LENS = (1, 2, 5, 9, 16, 17, 31, 48, 64, 65, 100, 130, 257, 300)
BATCH_SIZES = (1, 2, 3, 5, 8, 13)
ROUNDS = 8


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Target kind → a tiny target and its trained draft (built on first use)."""
    return {}


def pair_of(pairs: dict[str, Path], kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.draft_training import save_trained_target

    if kind not in pairs:
        pairs[kind] = tmp_path_factory.mktemp(f"warm_gpu_{kind}")
        save_trained_target(pairs[kind], kind=kind)
    return pairs[kind]


def sampling(rng: random.Random, max_new: int) -> dict[str, Any]:
    choice = rng.randrange(4)
    params: dict[str, Any] = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.0}
    if choice == 1:
        params.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1000))
    elif choice == 2:
        params.update(frequency_penalty=0.5, logit_bias={"7": -5.0})
    return params


def drive(engine: Engine, seed: int) -> int:
    """ROUNDS waves of requests; half of each wave arrives after two steps. Returns how many requests ran."""
    rng = random.Random(seed)
    vocab = engine.runner.target_config.vocab_size
    budget = engine.runner.context_length - 64
    total = 0
    for _ in range(ROUNDS):
        size = rng.choice(BATCH_SIZES)
        prompts = [[rng.randrange(3, vocab) for _ in range(min(rng.choice(PROMPT_LENS), budget))] for _ in range(size)]
        params = [sampling(rng, rng.choice((1, 3, 12, 30))) for _ in range(size)]
        reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=params,
                                       return_logprob=[rng.random() < 0.2 for _ in range(size)])
        first, later = reqs[: (size + 1) // 2], reqs[(size + 1) // 2:]
        for req in first:
            engine.scheduler.add_request(req)
        steps = 0
        while engine.scheduler.has_work or later:
            if later and (steps == 2 or not engine.scheduler.has_work):
                for req in later:
                    engine.scheduler.add_request(req)
                later = []
            engine.step()
            steps += 1
        total += size
    engine.scheduler.collect_finished()
    return total


ENGINES = {
    "dflash-piecewise-chunked": dict(speculative=True, enforce_piecewise_cuda_graph=True, chunked_prefill_size=64,
                                     piecewise_cuda_graph_max_tokens=128, cuda_graph_bs=[1, 2, 4]),
    "dflash-mixed-page16": dict(speculative=True, enable_mixed_chunk=True, page_size=16, chunked_prefill_size=48,
                                enforce_piecewise_cuda_graph=True, cuda_graph_bs=[1, 2, 4, 8]),
    "target-piecewise-sync": dict(speculative=False, enforce_piecewise_cuda_graph=True, chunked_prefill_size=96,
                                  disable_overlap_schedule=True, cuda_graph_bs=[1, 4]),
    # NOTE: greedy waves run their mixed steps behind the decode step in flight (StepExecutor.launch_mixed_ahead)
    "target-mixed-page16": dict(speculative=False, enable_mixed_chunk=True, page_size=16, chunked_prefill_size=48,
                                enforce_piecewise_cuda_graph=True, cuda_graph_bs=[1, 2, 4, 8]),
    "dflash-no-graphs": dict(speculative=True, disable_cuda_graph=True, chunked_prefill_size=-1),
    # NOTE: the fused MoE tiles follow the tokens per expert: long unchunked prompts reach the tallest tiles
    "moe-dflash-default": dict(speculative=True, kind="qwen3_moe", chunked_prefill_size=-1),
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_nothing_compiles_after_startup(pairs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                                        name: str) -> None:
    flags: dict[str, Any] = dict(ENGINES[name])
    pair = pair_of(pairs, flags.pop("kind", "llama"), tmp_path_factory)
    args: dict[str, Any] = dict(model_path=str(pair / "target"), dtype="bfloat16", max_total_tokens=8192,
                                skip_tokenizer_init=True, max_running_requests=16)
    if flags.pop("speculative"):
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(pair / "draft"))
    engine = Engine(**args, **flags)
    assert engine.startup.warmup is not None and engine.startup.warmup.attention_variants > 0
    assert engine.kernel_compiles_after_startup == 0
    ran = drive(engine, seed=len(name))
    compiled = kernel_compile_log().stalls_since(engine.compile_mark)
    assert not compiled, f"{len(compiled)} kernel variants compiled while serving {ran} requests:\n" + "\n".join(
        event.variant for event in compiled)
    info = engine.get_server_info()
    assert info["internal_states"][0]["kernel_compiles_after_startup"] == 0
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    assert info["startup"]["seconds"]["kernels"] > 0
    engine.shutdown()
