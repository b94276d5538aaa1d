"""Whether sampled DFlash continuations follow the target's exact distribution (rejection sampling is lossless): a
tiny target with spread-out next-token distributions over VOCAB tokens, the exact distribution of its NEW_TOKENS
continuations of PROMPT under temperature / top-p, and SAMPLES seeded engine runs compared to it by total variation."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from blockspec import Engine
from tests.support.tiny_models import save_tiny_model
from tests.support.verify_cycling import CyclingVerifyLength

VOCAB = 6
PROMPT = [1, 3, 4]
NEW_TOKENS = 3
SAMPLES = 6000


def exact_distribution(target: torch.nn.Module, params: dict[str, float]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) of the target alone under temperature / top-p."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            grown: dict[tuple[int, ...], float] = {}
            for prefix, mass in probs.items():
                logits = target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].float() / params["temperature"]
                p = torch.softmax(logits, -1)
                sorted_p, order = torch.sort(p, descending=True)
                keep = (sorted_p.cumsum(0) - sorted_p) < params["top_p"]
                p = torch.zeros_like(p).scatter(0, order, sorted_p * keep)
                p = p / p.sum()
                for token in range(VOCAB):
                    grown[prefix + (token,)] = mass * float(p[token])
            probs = grown
    return probs


def marginal(dist: dict[tuple[int, ...], float], positions: tuple[int, ...]) -> Counter:
    """The distribution of the tokens at `positions` of `dist`'s sequences."""
    out: Counter = Counter()
    for seq, mass in dist.items():
        out[tuple(seq[i] for i in positions)] += mass
    return out


def total_variation(a: Counter, b: Counter) -> float:
    """Half the L1 distance between two distributions."""
    return 0.5 * sum(abs(a[k] - b[k]) for k in set(a) | set(b))


def save_spread_target(directory: Path, kind: str = "llama") -> torch.nn.Module:
    """A tiny model of `kind` over VOCAB tokens whose next-token distributions are spread out (not the test models'
    sharp ones)."""
    target = save_tiny_model(kind, directory, vocab_size=VOCAB, residual_scale=0.5)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo the test models' sharpening
    target.save_pretrained(directory)
    return target


def assert_samples_follow_target(
    target: torch.nn.Module, root: Path, params: dict[str, float], verify_lengths: Optional[list[int]]
) -> None:
    """SAMPLES seeded continuations of PROMPT by DFlash on root/target + root/draft (the verify length cycling
    through `verify_lengths` when given) follow the target's exact distribution (total variation per position and of
    positions 1-2 together); some proposals were accepted; the KV pool is free after."""
    engine = Engine(
        model_path=str(root / "target"), device="cpu", dtype="float32", max_total_tokens=8192,
        max_running_requests=256, skip_tokenizer_init=True, speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(root / "draft"),
    )
    if verify_lengths is not None:
        engine.worker.verify_policy = CyclingVerifyLength(verify_lengths)
    sampling = [
        {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": seed, **params} for seed in range(SAMPLES)
    ]
    outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=sampling)
    counts = Counter(tuple(o["output_ids"]) for o in outputs)
    empirical = Counter({seq: n / SAMPLES for seq, n in counts.items()})
    exact = exact_distribution(target, params)
    stats = engine.get_server_info()["internal_states"][0]
    assert stats["avg_spec_accept_length"] > 1.2  # the draft's proposals were really accepted sometimes
    for positions, bound in [((0,), 0.03), ((1,), 0.03), ((2,), 0.03), ((1, 2), 0.06)]:
        tv = total_variation(marginal(exact, positions), marginal(empirical, positions))
        assert tv < bound, f"positions {positions}: total variation {tv:.3f}"
    info = engine.get_server_info()["kv_cache"]
    assert info["free_slots"] == info["total_slots"]
