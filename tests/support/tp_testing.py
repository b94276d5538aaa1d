"""Helpers of the tensor-parallel tests: a hang fails the test instead of CI, and TP=1 vs TP=N runs side by side."""
from __future__ import annotations

import contextlib
import faulthandler
import threading
from pathlib import Path
from typing import Any, Iterator

from blockspec import Engine

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],  # > 2 prefill chunks of 8
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38],
]
GREEDY = dict(max_new_tokens=20, temperature=0.0, ignore_eos=True)
# NOTE: a penalised greedy request is deterministic but leaves the one-graph greedy cycle (host propose / verify)
MIXED_PARAMS = [GREEDY, {**GREEDY, "frequency_penalty": 0.5}, GREEDY]
# NOTE: fp32 logits differ across TP sizes only in reduction order: a seeded draw flips only on a ~1e-7 boundary
SAMPLED = [{**GREEDY, "temperature": 0.8, "seed": seed} for seed in (1, 2, 3)]


def cpu_flags(model_path: Path, **extra: Any) -> dict[str, Any]:
    """fp32 on CPU, paged KV (page 4), 8-token prefill chunks."""
    flags: dict[str, Any] = dict(model_path=str(model_path), device="cpu", dtype="float32", page_size=4,
                                 max_total_tokens=2048, chunked_prefill_size=8, skip_tokenizer_init=True)
    return {**flags, **extra}


@contextlib.contextmanager
def deadline(engine: Engine | None, seconds: float) -> Iterator[None]:
    """Past `seconds`, kills the engine's rank processes (rank 0's pending collective then fails); 30 s later, if
    still stuck, dumps every thread's stack and exits the test process."""
    killer = threading.Timer(seconds, lambda: engine is not None and engine.ranks is not None and engine.ranks.close())
    killer.daemon = True
    killer.start()
    faulthandler.dump_traceback_later(seconds + 30.0, exit=True)
    try:
        yield
    finally:
        killer.cancel()
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def tp_engine(flags: dict[str, Any], tp_size: int = 2, seconds: float = 120.0) -> Iterator[Engine]:
    """An engine of `tp_size` ranks, shut down afterwards; start-up and use under a deadline."""
    faulthandler.dump_traceback_later(seconds + 30.0, exit=True)
    try:
        engine = Engine(tp_size=tp_size, **flags)
    finally:
        faulthandler.cancel_dump_traceback_later()
    try:
        with deadline(engine, seconds):
            yield engine
    finally:
        engine.shutdown()


def generate(engine: Engine, sampling: Any, logprobs: bool = True) -> list[dict[str, Any]]:
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=sampling, return_logprob=logprobs)
    assert isinstance(outputs, list)
    return outputs


def assert_same_outputs(reference: list[dict[str, Any]], outputs: list[dict[str, Any]], atol: float = 1e-4) -> None:
    """Token-identical, with the target's log-probabilities of those tokens equal up to fp32 reduction order."""
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in reference]
    for ref, out in zip(reference, outputs):
        ref_lp = [lp for lp, _, _ in ref["meta_info"].get("output_token_logprobs", [])]
        out_lp = [lp for lp, _, _ in out["meta_info"].get("output_token_logprobs", [])]
        assert len(ref_lp) == len(out_lp)
        assert all(abs(a - b) <= atol for a, b in zip(ref_lp, out_lp)), (ref_lp, out_lp)
        for key in ("spec_verify_ct", "spec_accept_length"):
            assert ref["meta_info"].get(key) == out["meta_info"].get(key), key


def every_path(engine: Engine) -> tuple[list[dict[str, Any]], ...]:
    """All-greedy (the overlap schedule: device rows, the one-graph greedy cycle under DFlash); with a penalised
    request and log-probabilities (host rows: decode / propose + verify from the host); seeded sampling (rank 0
    samples from the gathered logits; rejection sampling under DFlash)."""
    return (generate(engine, GREEDY, logprobs=False), generate(engine, MIXED_PARAMS, logprobs=True),
            generate(engine, SAMPLED, logprobs=False))


def check_tp2_matches_tp1(flags: dict[str, Any]) -> Engine:
    """The engine of `flags` at TP=2 gives TP=1's outputs on every path (every_path); returns the TP=2 engine, shut
    down."""
    with Engine(**flags) as engine:
        reference = every_path(engine)
    with tp_engine(flags) as engine:
        outputs = every_path(engine)
        info = engine.get_server_info()
    for expected, got in zip(reference, outputs):
        assert_same_outputs(expected, got)
    assert info["tp_size"] == 2
    return engine
