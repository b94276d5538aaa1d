"""Where a `blockspec train-draft` step's time goes (issue 24: the recipe's training is bound by steps per wall-time
minute; the H200 ran 0.073 s per step at 46a0634, well above what its FLOPs need).

SmolLM2-135M shapes with dummy weights (config.json alone, no GGUF) and the recipe's draft (5 layers, taps [1, 8, 15,
22, 28], block 16), synthetic sequences of the recipe's lengths, the recipe's batch (32 sequences x 32 anchored
blocks) and cached target features (every sequence's, before the first timed step). Prints and writes (JSON,
`--out`): the whole `Trainer.step` time, its phases (extracting a batch's target features, as every step of the
first epoch does; batch building, forward + loss, backward, optimiser) each synchronised, and the top kernels of a
few steps.

    python benchmarks/profile_train_step.py --out benchmarks/results      (CUDA; --device cpu --smoke on a CPU)"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from blockspec.bench.provenance import run_identity
from blockspec.train.blocks import block_loss, build_block_batch, sample_anchors
from blockspec.train.data import Sample
from blockspec.train.features import TargetFeatures
from blockspec.train.model import DraftArch, TrainableDraft
from blockspec.train.options import TrainOptions
from blockspec.train.trainer import Dist, Trainer
from serving_vs_engine_support import materialise

RECIPE_TAPS = [1, 8, 15, 22, 28]


def synthetic_samples(count: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                      seed: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)

    def length(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=generator))

    return [Sample(i, torch.randint(3, vocab, (length(prompt_range),), generator=generator).tolist(),
                   torch.randint(3, vocab, (length(output_range),), generator=generator).tolist()) for i in range(count)]


def synced_ms(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3, value


def phase_times(trainer: Trainer, indices: list[int]) -> dict[str, float]:
    """Trainer.step's work, phase by phase, each synchronised (their sum exceeds the step by the syncs)."""
    opts, device = trainer.options, trainer.device
    chosen = [trainer.samples[i] for i in indices]
    extract_ms, _ = synced_ms(device, lambda: trainer.target([s.ids for s in chosen]))  # NOTE: a first epoch's cost
    features = trainer.features(indices)
    anchors = [sample_anchors(len(s.prompt_ids), len(s.ids), opts.blocks_per_seq, trainer.generator) for s in chosen]
    build_ms, batch = synced_ms(device, lambda: build_block_batch(
        [s.ids for s in chosen], features, anchors, opts.block_size, trainer.mask_token_id, device,
        trainer.context_multiple))

    def forward() -> Any:
        embeds = nn.functional.embedding(batch.block_ids, trainer.target.embed_weight).flatten(1, 2)
        with trainer._autocast():
            hidden = trainer.model(embeds, batch.positions, batch.features, batch.mask)
            return block_loss(hidden, batch, trainer.target.lm_head_weight, trainer.weights)

    forward_ms, result = synced_ms(device, forward)
    trainer.optimizer.zero_grad(set_to_none=True)
    backward_ms, _ = synced_ms(device, lambda: result.loss.backward())
    optimizer_ms, _ = synced_ms(device, trainer.optimizer.step)
    return {"extract_features_ms": extract_ms, "build_batch_ms": build_ms, "forward_and_loss_ms": forward_ms, "backward_ms": backward_ms,
            "optimizer_ms": optimizer_ms, "context_tokens": batch.features.shape[1]}


