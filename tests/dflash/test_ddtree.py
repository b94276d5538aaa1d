"""DDTree (speculative_tree_budget): greedy output equals target-only output, and every cycle's accepted path equals a
reference written here on z-lab's `DFlashDraftModel` and the HF target (the paper's Algorithm 1 with a heap, then
the greedy walk, each node's target token from a plain forward over its whole prefix). The reference's chain mode
reproduces `dflash_generate`'s acceptance lengths, which checks the reference itself. CPU, fp32."""
from __future__ import annotations

import itertools
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from blockspec.request import SamplingParams
from blockspec.sample.sampling import sampling_probs
from tests.support.ddtree_reference import greedy_walk, heap_tree
from tests.support.logprob_reference import check_against_hf
from tests.support.penalty_reference import CASES as PENALTY_CASES
from tests.support.penalty_reference import hf_penalised_greedy
from tests.support.grammar_cases import CASES as GRAMMAR_CASES
from tests.support.grammar_cases import matches as grammar_matches
from tests.support.grammar_cases import prompt_ids as grammar_prompt_ids
from tests.support.draft_training import cpu_engine, full_block_cycles
from tests.support.grammar_models import constrained_greedy, constrained_string_distribution

dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 40, 41], [60, 61, 62, 63, 64, 65], [22] * 12]
MAX_NEW = 40
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(trained_pair: dict[str, Any]) -> dict[str, Any]:
    draft = dflash_model.DFlashDraftModel.from_pretrained(trained_pair["root"] / "draft").eval()
    return {**trained_pair, "draft": draft}


def reference_cycles(
    draft: torch.nn.Module, target: PreTrainedModel, prompt: list[int], budget: int | None
) -> tuple[list[int], list[int]]:
    """(output tokens, committed tokens per cycle) of DDTree with `budget` nodes (None: the chain of the draft's
    argmax per position), greedy, run to MAX_NEW tokens, without KV caches: every forward recomputes its prefix."""
    block = draft.block_size
    head = dflash_model._output_head(target)
    scale = float(dflash_model._draft_value(draft.config, "input_embedding_scale", 1.0))

    @lru_cache(maxsize=None)
    def target_token(ids: tuple[int, ...]) -> int:
        return int(target(torch.tensor([ids])).logits[0, -1].argmax())

    with torch.inference_mode():
        first = target_token(tuple(prompt))
        ids, lengths = list(prompt) + [first], []
        while len(ids) - len(prompt) < MAX_NEW:
            # NOTE: the draft's context: the target's features of every token before the bonus (the last one)
            hidden_states = target(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
            context = dflash_model.extract_context_feature(hidden_states, draft.target_layer_ids)
            noise = dflash_model._raw_input_embeddings(target, torch.tensor([[ids[-1]] + [draft.mask_token_id] *
                                                                             (block - 1)]), scale)
            rows = draft(target_hidden=context, noise_embedding=noise,
                         position_ids=torch.arange(len(ids) - 1 + block)[None])[:, 1:]
            log_probs = draft.compute_logits(rows, head)[0].float().log_softmax(-1)
            if budget is None:
                chain = log_probs.argmax(-1).tolist()
                prefixes = [tuple(chain[:d]) for d in range(1, block)]
            else:
                prefixes = heap_tree(log_probs, budget)
            walked, bonus = greedy_walk(prefixes, {p: target_token(tuple(ids) + p) for p in [()] + prefixes})
            ids += walked + [bonus]
            lengths.append(len(walked) + 1)
    return ids[len(prompt):], lengths


def blockspec_cycles(root: Path, **flags: Any) -> tuple[list[list[int]], list[list[int]]]:
    engine = cpu_engine(root, True, **flags)
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    return [r.output_ids for r in reqs], [r.spec_accept_lengths for r in reqs]


def test_reference_chain_mode_reproduces_dflash_generate(pair: dict[str, Any]) -> None:
    for prompt in PROMPTS[:3]:
        stats = dflash_model.dflash_generate(pair["draft"], pair["target"], torch.tensor([prompt]), MAX_NEW, None,
                                             temperature=0.0, return_stats=True)
        expected = full_block_cycles(list(stats.acceptance_lengths), MAX_NEW, pair["draft"].block_size)
        output, lengths = reference_cycles(pair["draft"], pair["target"], prompt, None)
        assert lengths[:len(expected)] == expected
        assert output[:MAX_NEW] == stats.output_ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget,page_size", [(4, 4), (24, 1), (24, 4)])
def test_accepted_paths_equal_the_reference(pair: dict[str, Any], budget: int, page_size: int) -> None:
    outputs, lengths = blockspec_cycles(pair["root"], speculative_tree_budget=budget, page_size=page_size)
    for prompt, output, cycle_lengths in zip(PROMPTS, outputs, lengths):
        ref_output, ref_lengths = reference_cycles(pair["draft"], pair["target"], prompt, budget)
        assert output == ref_output[:MAX_NEW]
        # NOTE: the last cycle may be cut by max_new_tokens; every cycle before it committed its whole walk
        assert cycle_lengths[:-1] == ref_lengths[:len(cycle_lengths) - 1]
    if budget > 4:  # the comparison must cover walks through branches deeper than one node
        assert max(n for cycle_lengths in lengths for n in cycle_lengths) >= 4


@pytest.mark.parametrize("flags", [
    dict(speculative_tree_budget=16, page_size=4),
    dict(speculative_tree_budget=40, page_size=1, disable_overlap_schedule=True),
    dict(speculative_tree_budget=3, page_size=16, speculative_num_draft_tokens=6),
    dict(speculative_algorithm="DDTREE", page_size=4),
])
def test_greedy_output_equals_target_only(pair: dict[str, Any], flags: dict[str, Any]) -> None:
    prompts = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 33, 5, 9, 26)]
    expected = [o["output_ids"] for o in cpu_engine(pair["root"], False).generate(input_ids=prompts,
                                                                                 sampling_params=GREEDY)]
    engine = cpu_engine(pair["root"], True, **flags)
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    spec = engine.scheduler.spec.as_dict()
    assert spec["avg_spec_accept_length"] > 1.5
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]


