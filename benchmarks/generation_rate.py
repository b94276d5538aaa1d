"""Offline generation throughput at wide batches (#24's data stage: the target's training responses and Magpie
prompts are generated 256 requests at a time, ≈ 40–50 responses a second on an H200 for a 135M target, far below
what its 64-row serving steps suggest).

Each variant is one Engine (dummy weights of a shape's config, greedy unless it says otherwise) fed a stream of
random prompts through `generate_iter`, as `blockspec train-draft` feeds it: a warm-up until `running` requests have
finished, then `--seconds` of measurement, counting the output tokens of the requests that finish and the
scheduler's steps (all, extend steps, and their wall time). One variant can run under cProfile (host functions by
own time) and torch.profiler (device kernels by total time), printed as short tables.

    python -m benchmarks.generation_rate --out benchmarks/results [--variants base,no_radix] [--profile base]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.serving_vs_engine_support import SMOLLM2, TINY
from blockspec import Engine
from blockspec.bench.provenance import run_identity
from blockspec.train.response_workers import generation_engine_flags, wide_graph_bs

SHAPES = {"smollm2": SMOLLM2, "tiny": dict(TINY, max_position_embeddings=2048)}


@dataclass(frozen=True)
class Variant:
    name: str
    running: int = 256
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0})


VARIANTS = {v.name: v for v in (
    Variant("base"),  # train-draft's response engine before 2026-12-04 (radix cache on, extends eager)
    Variant("running64", running=64),
    Variant("no_radix", engine={"disable_radix_cache": True}),
    Variant("no_radix_piecewise", engine={"disable_radix_cache": True, "enforce_piecewise_cuda_graph": True}),
    Variant("no_radix_piecewise_wait4", engine={"disable_radix_cache": True, "enforce_piecewise_cuda_graph": True,
                                                "max_prefill_wait_steps": 4}),
    Variant("no_radix_piecewise_512", running=512,
            engine={"disable_radix_cache": True, "enforce_piecewise_cuda_graph": True}),
    Variant("sampled", sampling={"temperature": 1.0, "top_p": 0.95}),  # Magpie's settings
    Variant("generation_engine", engine=generation_engine_flags(256)),  # train-draft's since 2026-12-04
    Variant("generation_engine_sampled", engine=generation_engine_flags(256),
            sampling={"temperature": 1.0, "top_p": 0.95}),
)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for generation_rate_<date>_<commit>.json")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured wall time per variant")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(60, 250), metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=(100, 384), metavar=("MIN", "MAX"),
                        help="each request's max_new_tokens (EOS ignored), uniform in this range")
    parser.add_argument("--profile", default="", help="a variant to run under cProfile and torch.profiler")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    return parser


def make_engine(model_dir: Path, variant: Variant, args: argparse.Namespace) -> Engine:
    longest = args.prompt_len[1] + args.new_tokens[1] + 1
    engine = {"max_running_requests": variant.running, "cuda_graph_bs": wide_graph_bs(variant.running),
              **variant.engine}
    return Engine(model_path=str(model_dir), load_format="dummy", device=args.device, dtype=args.dtype,
                  skip_tokenizer_init=True, max_total_tokens=variant.running * longest, context_length=longest + 1,
                  **engine)


def request_stream(args: argparse.Namespace, vocab: int, count: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))] for _ in range(count)]
    lengths = [rng.randint(*args.new_tokens) for _ in range(count)]
    return prompts, [{"max_new_tokens": n, "ignore_eos": True} for n in lengths]


def measure(engine: Engine, variant: Variant, args: argparse.Namespace, vocab: int,
            profiler: Optional[cProfile.Profile]) -> dict[str, Any]:
    """Tokens a second over `args.seconds` after `variant.running` requests have finished (a full, mixed batch)."""
    prompts, params = request_stream(args, vocab, 40 * variant.running)
    params = [dict(p, **variant.sampling) for p in params]
    scheduler = engine.scheduler
    finished, tokens, started = 0, 0, None
    before: dict[str, float] = {}
    stream = engine.generate_iter(prompts, params)
    for _, output in stream:
        finished += 1
        if started is None:
            if finished < variant.running:
                continue
            started = time.perf_counter()
            before = {"steps": scheduler.num_steps, "extends": scheduler.num_extend_steps,
                      "step_s": scheduler.step_seconds, "extend_s": scheduler.extend_step_seconds, "done": finished}
            if profiler is not None:
                profiler.enable()
            continue
        tokens += len(output["output_ids"])
        if time.perf_counter() - started >= args.seconds:
            break
    wall = time.perf_counter() - (started or time.perf_counter())
    if profiler is not None:
        profiler.disable()
    stream.close()
    steps = scheduler.num_steps - before.get("steps", 0)
    extends = scheduler.num_extend_steps - before.get("extends", 0)
    step_s = scheduler.step_seconds - before.get("step_s", 0.0)
    extend_s = scheduler.extend_step_seconds - before.get("extend_s", 0.0)
    responses = finished - int(before.get("done", 0)) - 1
    return {
        "variant": variant.name, "running": variant.running, "engine": variant.engine, "sampling": variant.sampling,
        "seconds": round(wall, 2), "responses": responses, "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "responses_per_s": round(responses / wall, 2) if wall else None,
        "steps": steps, "extend_steps": extends,
        "step_ms": round(1e3 * step_s / steps, 3) if steps else None,
        "extend_step_ms": round(1e3 * extend_s / extends, 3) if extends else None,
        "decode_step_ms": round(1e3 * (step_s - extend_s) / (steps - extends), 3) if steps > extends else None,
        "between_steps_ms": round(1e3 * (wall - step_s) / steps, 3) if steps else None,
    }


def kernel_table(engine: Engine, variant: Variant, args: argparse.Namespace, vocab: int) -> str:
    """The device kernels of ≈ 2 s of steady generation, by total device time."""
    from torch.profiler import ProfilerActivity, profile

    brief = argparse.Namespace(**{**vars(args), "seconds": 2.0})
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        measure(engine, variant, brief, vocab, None)
    key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60)


def run_variant(model_dir: Path, variant: Variant, args: argparse.Namespace, vocab: int, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    engine = make_engine(model_dir, variant, args)
    startup = time.perf_counter() - started
    try:
        profiler = cProfile.Profile() if variant.name == args.profile else None
        row = measure(engine, variant, args, vocab, profiler)
        row["startup_s"] = round(startup, 1)
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            (out / f"generation_rate_{variant.name}_host.txt").write_text(text.getvalue())
            kernels = kernel_table(engine, variant, args, vocab)
            (out / f"generation_rate_{variant.name}_kernels.txt").write_text(kernels)
            print(text.getvalue()[-6000:], "\n", kernels, flush=True)
    finally:
        engine.shutdown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names + ([args.profile] if args.profile else []) if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    config = SHAPES[args.shape]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.shape
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        for name in names:
            row = run_variant(model_dir, VARIANTS[name], args, int(config["vocab_size"]), args.out)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("variant", "tokens_per_s", "responses_per_s", "steps", "extend_steps",
                                                  "step_ms", "decode_step_ms", "extend_step_ms", "between_steps_ms",
                                                  "startup_s")}), flush=True)
    identity = run_identity()
    report = {**identity, "shape": args.shape, "device": args.device, "dtype": args.dtype,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "rows": rows}
    path = args.out / f"generation_rate_{identity['date']}_{identity['commit']}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    from benchmarks.plots import plot_generation_rate  # NOTE: here: matplotlib only where a plot is drawn

    print(f"wrote {path} and {plot_generation_rate(report, path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
