"""Shared by the GPU test files (and CPU checks of theirs): one engine run over fixed prompts (greedy, to length)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from blockspec import Engine

PROMPTS = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 33, 5, 9, 26)]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def run_prompts(root: Path, spec: bool, **flags: Any) -> tuple[list[list[int]], Engine]:
    """Target at root/target (DFlash with root/draft when spec); every KV slot must be free afterwards."""
    args: dict[str, Any] = dict(model_path=str(root / "target"), dtype="float32", max_total_tokens=4096,
                                skip_tokenizer_init=True, chunked_prefill_size=16, cuda_graph_bs=[1, 2, 4, 8])
    if spec:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    args.update(flags)
    engine = Engine(**args)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    return [o["output_ids"] for o in outputs], engine
