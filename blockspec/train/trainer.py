"""The DFlash training loop: frozen target (features, embeddings, lm_head), trainable draft, AdamW + cosine.

Distributed when launched by torchrun (WORLD_SIZE set): DistributedDataParallel over the draft, each rank on its
own shard of every epoch's permutation; rank 0 evaluates and saves."""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.fx.experimental import _config as symbolic_shape_config
from tqdm import tqdm

from blockspec.train.blocks import (
    CONTEXT_MULTIPLE, BlockBatch, BlockLoss, block_loss, build_block_batch, loss_weights, sample_anchors,
)
from blockspec.train.data import Sample
from blockspec.train.feature_cache import GIB, FeatureCache
from blockspec.train.features import TargetFeatures
from blockspec.train.model import TrainableDraft
from blockspec.train.options import TrainOptions

log = logging.getLogger(__name__)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    final_accuracy: float
    final_accept_estimate: float
    seconds_per_step: float
    evals: list[dict[str, Any]] = field(default_factory=list)
    compile_fallback: Optional[dict[str, Any]] = None  # {"step", "error"} where --compile-draft gave way to eager
    interrupted: bool = False  # Ctrl-C stopped training after `steps` steps (the draft is saved, not evaluated)
    feature_cache: Optional[dict[str, int]] = None  # --cache-features: where the features were kept (FeatureCacheStats)


def gib_to_bytes(gib: Optional[float]) -> Optional[int]:
    return None if gib is None else int(gib * GIB)


