"""Staggered arrivals for the mixed-chunk tests: early requests start decoding, then late ones with longer prompts
arrive, so an engine with --enable-mixed-chunk carries their prefill chunks with the running requests' steps."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from blockspec import Engine
from blockspec.request import Req
from tests.support.engine_testing import random_prompts, run_until_done

EARLY = random_prompts([5, 9, 3], seed=1)
LATE = random_prompts([37, 23, 50, 2], seed=2)


def staggered_run(root: Path, spec: bool, mixed: bool, params: dict[str, Any], page_size: int,
                  early_params: Optional[dict[str, Any]] = None, **extra: Any) -> tuple[Engine, list[Req]]:
    """Early requests (with `early_params`, default `params`) start decoding; the late ones arrive two steps later
    with prompts chunked 16 tokens a step."""
    args: dict[str, Any] = dict(model_path=str(root / "target"), device="cpu", dtype="float32", page_size=page_size,
                                max_total_tokens=2048, chunked_prefill_size=16, skip_tokenizer_init=True,
                                enable_mixed_chunk=mixed, **extra)
    if spec:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    engine = Engine(**args)
    early, _ = engine.make_requests(input_ids=EARLY, sampling_params=early_params or params)
    for req in early:
        engine.scheduler.add_request(req)
    for _ in range(3):
        engine.step()
    late, _ = engine.make_requests(input_ids=LATE, sampling_params=params)
    for req in late:
        engine.scheduler.add_request(req)
    return engine, run_until_done(engine, early + late)
