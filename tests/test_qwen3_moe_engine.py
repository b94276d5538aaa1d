"""A Qwen3-MoE target through the engine's paths on CPU (fp32): DFlash greedy equals z-lab's `dflash_generate` cycle
by cycle with a draft trained against the tiny MoE target; the overlap schedule, the radix prefix cache, mixed
prefill + verify steps and changing verify lengths keep that output; the piecewise decomposition of an extend (the
MoE layer is a piece like a dense MLP) equals the plain forward; DFlash sampling follows the MoE target's
distribution; TP=2 over gloo equals TP=1."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from blockspec import Engine
from blockspec.batch import ForwardMode, build_batch
from blockspec.request import Req, SamplingParams
from blockspec.runner.piecewise_graph import PiecewiseGraphRunner, default_buckets
from draft_training import cpu_engine, full_block_cycles, save_trained_target
from engine_testing import assert_engine_idle, hf_greedy, random_prompts, run_until_done
from radix_testing import assert_flushes_to_empty, engine_for, run_waves, signature
from tiny_models import save_tiny_draft, save_tiny_model
from tp_testing import assert_same_outputs, cpu_flags, generate, tp_engine
from verify_cycling import CyclingVerifyLength

dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 40, 41], [60, 61, 62, 63, 64, 65], [22] * 12]
MAX_NEW = 40
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
BLOCK = 8  # the trained draft's block (draft_training.save_trained_target)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """root/target: the tiny Qwen3-MoE (layer 2 dense), root/draft: trained 200 steps on its continuations."""
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


@pytest.mark.parametrize("prefix,new", [([0], [5]), ([0, 0, 0], [3, 17, 9]), ([20, 0], [13, 40])])
def test_piecewise_segments_equal_plain_forward(moe_pair: dict[str, Any], prefix: list[int], new: list[int]) -> None:
    """The extend cut into pieces at the attentions (as the piecewise graphs run it, here eagerly on static
    buffers padded to the bucket) == the plain forward: logits, hidden, the aux of a sparse and a dense layer, KV."""
    engine = Engine(model_path=str(moe_pair["root"] / "target"), device="cpu", dtype="float32", page_size=16,
                    max_total_tokens=2048, skip_tokenizer_init=True)
    runner = engine.runner
    capture = (1, 2)  # NOTE: layer 1 is sparse, layer 2 dense
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, default_buckets(128), capture, runner.device)
    reqs = []
    for p, n in zip(prefix, new):
        req = Req([7] * (p + n), SamplingParams())
        req.pool_row = runner.req_to_token.acquire()
        runner.allocator.grow(req, p + n, runner.req_to_token)
        reqs.append(req)
    generator = torch.Generator().manual_seed(sum(new))
    tokens = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in new]
    rows = torch.tensor(new).cumsum(0).sub(1).tolist()
    batch = build_batch(ForwardMode.EXTEND, tokens, prefix, [r.pool_row for r in reqs], runner.req_to_token.table,
                        rows, capture)
    with torch.inference_mode():
        expected = runner.model(batch, runner.attention)
        kv_plain = [t.clone() for t in runner.kv_pool.k + runner.kv_pool.v]
        got = pcg.forward(batch, use_graphs=False)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.hidden, expected.hidden)
    torch.testing.assert_close(got.aux_hidden, expected.aux_hidden)
    for before, after in zip(kv_plain, runner.kv_pool.k + runner.kv_pool.v):
        torch.testing.assert_close(before[1:], after[1:])  # padding wrote only slot 0, the dummy slot


VOCAB = 6
SAMPLE_PROMPT = [1, 3, 4]
NEW_TOKENS = 3
SAMPLES = 4000


def exact_distribution(target: torch.nn.Module, temperature: float) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) of the HF target alone at `temperature`."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            grown: dict[tuple[int, ...], float] = {}
            for prefix, mass in probs.items():
                logits = target(torch.tensor([SAMPLE_PROMPT + list(prefix)])).logits[0, -1].float()
                p = torch.softmax(logits / temperature, -1)
                for token in range(VOCAB):
                    grown[prefix + (token,)] = mass * float(p[token])
            probs = grown
    return probs


def marginal(dist: dict[tuple[int, ...], float], positions: tuple[int, ...]) -> Counter:
    out: Counter = Counter()
    for seq, mass in dist.items():
        out[tuple(seq[i] for i in positions)] += mass
    return out


def test_dflash_sampling_follows_the_moe_target(tmp_path: Path) -> None:
    """Rejection sampling against a sharp random draft: the sampled continuations' marginals are within sampling
    noise (total variation) of the MoE target's exact distribution."""
    target = save_tiny_model("qwen3_moe", tmp_path / "target", vocab_size=VOCAB, residual_scale=0.5)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # NOTE: undo the sharpening: a spread-out distribution
    target.save_pretrained(tmp_path / "target")
    save_tiny_draft(tmp_path / "draft", target, [0, 2], 4, num_layers=1, mask_token_id=VOCAB - 1,
                    output_multiplier=6.0)
    engine = Engine(model_path=str(tmp_path / "target"), device="cpu", dtype="float32", max_total_tokens=8192,
                    max_running_requests=256, skip_tokenizer_init=True, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(tmp_path / "draft"))
    sampling = [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": seed, "temperature": 1.0}
                for seed in range(SAMPLES)]
    outputs = engine.generate(input_ids=[SAMPLE_PROMPT] * SAMPLES, sampling_params=sampling)
    counts = Counter(tuple(o["output_ids"]) for o in outputs)
    empirical = Counter({seq: n / SAMPLES for seq, n in counts.items()})
    exact = exact_distribution(target, 1.0)
    assert engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1.2
    for positions, bound in [((0,), 0.035), ((1,), 0.035), ((2,), 0.035), ((1, 2), 0.07)]:
        a, b = marginal(exact, positions), marginal(empirical, positions)
        tv = 0.5 * sum(abs(a[k] - b[k]) for k in set(a) | set(b))
        assert tv < bound, f"positions {positions}: total variation {tv:.3f}"
    assert_engine_idle(engine)


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
    from determinism_checks import logits_by_path, mismatched_rows

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
