"""`blockspec train-draft` end to end: prompts → target responses (cached) → DFlash training → z-lab
checkpoint."""

from __future__ import annotations

import datetime
import gc
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from blockspec.models.config import TargetConfig, load_json, load_target_config
from blockspec.models.draft_config import DFlash2Fields, parse_dflash2_fields
from blockspec.train.checkpoint import draft_config_dict, load_trainable_draft, save_draft, write_json
from blockspec.train.devices import dtype_name, init_distributed, resolve_device, resolve_target_dtype
from blockspec.train.data import (
    ResponseCache, Sample, default_mask_token_id, encode_prompt, generate_responses, maybe_load_tokenizer,
    mix_counts, mix_records, read_prompt_records, reject_heldout,
)
from blockspec.train.eval_sets import PromptSet, eval_run_record, load_prompt_sets, measure_prompt_sets
from blockspec.train.evaluate import measure_acceptance
from blockspec.train.features import TargetFeatures
from blockspec.train.info import git_commit
from blockspec.train.model import DraftArch, TrainableDraft
from blockspec.train.options import TrainOptions, resolve_layer_ids
from blockspec.train.response_workers import generate_in_workers, response_engine_factory
from blockspec.train.trainer import Dist, TrainResult, Trainer

logger = logging.getLogger(__name__)


def held_out_count(requested: int, available: int) -> int:
    """The prompts of --data held out for evals: as many as asked while some are left to train on, else half."""
    return requested if requested < available else available // 2


def _prompts(options: TrainOptions, target: TargetConfig) -> tuple[list[list[int]], list[list[int]], Any]:
    """(training prompts, held-out eval prompts, tokenizer or None); prompts too long to train on are dropped."""
    records = read_prompt_records(options.data, options.num_prompts)
    reject_heldout(records, options.data)
    eval_records: list[dict[str, Any]] = []
    if options.num_eval_prompts and options.eval_data:
        eval_records = read_prompt_records(options.eval_data, options.num_eval_prompts)
    elif options.num_eval_prompts:
        held_out = held_out_count(options.num_eval_prompts, len(records))
        if held_out < options.num_eval_prompts:
            logger.warning("--num-eval-prompts %d: --data holds only %d prompts; holding out half of them (%d) for "
                           "evals (pass --eval-data for more)", options.num_eval_prompts, len(records), held_out)
        if held_out:
            records, eval_records = records[:-held_out], records[-held_out:]
    if options.mix_data is not None:
        extra = read_prompt_records(options.mix_data)
        reject_heldout(extra, options.mix_data)
        keep_main, keep_extra = mix_counts(len(records), len(extra), options.mix_ratio)
        logger.info("training prompts: %d of %d from --data, %d of %d from --mix-data", keep_main, len(records),
                    keep_extra, len(extra))
        records = mix_records(records, extra, options.mix_ratio)
    tokenizer = maybe_load_tokenizer(options.target_model_path, records + eval_records)
    encode = lambda r: encode_prompt(r, tokenizer, options.system_prompt, options.user_suffix)  # noqa: E731
    limit = min(options.max_seq_len, target.max_position_embeddings) - 2
    prompts = [encode(r) for r in records]
    kept = [p for p in prompts if len(p) <= limit]
    if len(kept) < len(prompts):
        logger.warning("dropped %d prompt(s) longer than %d tokens", len(prompts) - len(kept), limit)
    if not kept:
        raise ValueError(f"every prompt is longer than {limit} tokens (--max-seq-len {options.max_seq_len})")
    return kept, [p for p in map(encode, eval_records) if len(p) <= limit], tokenizer