def test_a_tree_raises_acceptance_over_the_chain(pair: dict[str, Any]) -> None:
    accept = {}
    for budget in (0, 32):
        engine = cpu_engine(pair["root"], True, speculative_tree_budget=budget)
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        accept[budget] = engine.scheduler.spec.as_dict()["avg_spec_accept_length"]
    assert accept[32] > accept[0]


def walks_past_the_root(engine: Any) -> bool:
    histogram = engine.scheduler.spec.as_dict()["spec_accept_length_histogram"]
    return sum(histogram[2:]) > 0


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_penalised_greedy_equals_a_plain_penalised_loop(pair: dict[str, Any], case: str) -> None:
    """Each tree row is penalised as of its path from the root (counts over the path's tokens, min_new_tokens by
    depth), so the output equals a plain HF greedy loop that applies the same penalties."""
    params = {"temperature": 0, "max_new_tokens": 20, **PENALTY_CASES[case]}
    engine = cpu_engine(pair["root"], True, speculative_tree_budget=8)
    eos = set(engine.scheduler.eos_token_ids)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_penalised_greedy(pair["target"], prompt, params, eos), case
    # NOTE: the bias makes token 17 the target's choice nearly everywhere; the draft never learnt it
    assert walks_past_the_root(engine) or case == "bias"


def test_logprobs_are_the_walked_rows(pair: dict[str, Any]) -> None:
    """Greedy and seeded sampled requests with logprobs: each committed token's log-probability and top-k are HF's
    over the same sequence (the walked tree rows' logits), and asking for them changes no token."""
    engine = cpu_engine(pair["root"], True, speculative_tree_budget=8)
    sampled = {"temperature": 0.7, "top_k": 20, "seed": 3, "max_new_tokens": 24, "ignore_eos": True}
    for params in (GREEDY, sampled):
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, top_logprobs_num=3)
        for prompt, out in zip(PROMPTS, outs):
            check_against_hf(pair["target"], prompt, out)
        plain = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert walks_past_the_root(engine)


def test_a_row_with_nothing_to_choose_stops_the_walk_there() -> None:
    """A tree row whose logits leave nothing to choose (here NaN) gets NO_TOKEN, which no child matches: a walk that
    reaches it stops there and reports its fault; a faulty row off the walk is never read. Greedy and sampled."""
    from blockspec.request import Req
    from blockspec.speculative.tree_build import DraftTree, ancestor_mask
    from blockspec.speculative.tree_sampling import NO_TOKEN, tree_row_tokens
    from blockspec.speculative.tree_walk import greedy_tree_walk

    # NOTE: root 0 → rows 1 (token 4) and 2 (token 5); row 1 → row 3 (token 6); row 2 → row 4 (token 7)
    parents, depths = torch.tensor([0, 0, 0, 1, 2]), torch.tensor([0, 1, 1, 2, 2])
    row_tokens = torch.tensor([9, 4, 5, 6, 7])
    tree = DraftTree(row_tokens[None, 1:], parents[None], depths[None], ancestor_mask(parents[None], 2))
    for params in ({"temperature": 0}, {"temperature": 1.0, "top_k": 1, "seed": 0}):
        logits = torch.full((5, 10), -5.0)
        logits[0, 4] = logits[1, 6] = logits[3, 1] = 5.0  # NOTE: the walk: root → row 1 → row 3, bonus 1
        logits[2] = logits[4] = float("nan")  # NOTE: faulty, off the walk
        req = Req([1, 2, 3], SamplingParams.from_dict(params))
        chosen = tree_row_tokens(req, logits, row_tokens, parents, depths, ancestor_mask(parents[None], 2)[0])
        assert chosen.tokens[[2, 4]].tolist() == [NO_TOKEN] * 2 and chosen.faults[2] and chosen.faults[4]
        accepted, path = greedy_tree_walk(tree, chosen.tokens[None], 2)
        assert int(accepted) == 2 and path[0].tolist() == [0, 1, 3] and chosen.fault_at(3) is None
        logits[1] = float("nan")  # NOTE: now the walk reaches a faulty row
        chosen = tree_row_tokens(req, logits, row_tokens, parents, depths, ancestor_mask(parents[None], 2)[0])
        accepted, path = greedy_tree_walk(tree, chosen.tokens[None], 2)
        assert int(accepted) == 1 and chosen.fault_at(int(path[0, 1])) is not None