def schedule_factor(progress: float, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup over the first `warmup_ratio` of training, then cosine from 1 to `min_ratio`; progress in
    [0, 1]."""
    if progress < warmup_ratio:
        return max(progress / warmup_ratio, 1e-3)
    rest = (progress - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, rest)))


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def batches(num_samples: int, batch_size: int, seed: int, dist: Dist) -> Iterator[list[int]]:
    """Endless epochs: one shared permutation per epoch, strided across ranks, cut into batches."""
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        mine = torch.randperm(num_samples, generator=generator)[dist.rank::dist.world].tolist()
        if not mine:
            raise ValueError("fewer training sequences than ranks")
        for start in range(0, len(mine), batch_size):
            yield mine[start:start + batch_size]
        epoch += 1


def trainable_samples(samples: list[Sample], max_seq_len: int) -> list[Sample]:
    """Sequences cut to max_seq_len that still hold at least one anchor (a response token with a label)."""
    kept = []
    for s in samples:
        room = max_seq_len - len(s.prompt_ids)
        if room >= 2 and len(s.output_ids) >= 2:
            kept.append(Sample(s.index, s.prompt_ids, s.output_ids[:room]))
    return kept


# NOTE: Inductor passes that fail on this model under dynamic shapes (CUDA, torch 2.11, H200, 2026-12-03): the
# coalesce tiling analysis asserted in get_pw_red_splits while compiling; the mix-order reduction (RMSNorm backward,
# dynamic since torch ≈ 2.10) compiled but its workspace view failed at run time on a new context length
# ("shape '[1632, 64]' is invalid for input of size 864"). Each is off where this torch has it.
UNSAFE_DYNAMIC_INDUCTOR_PASSES = ("triton.coalesce_tiling_analysis", "triton.mix_order_reduction")


def draft_inductor_options() -> Optional[dict[str, bool]]:
    """torch.compile options for the training draft: the passes above turned off, those this torch lacks skipped."""
    import torch._inductor.config as inductor_config

    present = [name for name in UNSAFE_DYNAMIC_INDUCTOR_PASSES
               if hasattr(getattr(inductor_config, name.split(".")[0]), name.split(".")[1])]
    return {name: False for name in present} or None


class Trainer:
    def __init__(
        self, options: TrainOptions, draft: TrainableDraft, target: TargetFeatures, samples: list[Sample],
        mask_token_id: int, device: torch.device, dist: Dist,
    ) -> None:
        self.options = options
        self.draft = draft.to(device)
        self.target = target
        self.samples = trainable_samples(samples, options.max_seq_len)
        if not self.samples:
            raise ValueError("no usable training sequences: every response is shorter than 2 tokens")
        self.mask_token_id = mask_token_id
        self.device = device
        self.dist = dist
        self.weights = loss_weights(options.block_size, options.decay).to(device)
        self.model: nn.Module = draft
        if dist.world > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(draft, device_ids=ids)
        self.eager_model = self.model
        self.compile_fallback: Optional[dict[str, Any]] = None
        self.steps_done = 0
        if options.compile_draft:
            # NOTE: only the training forward is compiled; checkpoints and evals use `draft` itself
            # type: ignore[assignment]
            self.model = torch.compile(self.model, dynamic=True, options=draft_inductor_options())
        self.optimizer = torch.optim.AdamW(
            draft.parameters(), lr=options.lr, weight_decay=options.weight_decay, betas=(0.9, 0.95)
        )
        # NOTE: --lr-schedule time spans --max-train-minutes instead of --steps: follow_time_schedule sets the rate
        self.scheduler: Optional[torch.optim.lr_scheduler.LambdaLR] = None
        if options.lr_schedule == "steps":
            schedule = lr_lambda(options.steps, options.warmup_ratio, options.min_lr_ratio)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.generator = torch.Generator().manual_seed(options.seed * 7919 + dist.rank)
        self.feature_cache: Optional[FeatureCache] = None
        if options.cache_features:
            self.feature_cache = FeatureCache(device, gib_to_bytes(options.feature_cache_device_gib),
                                              gib_to_bytes(options.feature_cache_host_gib))
            log.info("feature cache: up to %.1f GiB on %s, then up to %.1f GiB of host memory",
                     self.feature_cache.device_limit / GIB, device, self.feature_cache.host_limit / GIB)
        # NOTE: every new context length made cuDNN attention plan anew (≈ 150 ms on the H200: 9 of 30 profiled steps
        # at 4221e89); padded to multiples of 64 (masked out, same loss) a run meets at most max_seq_len / 64 shapes
        self.context_multiple = CONTEXT_MULTIPLE if device.type == "cuda" else 1

    def features(self, indices: list[int]) -> list[torch.Tensor]:
        if self.feature_cache is None:
            return self.target([self.samples[i].ids for i in indices])
        cache = self.feature_cache
        missing = [i for i in dict.fromkeys(indices) if i not in cache]
        computed = dict(zip(missing, self.target([self.samples[i].ids for i in missing]) if missing else []))
        for index, features in computed.items():
            cache.put(index, features)
        return [computed[i] if i in computed else cache.get(i) for i in indices]

    def _symbolic_shapes(self) -> contextlib.AbstractContextManager[Any]:
        """How a compiled draft's first call (and any recompile) traces its sizes: without duck sizing.

        NOTE: duck sizing gives sizes that happen to be equal one symbol, and a guard on one then holds for all. At
        8c3d65f (H100, DFlash2 demo draft) the first batch's padded context, 576, took the hidden size's symbol, which
        the weights fix: the context was compiled static and the next length compiled again; the block count took the
        sequence count's (both 32), so the epoch's last, smaller batch compiled a third time."""
        if self.model is self.eager_model:
            return contextlib.nullcontext()
        return symbolic_shape_config.patch(use_duck_shape=False)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda" and self.target.dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.target.dtype)
        return contextlib.nullcontext()

    def step(self, indices: list[int]) -> tuple[float, float, float]:
        """One optimiser step over the sequences `indices`: (loss, top-1 accuracy, teacher-forced τ estimate)."""
        opts = self.options
        chosen = [self.samples[i] for i in indices]
        sequences = [s.ids for s in chosen]
        features = self.features(indices)
        anchors = [sample_anchors(len(s.prompt_ids), len(s.ids), opts.blocks_per_seq, self.generator) for s in chosen]
        batch = build_block_batch(sequences, features, anchors, opts.block_size, self.mask_token_id, self.device,
                                  self.context_multiple)
        embeds = nn.functional.embedding(batch.block_ids, self.target.embed_weight).flatten(1, 2)
        self.draft.train()
        failure: Optional[str] = None
        try:
            result = self._loss_and_gradients(embeds, batch)
        except Exception as error:  # NOTE: Inductor and Triton raise many types; eager, OOM and multi-rank re-raise
            if self.model is self.eager_model or isinstance(error, torch.OutOfMemoryError) or self.dist.world > 1:
                raise  # NOTE: one DDP rank cannot rerun alone: its broadcasts and bucket all-reduces are half done
            failure = f"{type(error).__name__}: {error}"[:500]
        if failure is not None:  # NOTE: out of the except block, so the failed attempt's activations are freed
            self.model = self.eager_model
            self.compile_fallback = {"step": self.steps_done + 1, "error": failure}
            log.warning("--compile-draft: the compiled draft failed at step %d (%s); training on eagerly",
                        self.steps_done + 1, failure)
            result = self._loss_and_gradients(embeds, batch)  # NOTE: weights untouched so far; gradients reset
        if opts.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.draft.parameters(), opts.grad_clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps_done += 1
        return result.loss.item(), result.accuracy, result.accept_estimate

    def _loss_and_gradients(self, embeds: torch.Tensor, batch: BlockBatch) -> BlockLoss:
        """Forward, loss and backward through `self.model` (compiled or not); gradients replace the last step's."""
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast(), self._symbolic_shapes():
            hidden = self.model(embeds, batch.positions, batch.features, batch.mask)
            result = block_loss(hidden, batch, self.target.lm_head_weight, self.weights, self.draft.candidate_selector)
        result.loss.backward()
        return result

    def time_used(self, started: float) -> float:
        """The share of --max-train-minutes spent (0 without a limit); every rank takes rank 0's clock."""
        limit = self.options.max_train_minutes
        if limit is None:
            return 0.0
        used = torch.tensor([(time.perf_counter() - started) / (60.0 * limit)], device=self.device)
        if self.dist.world > 1:
            torch.distributed.broadcast(used, src=0)
        return float(used.item())

    def out_of_time(self, started: float) -> bool:
        """Whether --max-train-minutes has passed; every rank takes rank 0's answer so they stop together."""
        return self.options.max_train_minutes is not None and self.time_used(started) > 1.0

    def follow_time_schedule(self, started: float) -> None:
        factor = schedule_factor(self.time_used(started), self.options.warmup_ratio, self.options.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = self.options.lr * factor

    def train(self, evaluate: Optional[Callable[[int], dict[str, Any]]] = None) -> TrainResult:
        """Runs all steps (or until --max-train-minutes); `evaluate(step)` (rank 0) every `eval_every` steps and
        after the last one. Ctrl-C (KeyboardInterrupt) ends it early: the result then says `interrupted`, and the
        draft holds the weights of the last finished step (or of one an interrupted optimiser step half updated)."""
        opts = self.options
        train_started = time.perf_counter()
        order = batches(len(self.samples), opts.batch_size, opts.seed, self.dist)
        bar = tqdm(
            total=opts.steps, desc="training draft", unit="step", disable=not (opts.progress and self.dist.is_main)
        )
        smooth: list[float] = [math.nan] * 3  # running averages of (loss, accuracy, τ estimate)
        evals: list[dict[str, Any]] = []
        step_seconds = 0.0
        try:
            for step in range(1, opts.steps + 1):
                if opts.lr_schedule == "time":
                    self.follow_time_schedule(train_started)
                started = time.perf_counter()
                current = self.step(next(order))  # NOTE: .item() in step() syncs the device, so this times the step
                step_seconds += time.perf_counter() - started
                smooth = list(current) if step == 1 else [0.9 * s + 0.1 * c for s, c in zip(smooth, current)]
                bar.set_postfix(loss=f"{smooth[0]:.3f}", acc=f"{smooth[1]:.3f}", tau=f"{smooth[2]:.2f}",
                                lr=f"{self.optimizer.param_groups[0]['lr']:.2e}")
                bar.update(1)
                last = step == opts.steps or self.out_of_time(train_started)
                if last:
                    bar.close()  # NOTE: a bar left open would count the final evaluation's minutes as training
                if evaluate is not None and (last or (opts.eval_every and step % opts.eval_every == 0)):
                    if self.dist.is_main:
                        record = {"step": step, "loss": smooth[0], **evaluate(step)}
                        evals.append(record)
                        tqdm.write(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in record.items()))
                    self.dist.barrier()
                if last:
                    break
        except KeyboardInterrupt:
            bar.close()
            log.warning("interrupted after %d step(s): saving the draft as it stands", self.steps_done)
            return TrainResult(self.steps_done, smooth[0], smooth[1], smooth[2],
                               step_seconds / max(self.steps_done, 1), evals, self.compile_fallback, interrupted=True,
                               feature_cache=self.feature_cache_stats())
        bar.close()
        return TrainResult(step, smooth[0], smooth[1], smooth[2], step_seconds / step, evals, self.compile_fallback,
                           feature_cache=self.feature_cache_stats())

    def feature_cache_stats(self) -> Optional[dict[str, int]]:
        return None if self.feature_cache is None else self.feature_cache.stats.as_dict()
