"""`train-draft --eval-prompts FILE ...`: a saved draft's accept length on each prompt set, measured by the real engine
(greedy, full blocks), after training or on its own (`--eval-only`); every run is appended to training_info.json."""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from blockspec.models.config import TargetConfig, load_json, load_target_config
from blockspec.train.data import encode_prompt, maybe_load_tokenizer, read_prompt_records
from blockspec.train.evaluate import measure_acceptance
from blockspec.train.info import append_eval_run, git_commit
from blockspec.train.options import TrainOptions, prompt_set_names

logger = logging.getLogger(__name__)


@dataclass
class PromptSet:
    name: str
    path: str
    prompts: list[list[int]]


def load_prompt_sets(options: TrainOptions, target: TargetConfig, tokenizer: Any = None) -> list[PromptSet]:
    """Each --eval-prompts file's first --eval-prompts-max prompts, encoded as --data is; too-long ones dropped."""
    paths = list(options.eval_prompts or [])
    limit = min(options.max_seq_len, target.max_position_embeddings) - options.eval_max_new_tokens - 2
    sets = []
    for name, path in zip(prompt_set_names(paths), paths):
        records = read_prompt_records(path, options.eval_prompts_max)
        tokenizer = tokenizer if tokenizer is not None else maybe_load_tokenizer(options.target_model_path, records)
        prompts = [encode_prompt(r, tokenizer, options.system_prompt, options.user_suffix) for r in records]
        kept = [p for p in prompts if len(p) <= limit]
        if not kept:
            raise ValueError(f"--eval-prompts {path}: every prompt is longer than {limit} tokens")
        if len(kept) < len(prompts):
            logger.warning("%s: dropped %d prompt(s) longer than %d tokens", path, len(prompts) - len(kept), limit)
        sets.append(PromptSet(name, str(path), kept))
    return sets


def measure_prompt_sets(
    options: TrainOptions, sets: list[PromptSet], device: str, dtype: str, block_size: int
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for prompt_set in sets:
        measured = measure_acceptance(
            options.target_model_path, options.out, prompt_set.prompts, options.eval_max_new_tokens, device, dtype,
            options.ignore_eos, block_size, options.progress,
        )
        results[prompt_set.name] = {"file": prompt_set.path, "prompts": len(prompt_set.prompts), **measured}
        logger.info(
            "%s: accept length %.3f over %d prompts",
            prompt_set.name,
            measured["accept_length"],
            len(prompt_set.prompts),
        )
    return results


def eval_run_record(kind: str, options: TrainOptions, results: dict[str, dict[str, Any]], device: str,
                    dtype: str, argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    return {
        "kind": kind, "finished": datetime.datetime.now().isoformat(timespec="seconds"), "git_commit": git_commit(),
        "command": ["blockspec", "train-draft", *argv] if argv is not None else None, "device": device, "dtype": dtype,
        "max_new_tokens": options.eval_max_new_tokens, "ignore_eos": options.ignore_eos, "sets": results,
    }


def run_eval_only(options: TrainOptions, argv: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
    """--eval-only: the draft in --out on every --eval-prompts set; the run is appended to its training_info.json."""
    import torch

    from blockspec.train.devices import dtype_name, resolve_device, resolve_target_dtype
    from blockspec.train.trainer import Dist

    options.validate()
    target = load_target_config(options.target_model_path)
    block_size = int(load_json(Path(options.out) / "config.json").get("block_size", options.block_size))
    device = resolve_device(options.device, Dist())
    dtype = dtype_name(resolve_target_dtype(options.dtype, device))
    sets = load_prompt_sets(options, target)
    results = measure_prompt_sets(options, sets, str(device), dtype, block_size)
    append_eval_run(options.out, eval_run_record("eval_only", options, results, str(device), dtype, argv))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results