def test_tree_rows_are_penalised_as_their_paths() -> None:
    """A tree row's penalties (frequency, presence, repetition, bias, min_new_tokens) are those of a verify block's
    last row along the row's path from the root: the output as of the path's tokens, min_new_tokens by depth."""
    from blockspec.request import Req
    from blockspec.sample.penalties import penalized, penalized_tree
    from blockspec.speculative.tree_build import ancestor_mask

    params = SamplingParams.from_dict({"frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.3,
                                       "logit_bias": {"4": 1.5}, "min_new_tokens": 5})
    req = Req([1, 2, 3], params)
    req.all_ids += [5, 6, 5]  # NOTE: the output so far; its last token is the tree's root
    req.min_tokens_blocked_ids = {9}
    parents = torch.tensor([0, 0, 0, 1, 1, 3, 2, 5])
    row_tokens = torch.tensor([5, 6, 7, 6, 8, 6, 9, 2])
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 2, 4])
    logits = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    rows = penalized_tree(logits, req, row_tokens, ancestor_mask(parents[None], 4)[0], depths)
    for row in range(8):
        path = [row]
        while path[0] != 0:
            path.insert(0, int(parents[path[0]]))
        chain = penalized(logits[path], req, row_tokens[path[1:]].tolist())
        torch.testing.assert_close(rows[row], chain[-1], msg=f"row {row}, path {path}")
    assert torch.isinf(rows[1, 9]) and not torch.isinf(rows[3, 9])  # NOTE: 3 output tokens + depth 1 < 5; + 2 not


def test_tree_rows_are_masked_as_their_paths(qwen_vocab_pair: dict[str, Any]) -> None:
    """A tree row's grammar mask is that of a verify block's last row along the row's path (the matcher advanced over
    its tokens, then rolled back); rows under a token the grammar rejects stay unmasked, and the matcher ends where it
    began."""
    from blockspec.request import GrammarSpec
    from blockspec.sample.grammar import GrammarCompiler
    from tests.support.grammar_models import QWEN_EOS

    tokenizer = qwen_vocab_pair["tokenizer"]
    vocab = qwen_vocab_pair["target"].config.vocab_size
    grammar = GrammarCompiler(tokenizer, vocab, [QWEN_EOS]).start(GrammarSpec("regex", "[a-z]{2,5} [0-9]{1,3}!"))

    def allowed_after(path_tokens: list[int]) -> list[int]:
        row = grammar.masked(torch.zeros(len(path_tokens) + 1, vocab), path_tokens)[-1]
        return torch.nonzero(torch.isfinite(row))[:, 0].tolist()

    # NOTE: each row of depth < 3 gets two children the grammar allows and one it never allows (a capital letter);
    # a row under that one gets a child too, which must stay unmasked
    generator = torch.Generator().manual_seed(1)
    rejected, letter = int(tokenizer.encode("Z")[0]), int(tokenizer.encode("a")[0])
    parents, row_tokens, paths = [0], [0], [[]]
    for row in itertools.count():
        if row == len(parents):
            break
        path = paths[row]
        if len(path) == 3:
            continue
        if rejected in path:
            children = [letter]
        else:
            allowed = allowed_after(path)
            children = [allowed[int(i)] for i in torch.randint(len(allowed), (2,), generator=generator)] + [rejected]
        for token in dict.fromkeys(children):
            parents.append(row)
            row_tokens.append(token)
            paths.append(path + [token])
    logits = torch.randn(len(parents), vocab, generator=generator)
    matcher_before = grammar.masked(torch.zeros(1, vocab))
    rows = grammar.masked_tree(logits, row_tokens, parents)
    for row, path in enumerate(paths):
        chain = grammar.masked(logits[[0] * len(path) + [row]], path)  # NOTE: its last row is this row's
        torch.testing.assert_close(rows[row], chain[-1], msg=f"row {row}, path {path}")
        if rejected in path:
            torch.testing.assert_close(rows[row], logits[row])
    assert any(not torch.isfinite(rows[row]).all() for row, path in enumerate(paths) if len(path) == 3)
    torch.testing.assert_close(grammar.masked(torch.zeros(1, vocab)), matcher_before)


