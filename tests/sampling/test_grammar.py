"""Structured output (fp32, the real Qwen3 tokenizer; on the CPU, and on CUDA with its graphs when there is one):
regex, JSON schema and EBNF constrained greedy decoding equals a plain HF + xgrammar constrained greedy loop,
target-only and under DFlash (verify rows masked along the proposals, matcher rolled back); sampled output always
matches; accept length under a grammar is reported; bad grammars are errors naming the field."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from blockspec import Engine
from tests.support.draft_training import cpu_engine
from tests.support.engine_testing import assert_engine_idle
from tests.support.grammar_cases import CASES, ENUM_SCHEMA, PROMPTS, matches, prompt_ids
from tests.support.grammar_models import constrained_greedy, constrained_string_distribution

# NOTE: only the CUDA engines' cases carry the gpu mark (make gpu-test runs them); the CPU cases run in make test
# and would only repeat themselves on the device (about 150 s of the H100 suite at e7c3ed1).

MAX_NEW = 40
# NOTE: DFlash verifies the full block on both devices (on the CPU it is the default). Adaptive verify, the default
# where the greedy cycle is one CUDA graph, learns from the free greedy run (this draft accepts ~3% of its proposals
# on free text) that n = 1 pays best, and n = 1 tries no proposal, so the grammar runs after it would never draft
# (accept length 18/17 at the first prompt); and it picks n from live timings, which changes a seeded request's draws.
FULL_BLOCK = {"speculative_adaptive_verify": "off"}


@pytest.fixture(scope="module")
def pair(qwen_vocab_pair: dict[str, Any]) -> dict[str, Any]:
    return qwen_vocab_pair


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])


@pytest.fixture(scope="module", params=["cpu", CUDA])
def engines(pair: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[bool, Engine]]:
    # NOTE: on CUDA the grammar masks run on the device, inside the engine's CUDA and piecewise graphs' schedule
    device = dict(device="cuda", cuda_graph_bs=[1, 2, 4], enforce_piecewise_cuda_graph=True) \
        if request.param == "cuda" else {}
    built = {spec: cpu_engine(Path(pair["root"]), spec, skip_tokenizer_init=False, **device,
                              **(FULL_BLOCK if spec else {})) for spec in (False, True)}
    yield built
    for engine in built.values():
        engine.shutdown()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", [False, True])
def test_constrained_greedy_equals_constrained_target_loop(pair: dict[str, Any], engines: dict[bool, Engine],
                                                           case: str, spec: bool) -> None:
    kind, source = CASES[case]
    tokenizer, engine = pair["tokenizer"], engines[spec]
    prompts = prompt_ids(tokenizer)
    outs = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, kind: source}
    )
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == constrained_greedy(pair["target"], tokenizer, prompt, kind, source, MAX_NEW), case
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert matches(kind, source, out["text"]), (case, out["text"])
    assert_engine_idle(engine)


def test_grammar_changes_the_output_and_reports_accept_length(
    pair: dict[str, Any], engines: dict[bool, Engine]
) -> None:
    prompts = prompt_ids(pair["tokenizer"])
    free = engines[True].generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    schema = engines[True].generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": MAX_NEW, "json_schema": ENUM_SCHEMA})
    assert [o["output_ids"] for o in free] != [o["output_ids"] for o in schema]
    verify_length = engines[True].get_server_info()["internal_states"][0]["verify_length"]
    assert verify_length["mode"] == "fixed", verify_length  # NOTE: the accept length below is the masked draft's
    for out in schema:
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and matches("json_schema", ENUM_SCHEMA, out["text"])
        # NOTE: the schema's fixed keys are forced tokens: the masked draft proposes them and the target accepts
        # (the free run's accept lengths in the message tell a grammar-only loss from a draft that fails everywhere)
        assert out["meta_info"]["spec_accept_length"] > 1.5, (
            out["meta_info"], [o["meta_info"]["spec_accept_length"] for o in free])


@pytest.mark.parametrize("case", ["yes/no regex", "enum schema", "ebnf"])
def test_sampled_constrained_output_always_matches(
    pair: dict[str, Any], engines: dict[bool, Engine], case: str
) -> None:
    kind, source = CASES[case]
    prompts = prompt_ids(pair["tokenizer"]) * 3
    params = [{"temperature": 1.0, "top_p": 0.95, "seed": seed, "max_new_tokens": MAX_NEW, kind: source}
              for seed in range(len(prompts))]
    outs = engines[True].generate(input_ids=prompts, sampling_params=params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        assert matches(kind, source, out["text"]), (case, out["text"])
    again = engines[True].generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # seeded: reproducible


@pytest.mark.parametrize("spec", [False, True])
def test_sampled_constrained_distribution_is_the_masked_target(pair: dict[str, Any], engines: dict[bool, Engine],
                                                               spec: bool) -> None:
    """Masking comes before rejection sampling (and the draft's distributions are masked the same way): the strings
    sampled under a regex follow the target's masked distribution, with DFlash as without."""
    regex, samples = "(yes|no|maybe)", 400
    prompt = prompt_ids(pair["tokenizer"])[0]
    exact = constrained_string_distribution(pair["target"], pair["tokenizer"], prompt, regex)
    assert set(exact) == {"yes", "no", "maybe"} and abs(sum(exact.values()) - 1.0) < 1e-4
    outs = engines[spec].generate(input_ids=[prompt] * samples, sampling_params=[
        {"temperature": 1.0, "seed": seed, "max_new_tokens": 8, "regex": regex} for seed in range(samples)])
    counts = {text: sum(o["text"] == text for o in outs) / samples for text in exact}
    total_variation = 0.5 * sum(abs(counts[text] - p) for text, p in exact.items())
    assert total_variation < 0.07, (counts, exact)


def test_constrained_and_free_requests_share_a_batch(pair: dict[str, Any], engines: dict[bool, Engine]) -> None:
    prompts = prompt_ids(pair["tokenizer"])
    free = {"temperature": 0, "max_new_tokens": MAX_NEW}
    alone = engines[True].generate(input_ids=prompts, sampling_params=free)
    mixed = engines[True].generate(input_ids=prompts, sampling_params=[free, {**free, "regex": "(yes|no)"}, free])
    assert mixed[0]["output_ids"] == alone[0]["output_ids"] and mixed[2]["output_ids"] == alone[2]["output_ids"]
    assert mixed[1]["text"] in ("yes", "no")


@pytest.mark.parametrize("params, field", [
    ({"regex": "(yes|no"}, "regex"),
    ({"json_schema": '{"type": 5}'}, "json_schema"),
    ({"json_schema": "not json"}, "json_schema"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "json_schema"),
])
def test_bad_grammars_are_errors_naming_the_field(
    engines: dict[bool, Engine], params: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        engines[True].generate(input_ids=[[1, 2, 3]], sampling_params=params)


def test_grammar_needs_a_tokenizer(pair: dict[str, Any]) -> None:
    engine = cpu_engine(Path(pair["root"]), False)
    with pytest.raises(ValueError, match="regex needs a tokenizer"):
        engine.generate(input_ids=[[1, 2, 3]], sampling_params={"regex": "(yes|no)"})
    engine.shutdown()


def test_constrained_greedy_in_mixed_chunk_steps(pair: dict[str, Any]) -> None:
    """Verify blocks that share a forward with prefill chunks (--enable-mixed-chunk) are masked the same way."""
    kind, source = CASES["enum schema"]
    tokenizer = pair["tokenizer"]
    prompts = [list(tokenizer.encode(text)) for text in (PROMPTS[0], PROMPTS[1] * 4, PROMPTS[2] * 6)]
    engine = cpu_engine(Path(pair["root"]), True, skip_tokenizer_init=False, enable_mixed_chunk=True)
    outs = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, kind: source}
    )
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == constrained_greedy(pair["target"], tokenizer, prompt, kind, source, MAX_NEW)
    assert engine.scheduler.spec.verify_ct > 0 and engine.scheduler.steps.mixed_steps > 0
    engine.shutdown()