def _build_draft(
    options: TrainOptions, target: TargetConfig, layer_ids: list[int], tokenizer: Any, used: set[int]
) -> tuple[TrainableDraft, list[int], int]:
    """A fresh draft, or --init-from's (whose taps and mask token then hold unless given explicitly). A DFlash draft
    with --draft-arch dflash2 grows into a DFlash2 draft that proposes what it did (TrainableDraft.dflash2_from)."""
    mask_token_id = options.mask_token_id
    if options.init_from is not None:
        draft, init_ids, init_block = load_trainable_draft(options.init_from, target)
        if init_block != options.block_size:
            raise ValueError(f"--init-from {options.init_from} drafts blocks of {init_block}, not --block-size "
                             f"{options.block_size}")
        if draft.arch.dflash2 is None and options.draft_arch == "dflash2":
            fields = dflash2_fields(options, target)
            assert fields is not None
            draft = TrainableDraft.dflash2_from(draft, fields)
        elif (draft.arch.dflash2 is not None) != (options.draft_arch == "dflash2"):
            raise ValueError(f"--init-from {options.init_from} is not a --draft-arch {options.draft_arch} draft")
        if options.target_layer_ids is not None and init_ids != layer_ids:
            raise ValueError(
                f"--init-from {options.init_from} taps layers {init_ids}, not --target-layer-ids {layer_ids}"
            )
        if mask_token_id is None:
            mask_token_id = int(load_json(Path(options.init_from) / "config.json")["dflash_config"]["mask_token_id"])
        return draft, init_ids, mask_token_id
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(tokenizer, target.vocab_size, used)
    elif mask_token_id in used:
        logger.warning("--mask-token-id %d occurs in the training data", mask_token_id)
    arch = DraftArch.from_target(target, options.num_layers, len(layer_ids), options.intermediate_size,
                                 dflash2_fields(options, target), options.block_size)
    torch.manual_seed(options.seed)
    return TrainableDraft(arch), layer_ids, mask_token_id


def dflash2_fields(options: TrainOptions, target: TargetConfig) -> Optional[DFlash2Fields]:
    """--draft-arch dflash2's convolution and selector sizes, checked against the target as a checkpoint's are."""
    if options.draft_arch != "dflash2":
        return None
    return parse_dflash2_fields({
        "architectures": ["DFlash2DraftModel"], "conv_kernel_size": options.conv_kernel_size,
        "conv_group_size": options.conv_group_size, "selector_rank": options.selector_rank,
        "selector_top_k": options.selector_top_k,
    }, target, target.hidden_size)


@dataclass
class Prepared:
    """What training needs once the target's responses are cached: one per rank."""
    target: TargetConfig
    layer_ids: list[int]
    dist: Dist
    device: torch.device
    dtype: torch.dtype
    samples: list[Sample]
    generated: int
    eval_prompts: list[list[int]]
    prompt_sets: list[PromptSet]
    tokenizer: Any


def prepare(options: TrainOptions) -> Prepared:
    """Validates everything, reads the prompts (and --eval-prompts sets, so a bad file fails before any work) and
    generates the responses the cache lacks."""
    options.validate()
    target = load_target_config(options.target_model_path)
    layer_ids = resolve_layer_ids(options, target)
    if options.mask_token_id is not None and not 0 <= options.mask_token_id < target.vocab_size:
        raise ValueError(
            f"--mask-token-id {options.mask_token_id} is outside the target vocabulary [0, {target.vocab_size})"
        )
    dist = init_distributed(options.device)
    device = resolve_device(options.device, dist)
    dtype = resolve_target_dtype(options.dtype, device)
    prompts, eval_prompts, tokenizer = _prompts(options, target)
    prompt_sets = load_prompt_sets(options, target, tokenizer) if options.eval_prompts else []
    meta = {
        "target_model_path": str(Path(options.target_model_path).resolve()),
        "max_new_tokens": options.max_new_tokens, "ignore_eos": options.ignore_eos, "dtype": dtype_name(dtype),
    }
    cache = ResponseCache(options.cache_path, meta, dist.rank)
    by_workers = 0
    if options.gen_workers > 1:
        cache.check_meta()  # NOTE: before the workers: they must not race to write it
        by_workers = generate_in_workers(options, prompts, meta, device, dtype, dist.rank, dist.world)
    samples, generated = generate_responses(
        prompts,
        cache,
        response_engine_factory(options, device, dtype, max(map(len, prompts))),
        options.max_new_tokens,
        options.ignore_eos,
        options.gen_batch_size,
        dist.rank,
        dist.world,
        dist.barrier,
        options.progress and dist.is_main,
    )
    gc.collect()  # NOTE: the generation engine's KV pool and graphs must be gone before training allocates
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Prepared(target, layer_ids, dist, device, dtype, samples, generated + by_workers, eval_prompts, prompt_sets,
                    tokenizer)