@pytest.mark.parametrize("case", ["pattern regex", "enum schema", "ebnf"])
def test_constrained_greedy_equals_a_constrained_target_loop(qwen_vocab_pair: dict[str, Any], case: str) -> None:
    """NOTE: this pair's draft is rarely accepted, so these runs mostly check the root's mask (and the plumbing);
    the masks of deeper rows are test_tree_rows_are_masked_as_their_paths's."""
    kind, source = GRAMMAR_CASES[case]
    tokenizer, target = qwen_vocab_pair["tokenizer"], qwen_vocab_pair["target"]
    prompts = grammar_prompt_ids(tokenizer)
    engine = cpu_engine(Path(qwen_vocab_pair["root"]), True, skip_tokenizer_init=False, speculative_tree_budget=8)
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 40, kind: source})
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == constrained_greedy(target, tokenizer, prompt, kind, source, 40), case
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert grammar_matches(kind, source, out["text"]), (case, out["text"])
    engine.shutdown()


def test_sampled_constrained_distribution_is_the_masked_target(qwen_vocab_pair: dict[str, Any]) -> None:
    regex, samples = "(yes|no|maybe)", 400
    prompt = grammar_prompt_ids(qwen_vocab_pair["tokenizer"])[0]
    exact = constrained_string_distribution(qwen_vocab_pair["target"], qwen_vocab_pair["tokenizer"], prompt, regex)
    engine = cpu_engine(Path(qwen_vocab_pair["root"]), True, skip_tokenizer_init=False, speculative_tree_budget=8)
    outs = engine.generate(input_ids=[prompt] * samples, sampling_params=[
        {"temperature": 1.0, "seed": seed, "max_new_tokens": 8, "regex": regex} for seed in range(samples)])
    counts = {text: sum(o["text"] == text for o in outs) / samples for text in exact}
    total_variation = 0.5 * sum(abs(counts[text] - p) for text, p in exact.items())
    assert total_variation < 0.07, (counts, exact)
    engine.shutdown()


def exact_sequences(target: PreTrainedModel, prompt: list[int], params: SamplingParams, length: int,
                    min_mass: float = 1e-6) -> dict[tuple[int, ...], float]:
    """P(output = s) of every output sequence s of `length` tokens under the target's own sampling with `params`
    (HF forwards over every prefix of probability > min_mass; the mass below it is dropped)."""
    sequences: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(sequences)
        with torch.inference_mode():
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = torch.cat([target(chunk).logits[:, -1].float() for chunk in ids.split(256)])
        probs = sampling_probs(logits, params) * torch.tensor([sequences[p] for p in prefixes])[:, None]
        rows, tokens = torch.nonzero(probs > min_mass, as_tuple=True)
        sequences = {prefixes[r] + (t,): float(probs[r, t]) for r, t in zip(rows.tolist(), tokens.tolist())}
    return sequences


def tv_distance(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / len(samples) - exact.get(k, 0.0)) for k in keys)


