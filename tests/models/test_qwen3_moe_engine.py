"""A Qwen3-MoE target through the engine's paths on CPU (fp32): DFlash greedy equals z-lab's `dflash_generate` cycle
by cycle with a draft trained against the tiny MoE target; the overlap schedule, the radix prefix cache, mixed
prefill + verify steps and changing verify lengths keep that output; TP=2 over gloo equals TP=1; the fused Triton
experts inside the model are batch-invariant. (Greedy == HF generate: test_engine_oracle.py; the piecewise
decomposition: test_piecewise.py; DFlash sampling == the target's distribution: test_dflash_sampling.py.)"""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from blockspec import Engine
from blockspec.request import Req
from tests.support.draft_training import cpu_engine, full_block_cycles, save_trained_target
from tests.support.engine_runs import run_prompts
from tests.support.engine_testing import assert_engine_idle, hf_greedy, random_prompts, run_until_done
from tests.support.radix_testing import assert_flushes_to_empty, engine_for, run_waves, signature
from tests.support.tp_testing import assert_same_outputs, cpu_flags, generate, tp_engine
from tests.support.verify_cycling import CyclingVerifyLength

dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 40, 41], [60, 61, 62, 63, 64, 65], [22] * 12]
MAX_NEW = 40
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
BLOCK = 8  # the trained draft's block (draft_training.save_trained_target)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """root/target: the tiny Qwen3-MoE (layer 2 dense), root/draft: trained on its continuations
    (draft_training.DRAFT_RECIPES)."""
    root = tmp_path_factory.mktemp("moe_pair")
    return {"root": root, "target": save_trained_target(root, kind="qwen3_moe")}


def run_steps(engine: Engine, prompts: list[list[int]], params: dict[str, Any]) -> list[Req]:
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=params)
    for req in reqs:
        engine.scheduler.add_request(req)
    return run_until_done(engine, reqs)


def test_dflash_greedy_matches_reference_cycle_by_cycle(moe_pair: dict[str, Any]) -> None:
    """Tokens and per-cycle acceptance of z-lab's dflash_generate over the HF Qwen3MoeForCausalLM, with
    multi-token acceptance exercised; target-only output equal too."""
    from dflash.model import DFlashDraftModel

    root, target = moe_pair["root"], moe_pair["target"]
    draft = DFlashDraftModel.from_pretrained(root / "draft", dtype=torch.float32).eval()
    engine = cpu_engine(root, True, page_size=4)
    reqs = run_steps(engine, PROMPTS, GREEDY)
    longest = 0
    for prompt, req in zip(PROMPTS, reqs):
        stats = dflash_model.dflash_generate(draft, target, torch.tensor([prompt]), MAX_NEW, None, temperature=0.0,
                                             return_stats=True)
        assert req.output_ids == stats.output_ids[0, len(prompt):].tolist()
        assert req.output_ids == hf_greedy(target, prompt, MAX_NEW)
        expected = full_block_cycles(list(stats.acceptance_lengths), MAX_NEW, BLOCK)
        assert req.spec_accept_lengths[:len(expected)] == expected
        longest = max([longest, *req.spec_accept_lengths])
    assert longest >= 3  # the comparison covers multi-token acceptance, not only rejections
    assert_engine_idle(engine)


def test_trained_draft_accepts_several_tokens_per_cycle(moe_pair: dict[str, Any]) -> None:
    """The GPU file's DFlash run (tests/gpu/test_qwen3_moe_gpu.py: its prompts, full verify blocks) on CPU: the
    draft's average accept length clears the same bar, so a draft too weak for it fails here, without a GPU."""
    _, engine = run_prompts(moe_pair["root"], True, device="cpu", speculative_adaptive_verify="off")
    assert engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1.5