def _finish_distributed(dist: Dist) -> None:
    dist.barrier()
    if dist.world > 1:
        torch.distributed.destroy_process_group()


def cache_responses(options: TrainOptions) -> tuple[int, int]:
    """--responses-only: (responses cached in all, generated by this run)."""
    prepared = prepare(options)
    _finish_distributed(prepared.dist)
    return len(prepared.samples), prepared.generated


def run(options: TrainOptions, argv: Optional[Sequence[str]] = None) -> TrainResult:
    started = time.time()
    p = prepare(options)
    target, device, dtype, dist, eval_prompts = p.target, p.device, p.dtype, p.dist, p.eval_prompts
    used = {t for s in p.samples for t in s.ids} | {t for q in eval_prompts for t in q}
    used |= {t for prompt_set in p.prompt_sets for q in prompt_set.prompts for t in q}
    draft, layer_ids, mask_token_id = _build_draft(options, target, p.layer_ids, p.tokenizer, used)
    config = draft_config_dict(draft.arch, target, layer_ids, options.block_size, mask_token_id, options.save_dtype)
    features = TargetFeatures(options.target_model_path, layer_ids, device, dtype, options.max_seq_len)
    trainer = Trainer(options, draft, features, p.samples, mask_token_id, device, dist)
    if dist.is_main:
        logger.info("training on %d sequences (%d responses generated now), taps %s, mask token %d",
                    len(trainer.samples), p.generated, layer_ids, mask_token_id)

    def evaluate(step: int) -> dict[str, Any]:
        save_draft(draft, options.out, config, options.save_dtype, options.max_shard_mb)
        if not eval_prompts:
            return {}
        return measure_acceptance(
            options.target_model_path, options.out, eval_prompts, options.eval_max_new_tokens, str(device),
            dtype_name(dtype), options.ignore_eos, options.block_size, options.progress,
        )

    result = trainer.train(evaluate)
    if result.interrupted and dist.is_main:
        save_draft(draft, options.out, config, options.save_dtype, options.max_shard_mb)
    if dist.is_main:
        train_sequences = len(trainer.samples)
        del trainer, features  # NOTE: frees the feature cache before the eval engines allocate their KV pools
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eval_runs = []
        if p.prompt_sets and not result.interrupted:
            sets = measure_prompt_sets(options, p.prompt_sets, str(device), dtype_name(dtype), options.block_size)
            eval_runs.append(eval_run_record("after_training", options, sets, str(device), dtype_name(dtype), argv))
        info = {
            "command": ["blockspec", "train-draft", *argv] if argv is not None else None,
            "options": {k: v for k, v in vars(options).items()},
            "git_commit": git_commit(), "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "wall_s": round(time.time() - started, 1), "world_size": dist.world, "device": str(device),
            "target_layer_ids": layer_ids, "mask_token_id": mask_token_id, "train_sequences": train_sequences,
            "responses_generated": p.generated, "held_out_prompts": len(eval_prompts), "result": vars(result),
            "eval_runs": eval_runs,
        }
        write_json(Path(options.out) / "training_info.json", json.loads(json.dumps(info, default=str)))
    _finish_distributed(dist)
    return result