def projected(distribution: dict[tuple[int, ...], float], positions: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    marginal: dict[tuple[int, ...], float] = {}
    for sequence, mass in distribution.items():
        key = tuple(sequence[k] for k in positions)
        marginal[key] = marginal.get(key, 0.0) + mass
    return marginal


@pytest.mark.parametrize("params", [{"temperature": 1.0, "top_k": 3}, {"temperature": 0.6, "top_k": 4, "top_p": 0.9}])
def test_sampled_output_is_distributed_as_the_targets(pair: dict[str, Any], params: dict[str, Any]) -> None:
    """The tree engine's sampled outputs (6 tokens, 2000 seeds) against the target's exact sampling distribution
    (every sequence enumerated; top-k keeps it small): the TV distance of each position's token and of each pair of
    neighbours is within the spread of 2000 exact draws (its mean + 5 standard deviations over 30 draws)."""
    prompt, runs, length = PROMPTS[1], 2000, 6
    engine = cpu_engine(pair["root"], True, speculative_tree_budget=16)
    outputs = engine.generate(input_ids=[prompt] * runs, sampling_params=[
        {**params, "seed": seed, "max_new_tokens": length, "ignore_eos": True} for seed in range(runs)])
    histogram = engine.scheduler.spec.as_dict()["spec_accept_length_histogram"]
    assert sum(histogram[2:]) > 0.1 * sum(histogram)  # NOTE: walks past the root are common
    exact = exact_sequences(pair["target"], prompt, SamplingParams.from_dict(params), length)
    assert sum(exact.values()) > 0.999
    keys, weights = list(exact), torch.tensor(list(exact.values()))
    generator = torch.Generator().manual_seed(0)
    draws = [[keys[i] for i in torch.multinomial(weights, runs, True, generator=generator).tolist()] for _ in range(30)]
    samples = [tuple(o["output_ids"]) for o in outputs]
    for positions in [(k,) for k in range(length)] + [(k, k + 1) for k in range(length - 1)]:
        marginal = projected(exact, positions)
        floor = torch.tensor([tv_distance([tuple(d[k] for k in positions) for d in draw], marginal) for draw in draws])
        tv = tv_distance([tuple(sample[k] for k in positions) for sample in samples], marginal)
        assert tv < float(floor.mean() + 5 * floor.std()), (positions, tv, floor.mean(), floor.std())


@pytest.mark.parametrize("flags,message", [
    (dict(speculative_tree_budget=8), "needs a DFlash draft"),
    (dict(speculative_algorithm="DFLASH", speculative_draft_model_path="d", speculative_tree_budget=8,
          attention_backend="flashinfer"), "flashinfer"),
    (dict(speculative_algorithm="DDTREE", speculative_draft_model_path="d",
          speculative_num_draft_tokens_per_bs="1-64:4"),
     "speculative_num_draft_tokens_per_bs"),
    (dict(speculative_algorithm="DFLASH", speculative_draft_model_path="d", speculative_tree_budget=-1),
     "non-negative"),
    (dict(speculative_algorithm="DDTREE", speculative_draft_model_path="d", speculative_simulate_accept_len=3),
     "needs both the chain's"),
    (dict(speculative_algorithm="DDTREE", speculative_draft_model_path="d", speculative_simulate_tree_accept_len=3),
     "needs both the chain's"),
    (dict(speculative_algorithm="DFLASH", speculative_draft_model_path="d", speculative_simulate_accept_len=3,
          speculative_simulate_tree_accept_len=3), "need a draft tree"),
    (dict(speculative_algorithm="DDTREE", speculative_draft_model_path="d", speculative_simulate_accept_len=3,
          speculative_simulate_tree_accept_len=4, speculative_simulate_tree_accept_profile="geometric:4"),
     "pass one of speculative_simulate_tree_accept_len and"),
    (dict(speculative_algorithm="DDTREE", speculative_draft_model_path="d", speculative_simulate_accept_len=3,
          speculative_simulate_tree_accept_len=0.5), "speculative_simulate_tree_accept_len must be >= 1"),
])
def test_invalid_combinations_fail_clearly(flags: dict[str, Any], message: str) -> None:
    from blockspec.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", **flags)


def test_ddtree_alias_sets_the_default_budget() -> None:
    from blockspec.config.engine_config import DEFAULT_TREE_BUDGET, EngineConfig

    config = EngineConfig(model_path="m", speculative_algorithm="ddtree", speculative_draft_model_path="d")
    assert (config.speculative_algorithm, config.tree_budget) == ("DFLASH", DEFAULT_TREE_BUDGET)
    assert EngineConfig(model_path="m", speculative_algorithm="DDTREE", speculative_draft_model_path="d",
                        speculative_tree_budget=0).tree_budget == 0


def test_dflash2_drafts_are_refused_clearly(tmp_path: Path) -> None:
    from tests.support.dflash2_drafts import build_dflash2_draft, save_published
    from tests.support.tiny_models import save_tiny_model

    target = save_tiny_model("llama", tmp_path / "target")
    save_published(build_dflash2_draft(target, [0, 2], 8), tmp_path / "draft")
    with pytest.raises(ValueError, match="DFlash2 draft's candidate selector"):
        cpu_engine(tmp_path, True, speculative_tree_budget=8)


def test_warm_up_launches_the_tree_verify_variants(pair: dict[str, Any]) -> None:
    """Start-up's kernel warm-up compiles the Triton TREE variants of the verify (root + B rows) and the draft's
    block variants, then the engine still serves the same tokens (Triton's interpreter on CPU)."""
    from blockspec.batch import ForwardMode
    from blockspec.engine.attention_variants import workload_variants
    from blockspec.engine.warmup import attention_workloads, warm_kernels

    engine = cpu_engine(pair["root"], True, attention_backend="triton", speculative_tree_budget=4,
                        max_running_requests=2, cuda_graph_bs=[1, 2])
    workloads = attention_workloads(engine.runner, engine.worker)
    shapes = [(w.mode, w.min_q, w.max_q, w.tree) for w in workloads]
    assert shapes[1:] == [(ForwardMode.VERIFY, 5, 5, True), (ForwardMode.DRAFT, 8, 8, False)]
    reference = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=GREEDY)["output_ids"]
    report = warm_kernels(engine.runner, engine.worker, engine.new_scheduler)
    assert report.attention_variants == sum(len(workload_variants(w)) for w in workloads) > 0
    assert engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=GREEDY)["output_ids"] == reference