@pytest.mark.parametrize("flags", [
    {"disable_overlap_schedule": True}, {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    {"page_size": 1},
], ids=["synchronous", "mixed", "page1"])
def test_dflash_paths_equal_the_overlap_schedule(moe_pair: dict[str, Any], flags: dict[str, Any]) -> None:
    """The overlap schedule (default) against the synchronous one, mixed prefill + verify steps (requests arriving
    mid-decode), page size 1: the same tokens and per-cycle acceptance, equal to HF greedy."""
    root, target = moe_pair["root"], moe_pair["target"]
    early, late = random_prompts([5, 9, 3], seed=1), random_prompts([37, 23, 2], seed=2)
    runs = []
    for extra in ({}, flags):
        engine = cpu_engine(root, True, **extra)
        reqs, _ = engine.make_requests(input_ids=early, sampling_params=GREEDY)
        for req in reqs:
            engine.scheduler.add_request(req)
        for _ in range(3):
            engine.step()
        arrivals, _ = engine.make_requests(input_ids=late, sampling_params=GREEDY)
        for req in arrivals:
            engine.scheduler.add_request(req)
        done = run_until_done(engine, reqs + arrivals)
        runs.append([(r.output_ids, r.spec_accept_lengths) for r in done])
        if extra.get("enable_mixed_chunk"):
            assert engine.scheduler.steps.mixed_steps > 0
        assert_engine_idle(engine)
    assert runs[0] == runs[1]
    for prompt, (output, _) in zip(early + late, runs[0]):
        assert output == hf_greedy(target, prompt, MAX_NEW)


def test_changing_verify_length_is_lossless(moe_pair: dict[str, Any]) -> None:
    """Every verify length 1..B in turn (1: a plain target decode step): output equal to the target alone."""
    root, target = moe_pair["root"], moe_pair["target"]
    engine = cpu_engine(root, True)
    engine.worker.verify_policy = CyclingVerifyLength([1, 3, 8, 2, 1, 5, 8, 4])
    for prompt, req in zip(PROMPTS, run_steps(engine, PROMPTS, GREEDY)):
        assert req.output_ids == hf_greedy(target, prompt, MAX_NEW)
    assert_engine_idle(engine)


def test_prefix_cache_keeps_output_and_acceptance(moe_pair: dict[str, Any]) -> None:
    """Waves sharing a prefix (then repeated): cache on == cache off, cycle by cycle; the cache was hit."""
    root = moe_pair["root"]
    system = PROMPTS[1] + hf_greedy(moe_pair["target"], PROMPTS[1], 12)
    shared = [system + q for q in random_prompts([3, 7, 1, 12], seed=12)]
    waves = [[shared[0]], shared[1:], shared]
    want = run_waves(engine_for(root, cache=False), waves)
    on = engine_for(root, cache=True)
    got = run_waves(on, waves)
    assert signature(got) == signature(want)
    assert sum(o["meta_info"]["cached_tokens"] for o in got) >= len(system) * len(shared)
    assert_flushes_to_empty(on)


TP_GREEDY = dict(max_new_tokens=20, temperature=0.0, ignore_eos=True)
TP_PARAMS = [TP_GREEDY, {**TP_GREEDY, "frequency_penalty": 0.5}, {**TP_GREEDY, "temperature": 0.8, "seed": 3}]


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "dflash"])
def test_tp2_matches_tp1(moe_pair: dict[str, Any], spec: bool) -> None:
    """Experts cut by their intermediate size over 2 gloo ranks: greedy (overlap), penalised (host rows) and seeded
    sampling give TP=1's tokens (and acceptance), log-probabilities close; prefill chunks mixed into the steps."""
    root = moe_pair["root"]
    extra: dict[str, Any] = dict(enable_mixed_chunk=True)
    if spec:
        extra.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    flags = cpu_flags(root / "target", **extra)
    with Engine(**flags) as engine:
        reference = [generate(engine, TP_GREEDY, logprobs=False), generate(engine, TP_PARAMS, logprobs=True)]
    with tp_engine(flags) as engine:
        outputs = [generate(engine, TP_GREEDY, logprobs=False), generate(engine, TP_PARAMS, logprobs=True)]
        assert engine.get_server_info()["tp_size"] == 2
    for expected, got in zip(reference, outputs):
        assert_same_outputs(expected, got)
    if spec:
        assert max(o["meta_info"]["spec_accept_length"] for o in reference[0]) > 1.0


DETERMINISTIC = dict(dtype="float16", enable_deterministic_inference=True, triton_attention_split_tile_size=32,
                     chunked_prefill_size=16, page_size=4)


def test_fused_experts_in_the_model_are_batch_invariant(make_engine: Any, moe_pair: dict[str, Any]) -> None:
    """--enable-deterministic-inference picks the fused Triton experts (fixed tiles; Triton's interpreter on CPU): a
    target token's logits are bit-identical as a decode step, in an extend chunk and in DFlash verify blocks at batch
    sizes 3 and 1, and greedy DFlash equals target-only."""
    pytest.importorskip("triton")
    from tests.support.determinism_checks import logits_by_path, mismatched_rows

    root = moe_pair["root"]
    target_only = make_engine(root / "target", **DETERMINISTIC)
    dflash = make_engine(root / "target", speculative_algorithm="DFLASH",
                         speculative_draft_model_path=str(root / "draft"), **DETERMINISTIC)
    assert target_only.runner.model.model.layers[0].mlp.uses_triton(torch.empty(0))
    prompts = [[5 + i for i in range(n)] for n in (3, 14, 37)]
    paths = logits_by_path(target_only, dflash, prompts, 8, 96)
    assert mismatched_rows(paths) == {"extend": 0, "verify": 0, "verify_bs1": 0}
    greedy = {**GREEDY, "max_new_tokens": 16}
    expected = [o["output_ids"] for o in target_only.generate(input_ids=prompts, sampling_params=greedy)]
    assert [o["output_ids"] for o in dflash.generate(input_ids=prompts, sampling_params=greedy)] == expected
