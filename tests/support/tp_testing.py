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