@pytest.mark.parametrize("page_size", [1, 4])
def test_switching_between_tree_and_chain_lengths_stays_lossless(pair: dict[str, Any], page_size: int) -> None:
    """The tree is one more verify length (block + B): a policy that switches every cycle between it, the full block,
    shorter chains and plain decode (overlap schedule on: next rows derived on the device) keeps greedy output."""
    from tests.support.verify_cycling import CyclingVerifyLength

    prompts = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 33)]
    expected = [o["output_ids"] for o in cpu_engine(pair["root"], False, page_size=page_size).generate(
        input_ids=prompts, sampling_params=GREEDY)]
    engine = cpu_engine(pair["root"], True, speculative_tree_budget=12, page_size=page_size)
    tree = engine.worker.tree_shape.cycle_length
    assert tree == 8 + 12 and engine.worker.decode_slots_per_req == tree
    policy = CyclingVerifyLength([tree, 8, 1, tree, tree, 4, 1, 1, tree, 8])
    engine.worker.verify_policy = policy
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    assert set(policy.used) == {tree, 8, 4, 1}
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]


def test_simulated_tree_acceptance_commits_the_stated_lengths(pair: dict[str, Any]) -> None:
    """Benchmarks on dummy weights: tree cycles commit the tree's simulated accept length, chain cycles the chain's,
    under a policy that switches between them (the overlap schedule's device-derived rows included)."""
    from tests.support.verify_cycling import CyclingVerifyLength

    engine = cpu_engine(pair["root"], True, speculative_tree_budget=12, speculative_simulate_accept_len=3,
                        speculative_simulate_tree_accept_len=6)
    tree = engine.worker.tree_shape.cycle_length
    policy = CyclingVerifyLength([tree, 8, tree, tree, 4])
    engine.worker.verify_policy = policy
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    lengths = {length for req in reqs for length in req.spec_accept_lengths[:-1]}  # NOTE: the last one is truncated
    assert lengths == {3, 6}, lengths
    assert set(policy.used) == {tree, 8, 4}
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]


def test_a_simulated_walk_takes_the_first_rows() -> None:
    from blockspec.speculative.tree_walk import simulated_tree_walk

    accepted, path = simulated_tree_walk(torch.tensor([[0], [3], [9]]), 7)
    assert accepted.tolist() == [[0], [3], [7]]
    assert path.tolist() == [list(range(8))] * 3


def test_tree_acceptance_is_counted_apart_from_the_chains() -> None:
    from blockspec.speculative.verify_length import AcceptanceStats

    stats = AcceptanceStats(7, tree_length=20)
    prior = stats.expected_tokens(20)
    assert prior == pytest.approx(stats.expected_tokens(8))  # NOTE: the chain's full block until trees are seen
    rates = stats.rates()
    stats.observe(20, [6, 7, 5, 6] * 50)
    assert stats.rates() == rates  # the chain's per-position rates are untouched
    assert stats.expected_tokens(20) == pytest.approx(7.0, abs=0.1)


def test_the_policy_verifies_a_tree_only_where_it_pays() -> None:
    """Batch 1: the tree commits more tokens for little more time; batch 64: its verify of B + 1 rows costs more than
    its extra tokens bring, so the chain's full block wins (B = 0 there)."""
    from blockspec.speculative.verify_length import AcceptanceStats, AdaptiveVerifyLength, CycleTimes

    stats = AcceptanceStats(7, tree_length=40)
    for _ in range(100):
        stats.observe(8, [3, 4, 2, 5])
        stats.observe(40, [5, 6, 4, 6])
    times = {(1, 1): 1.0, (1, 4): 1.1, (1, 8): 1.2, (1, 40): 1.3,
             (64, 1): 2.0, (64, 4): 3.0, (64, 8): 3.4, (64, 40): 12.0}
    policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(times))
    assert policy.choose(1, stats).num_draft_tokens == 40
    assert policy.choose(64, stats).num_draft_tokens == 8


def test_the_policy_measures_an_unseen_tree_early_and_adopts_it_where_it_pays() -> None:
    """Before any tree cycle the tree's estimate is the chain's full block, which never ranks the costlier tree first:
    the policy runs it every few cycles until its acceptance is measured, then keeps it where it pays (batch 1) and
    drops it where it does not (batch 64)."""
    from blockspec.speculative.verify_length import AcceptanceStats, AdaptiveVerifyLength, CycleTimes

    times = {(1, 1): 1.0, (1, 4): 1.1, (1, 8): 1.2, (1, 40): 1.3,
             (64, 1): 2.0, (64, 4): 3.0, (64, 8): 3.4, (64, 40): 12.0}
    for batch_size, tree_wins in ((1, True), (64, False)):
        stats = AcceptanceStats(7, tree_length=40)
        policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(times, tree_length=40))
        chosen = []
        for _ in range(32):
            n = policy.choose(batch_size, stats).num_draft_tokens
            chosen.append(n)
            stats.observe(n, [3] * batch_size if n != 40 else [5] * batch_size)  # the tree commits 6, the chain 4
            policy.observe_cycle(batch_size, n, times[(batch_size, n)])  # NOTE: live cycles as fast as at start-up
        assert 40 in chosen[:4]
        assert (chosen[-8:] == [40] * 8) == tree_wins
        assert chosen[-8:].count(40) == (8 if tree_wins else 0)