def top_kernels(trainer: Trainer, order: Iterator[list[int]], steps: int, top: int) -> list[dict[str, Any]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.step(next(order))
    cuda = trainer.device.type == "cuda"
    events = [e for e in prof.key_averages() if (e.device_time_total if cuda else e.self_cpu_time_total) > 0]
    events.sort(key=lambda e: e.device_time_total if cuda else e.self_cpu_time_total, reverse=True)
    return [{"name": e.key[:90], "calls": e.count,
             "ms_per_step": (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3 / steps}
            for e in events[:top]]


def random_batches(num_samples: int, batch_size: int) -> Iterator[list[int]]:
    generator = torch.Generator().manual_seed(1)
    while True:
        yield torch.randperm(num_samples, generator=generator)[:batch_size].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    parser.add_argument("--sequences", type=int, default=256, help="distinct synthetic sequences (features cached)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--blocks-per-seq", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=5)
    parser.add_argument("--compile-draft", action="store_true", help="train-draft --compile-draft (warm-up compiles)")
    parser.add_argument("--feature-backend", default="auto", help="the target's attention backend for features "
                        "(auto: Triton on CUDA, as train-draft; torch: the padded dense one train-draft used before)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, help="folder for profile_train_step_<date>_<commit>[_<tag>].json")
    parser.add_argument("--tag", default="", help="file-name suffix, so several runs of one commit keep their files")
    args = parser.parse_args()
    if args.smoke:
        args.sequences, args.batch_size, args.blocks_per_seq = min(args.sequences, 16), 4, 8
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt_range, output_range = ((20, 40), (30, 60)) if args.smoke else ((40, 400), (60, 384))
    with tempfile.TemporaryDirectory() as tmp:
        shape = materialise("tiny" if args.smoke else "smollm2", Path(tmp), None, None)
        taps = [1, 2, 3] if args.smoke else RECIPE_TAPS
        target = TargetFeatures(shape.target, taps, device, dtype, 2048, dummy=True,
                                attention_backend=args.feature_backend)
        options = TrainOptions(target_model_path=str(shape.target), data="", out="", num_layers=args.num_layers,
                               batch_size=args.batch_size, blocks_per_seq=args.blocks_per_seq, cache_features=True,
                               compile_draft=args.compile_draft)
        arch = DraftArch.from_target(target.target_config, args.num_layers, len(taps), None)
        samples = synthetic_samples(args.sequences, shape.vocab_size, prompt_range, output_range, seed=0)
        trainer = Trainer(options, TrainableDraft(arch), target, samples, 16 % shape.vocab_size, device, Dist())
        for start in range(0, len(trainer.samples), args.batch_size):  # NOTE: timed steps run on cached features
            trainer.features(list(range(start, min(start + args.batch_size, len(trainer.samples)))))
        order = random_batches(len(trainer.samples), args.batch_size)
        warmup_started = time.perf_counter()
        for _ in range(8 if args.compile_draft else 3):  # NOTE: a dynamic-shape compile may recompile once
            trainer.step(next(order))
        warmup_s = time.perf_counter() - warmup_started
        step_times = [synced_ms(device, lambda: trainer.step(next(order)))[0] for _ in range(args.steps)]
        phases = [phase_times(trainer, next(order)) for _ in range(max(3, args.steps // 3))]
        kernels = top_kernels(trainer, order, args.profile_steps, args.top)
    median = sorted(step_times)[len(step_times) // 2]
    phase_median = {k: sorted(p[k] for p in phases)[len(phases) // 2] for k in phases[0]}
    report = {**run_identity(), "shape": "tiny" if args.smoke else "smollm2", "num_layers": args.num_layers,
              "feature_backend": target.attention_backend, "compile_draft": args.compile_draft,
              "compile_fallback": trainer.compile_fallback,
              "batch_size": args.batch_size, "blocks_per_seq": args.blocks_per_seq, "warmup_s": warmup_s,
              "step_ms_median": median, "step_ms_mean": sum(step_times) / len(step_times), "step_ms_all": step_times,
              "phases_ms_median": phase_median, "top_kernels": kernels}
    print(f"step {median:.1f} ms (median of {len(step_times)}); phases: "
          + ", ".join(f"{k} {v:.1f}" for k, v in phase_median.items()))
    for k in kernels:
        print(f"  {k['ms_per_step']:8.3f} ms/step {k['calls']:6d}x  {k['name']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = f"_{args.tag}" if args.tag else ""
        path = args.out / f"profile_train_step_{report['date']}_{report['commit']}{tag}.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
