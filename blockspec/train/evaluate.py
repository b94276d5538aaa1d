"""Acceptance of a saved draft on held-out prompts, measured by the real engine (speculative_algorithm="DFLASH")."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from blockspec.train.token_progress import TokenPostfix

MAX_EVAL_KV_SLOTS = 65536


def measure_acceptance(
    target_path: str | Path, draft_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, device: str,
    dtype: str, ignore_eos: bool = False, block_size: int = 16, progress: bool = False,
) -> dict[str, Any]:
    """Greedy DFlash generation; returns the engine's avg_spec_accept_length (committed tokens per verify).
    `progress`: a bar of the prompts answered."""
    from blockspec.engine.engine import Engine

    need = sum(len(p) + max_new_tokens + 2 * block_size for p in prompts)
    engine = Engine(
        model_path=str(target_path), device=device, dtype=dtype, skip_tokenizer_init=True,
        speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
        max_total_tokens=min(MAX_EVAL_KV_SLOTS, max(2048, need)), max_running_requests=min(64, len(prompts)),
        disable_cuda_graph=True, speculative_adaptive_verify="off",  # NOTE: the full block: the draft's own acceptance
    )
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}
        outputs: list[dict[str, Any]] = []
        with tqdm(total=len(prompts), desc="evaluating draft", unit="prompt", disable=not progress) as bar:
            for _, output in engine.generate_iter(prompts, params, TokenPostfix(bar) if progress else None):
                outputs.append(output)
                bar.update(1)
        state = engine.get_server_info()["internal_states"][0]
    finally:
        engine.shutdown()  # NOTE: frees the device memory for the next engine in this process
    return {
        "accept_length": float(state["avg_spec_accept_length"]),
        "verify_steps": int(state["spec_verify_ct"]),
        "eval_tokens": sum(len(o["output_ids"]) for o in outputs),
    }