def test_two_unlucky_first_trees_do_not_settle_it() -> None:
    """Batch 1: the first two tree cycles commit little (2 and 3 tokens), later ones 7. The policy keeps measuring the
    tree until it holds several request-cycles of it, then adopts it (priced on two cycles, the tree lost for the
    next 128 cycles)."""
    from blockspec.speculative.verify_length import AcceptanceStats, AdaptiveVerifyLength, CycleTimes

    times = {(1, 1): 1.0, (1, 4): 1.1, (1, 8): 1.2, (1, 40): 1.3}
    stats = AcceptanceStats(7, tree_length=40)
    policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(times, tree_length=40))
    tree_commits = iter([1, 2] + [6] * 100)
    chosen = []
    for _ in range(48):
        n = policy.choose(1, stats).num_draft_tokens
        chosen.append(n)
        stats.observe(n, [next(tree_commits)] if n == 40 else [3])  # NOTE: the chain commits 4
    assert chosen[-8:] == [40] * 8


def test_the_tree_is_priced_by_its_own_live_cycles() -> None:
    """Served with a long context, the tree's cycles (their own attention, build and compaction) grow by more than
    the chain's over their start-up figures. The tree is priced from its own live cycles (the chain's offset plus the
    tree's measured excess), so the policy drops it where its live cycle no longer pays; its cycles leave the chain's
    offset alone. (A shared offset, pulled up by tree cycles, kept running the tree here and priced the chain too high.)
    """
    from blockspec.speculative.verify_length import AcceptanceStats, AdaptiveVerifyLength, CycleTimes

    startup = {(4, 1): 2.0, (4, 4): 2.2, (4, 8): 2.4, (4, 40): 2.6}
    live = {1: 3.0, 4: 3.2, 8: 3.4, 40: 6.6}  # NOTE: the chain's cycles +1 ms, the tree's +4 ms
    stats = AcceptanceStats(7, tree_length=40)
    policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(startup, tree_length=40))
    chosen = []
    for _ in range(64):
        n = policy.choose(4, stats).num_draft_tokens
        chosen.append(n)
        stats.observe(n, [3] * 4 if n != 40 else [5] * 4)  # the tree commits 6, the full chain 4
        policy.observe_cycle(4, n, live[n])
    assert 40 in chosen[:4]  # measured early (its prior never ranks it first)
    assert 40 not in chosen[-16:]  # 6 tokens in 6.6 ms lose to 4 in 3.4 ms
    assert policy.times.cycle_ms(4, 40) == pytest.approx(6.6) and policy.times.cycle_ms(4, 8) == pytest.approx(3.4)
    policy.reset_live()
    assert policy.times.cycle_ms(4, 40) == 2.6


def test_the_tree_is_timed_at_each_batch_size_before_it_is_ruled_out() -> None:
    """Its acceptance measured at batch 1, the tree reaches batch 4's graphs with a start-up figure that read far too
    high (padding rows). Batch 4 runs it a couple of times anyway, learns its live cycle and adopts it; no more than
    those measuring cycles where it loses (batch 16: it is slow there too)."""
    from blockspec.speculative.verify_length import AcceptanceStats, AdaptiveVerifyLength, CycleTimes

    startup = {(bs, n): ms for bs, scale in ((1, 1.0), (4, 1.5), (16, 3.0))
               for n, ms in ((1, 2.0 * scale), (4, 2.2 * scale), (8, 2.4 * scale), (40, 9.0 * scale))}
    live = {1: {40: 2.6}, 4: {1: 3.0, 4: 3.3, 8: 3.6, 40: 3.9}, 16: {1: 6.0, 4: 6.6, 8: 7.2, 40: 27.0}}
    stats = AcceptanceStats(7, tree_length=40)
    for _ in range(16):  # NOTE: batch 1 measured the tree's acceptance: it commits 6 against the chain's 4
        stats.observe(40, [5])
        stats.observe(8, [3])
    policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(startup, tree_length=40))
    chosen: dict[int, list[int]] = {4: [], 16: []}
    for bs in (4, 16):
        for _ in range(32):
            n = policy.choose(bs, stats).num_draft_tokens
            chosen[bs].append(n)
            policy.observe_cycle(bs, n, live[bs][n])
    assert chosen[4][-8:] == [40] * 8  # 6 tokens in 3.9 ms beat 4 in 3.6 ms
    assert chosen[16].count(40) == 2 and 40 not in chosen[16][-16:]
    policy.reset_live()
    assert policy.runs == {}


