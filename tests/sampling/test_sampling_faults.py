"""One request with a degenerate sampling value never fails the others in its batch (issue 47): a plainly degenerate
value is normalised at the door (a temperature below GREEDY_TEMPERATURE is greedy; top_p so small that it rounds to 0
keeps the top token), and a row that still has nothing to sample from ends its own request with a clear error while
the rest of the batch finishes with exactly the tokens it gets alone. Target-only, DFlash and DDTree (a draft tree of
8 nodes), overlap on and off."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from blockspec import Engine
from blockspec.request import FinishReason, Req
from tests.support.engine_testing import run_until_done

MAX_NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True, "seed": 11}
# NOTE: the others of every batch: plain greedy (the overlap schedule's rows), seeded sampling with filters, and a
# penalised greedy row (its own copy of the logits, checked like the faulty ones)
OTHERS = [GREEDY, {**SAMPLED, "top_p": 0.9, "top_k": 50}, {**GREEDY, "frequency_penalty": 1.0, "logit_bias": {"9": 5}}]
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]

# name: (sampling params of the faulty request, what becomes of it: "greedy" = the same tokens as greedy alone,
# "alone" = the same tokens as itself alone, "fails" = its own error)
DEGENERATE: dict[str, tuple[dict[str, Any], str]] = {
    "temperature_1e-300": ({**SAMPLED, "temperature": 1e-300}, "greedy"),
    "temperature_1e-45": ({**SAMPLED, "temperature": 1e-45}, "greedy"),
    "temperature_1e-38": ({**SAMPLED, "temperature": 1e-38}, "greedy"),
    "temperature_1e300_grammar": ({**SAMPLED, "temperature": 1e300, "regex": "[ab]+"}, "alone"),
    "top_p_1e-300": ({**SAMPLED, "top_p": 1e-300}, "greedy"),
    "min_p_1": ({**SAMPLED, "min_p": 1.0}, "greedy"),
    "logit_bias_huge_tiny_temperature": ({**SAMPLED, "temperature": 1e-5, "logit_bias": {"9": 100, "10": 100,
                                                                                       "11": -100}}, "alone"),
    "logit_bias_tiny_values": ({**SAMPLED, "logit_bias": {"9": 1e-300, "10": -1e-300, "12": -100}}, "alone"),
    "repetition_penalty_overflow_sampled": ({**SAMPLED, "repetition_penalty": 1e-300}, "fails"),
    "repetition_penalty_overflow_greedy": ({**GREEDY, "repetition_penalty": 1e-300}, "fails"),
    # NOTE: after "a" the grammar allows only EOS, which min_new_tokens rules out: every token is masked
    "grammar_masks_every_token_sampled": ({**SAMPLED, "regex": "a", "min_new_tokens": 4, "ignore_eos": False},
                                          "fails"),
    "grammar_masks_every_token_greedy": ({**GREEDY, "regex": "a", "min_new_tokens": 4, "ignore_eos": False}, "fails"),
}


@pytest.fixture
def engine_for(qwen_vocab_pair: dict[str, Any], make_engine: Callable[..., Engine]) -> Callable[[str, bool], Engine]:
    """(mode, overlap schedule) → a fresh engine on the tiny target with a tokenizer (grammars need one); fresh per
    test so that a batch one case broke cannot fail the next."""
    root = Path(qwen_vocab_pair["root"])

    def build(mode: str, overlap: bool) -> Engine:
        flags: dict[str, Any] = dict(page_size=4, max_total_tokens=4096, chunked_prefill_size=8,
                                     skip_tokenizer_init=False, disable_overlap_schedule=not overlap)
        if mode != "target":
            flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
        if mode == "ddtree":
            flags.update(speculative_tree_budget=8)
        return make_engine(root / "target", **flags)

    return build


def solo(engine: Engine, prompt: str, params: dict[str, Any]) -> list[int]:
    return engine.generate(prompt=prompt, sampling_params=params)["output_ids"]


def submit(engine: Engine, prompt: str, params: dict[str, Any]) -> Req:
    (req,), _ = engine.make_requests(prompt=prompt, sampling_params=params)
    engine.scheduler.add_request(req)
    return req


@pytest.mark.parametrize("case", list(DEGENERATE))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("mode", ["target", "dflash", "ddtree"])
def test_degenerate_request_never_fails_the_batch(engine_for: Callable[[str, bool], Engine], mode: str,
                                                   overlap: bool, case: str) -> None:
    engine = engine_for(mode, overlap)
    params, outcome = DEGENERATE[case]
    others_alone = [solo(engine, prompt, p) for prompt, p in zip(PROMPTS, OTHERS)]
    # NOTE: one faulty request arrives with the others (their prefill), another while they decode
    others = [submit(engine, prompt, p) for prompt, p in zip(PROMPTS, OTHERS)]
    first = submit(engine, PROMPTS[3], params)
    done = {req.rid for _ in range(3) for req in engine.scheduler.step()}
    late = submit(engine, PROMPTS[3], params)
    run_until_done(engine, [req for req in [*others, first, late] if req.rid not in done])
    assert [req.output_ids for req in others] == others_alone, case
    assert all(req.finish is not None and req.finish.reason is not FinishReason.ABORT for req in others)
    for req in (first, late):
        assert req.finish is not None
        if outcome == "fails":
            assert req.finish.reason is FinishReason.ABORT and req.finish.error_status == 400, req.finish
            assert (req.finish.message or "").startswith("sampling failed for this request: "), req.finish
            assert 0 not in req.spec_accept_lengths  # NOTE: its failed verify cycle is not counted as one
        else:
            assert req.finish.reason is not FinishReason.ABORT and len(req.output_ids) > 0, (case, req.finish)
            expected = solo(engine, PROMPTS[3], GREEDY if outcome == "greedy" else params)
            assert req.output_ids == expected, (case, req.finish)