def test_a_tree_timed_live_is_not_weighed_against_a_chain_start_up_figure() -> None:
    """Start-up figures read above live device times, the chain's (waited for on padding rows) by more than the
    tree's. At a batch size where the tree is run first, it is priced from its live cycles while the chain, never run
    there, kept its start-up figure: the tree won where it loses (7 tokens in 12 ms against 6 in 8). The chain is
    timed there too, and wins."""
    from blockspec.speculative.verify_length import AcceptanceStats, AdaptiveVerifyLength, CycleTimes

    startup = {(16, 1): 6.5, (16, 4): 8.5, (16, 8): 10.5, (16, 40): 11.5}
    live = {1: 4.0, 4: 6.0, 8: 8.0, 40: 12.0}
    stats = AcceptanceStats(7, tree_length=40)
    for _ in range(16):  # NOTE: measured elsewhere: the tree commits 7, the full chain 6
        stats.observe(40, [6] * 4)
        stats.observe(8, [5] * 4)
    policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(startup, tree_length=40))
    chosen = []
    for _ in range(48):
        n = policy.choose(16, stats).num_draft_tokens
        chosen.append(n)
        policy.observe_cycle(16, n, live[n])
    assert chosen[0] == 40  # NOTE: on start-up figures the tree ranks first (7 / 11.5 against 6 / 10.5)
    assert chosen[-16:] == [8] * 16
    # NOTE: the tree was timed before the chain: the chain's first cycle leaves the tree's live price as it was
    assert policy.times.cycle_ms(16, 40) == pytest.approx(12.0) and policy.times.cycle_ms(16, 8) == pytest.approx(8.0)


def test_cycles_that_time_nothing_do_not_end_the_measurement() -> None:
    """Batches above the largest graph (eager, untimed) measure no graph batch size, and cycles that were not timed
    live (a sampled batch's) do not count as timed: the chain is still timed at graph batch size 16 afterwards, and
    wins there. The measurement gives up after MEASURE_ATTEMPTS tries per timed cycle it wanted."""
    from blockspec.speculative.verify_length import (
        MEASURE_ATTEMPTS, AcceptanceStats, AdaptiveVerifyLength, CycleTimes,
    )

    startup = {(bs, n): ms for bs in (1, 16) for n, ms in ((1, 6.5), (4, 8.5), (8, 10.5), (40, 11.5))}
    live = {1: 4.0, 4: 6.0, 8: 8.0, 40: 12.0}
    stats = AcceptanceStats(7, tree_length=40)
    for _ in range(16):
        stats.observe(40, [6] * 4)
        stats.observe(8, [5] * 4)
    policy = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(startup, tree_length=40))
    for _ in range(16):  # NOTE: batch 20 runs eagerly; its cycles are not timed
        policy.choose(20, stats)
    for _ in range(4):  # NOTE: sampled batches at graph bs 16: chosen, never timed
        policy.choose(16, stats)
    assert policy.times.live_cycles[16] == 0
    chosen = []
    for _ in range(48):
        n = policy.choose(16, stats).num_draft_tokens
        chosen.append(n)
        policy.observe_cycle(16, n, live[n])
    assert chosen[-16:] == [8] * 16
    untimed = AdaptiveVerifyLength([1, 4, 8, 40], CycleTimes(startup, tree_length=40))
    picks = [untimed.choose(16, stats).num_draft_tokens for _ in range(63)]  # NOTE: before the 64th: exploring
    assert picks.count(8) == MEASURE_ATTEMPTS * untimed.time_cycles  # then it gives up


def test_adaptive_verify_times_the_tree_and_stays_lossless(pair: dict[str, Any]) -> None:
    prompts = [[5 + i for i in range(n)] for n in (1, 3, 7, 12)]
    expected = [o["output_ids"] for o in cpu_engine(pair["root"], False).generate(input_ids=prompts,
                                                                                 sampling_params=GREEDY)]
    engine = cpu_engine(pair["root"], True, speculative_tree_budget=8, speculative_adaptive_verify="on",
                        cuda_graph_bs=[1, 4], max_running_requests=4)
    worker = engine.worker
    assert worker.verify_lengths == (1, 4, 6, 8, 16)
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    table = worker.verify_length_info()["cost_model"]["4"]
    assert [option["num_draft_tokens"] for option in table] == [1, 4, 6, 8, 16]
    assert worker.verify_length_info()["tree"]["verify_length"] == 16
