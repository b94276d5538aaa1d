"""Kernel-level profile of prefill/extend, eager vs piecewise CUDA graphs (DFlash on: FULL aux capture), on 8B shapes
or SmolLM2-135M shapes with the shipped draft (`--shape smollm2`: serving's extend steps of ~23 prompts x 128 tokens
take ~15 ms there against a ~1.8 ms cycle, issue 18: try `--cases 23x2944 1x128`; TOKENS is the case's total).
A case `BATCHxTOKENS+CACHED` gives each request CACHED tokens already in the KV cache ahead of its new ones, as
after a prefix-cache hit (issue 20's (b) on the demo pair: `--shape smollm2 --cases 31x682+4110 1x4110`).

For each (batch, tokens) case prints the wall time, the summed kernel time and the top kernels, so the gap between
the two paths (copies, launches, host time) can be attributed; and the wall time of the worker's whole extend (the
scheduler's extend step without the scheduler: batch building, forward, draft KV, first tokens).

`--host-loop-s S` then runs each case's whole extend for S s eagerly and S s on the piecewise graphs, in the functions
`host_loop_eager` / `host_loop_piecewise`: run the script under `py-spy record --format raw` and summarise with
`serving_profile.py FILE --focus host_loop_piecewise` to see where the host time of an extend goes.

`--graph-extend-splits N [N ...]` sets the most key splits of the attention inside the piecewise graphs
(GraphExtendAttention, the engine's `piecewise_attention_max_splits`); with several values the graphs are captured
once per value and every piecewise measurement runs once per value, so one run compares them: e.g. the cache-hit
extend unsplit vs split, `--shape smollm2 --cases 31x682+4110 --graph-extend-splits 1 4 8`."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec import Engine
from blockspec.config.engine_config import EngineConfig
from blockspec.runner.piecewise_graph import PiecewiseGraphRunner
from device_timing import cuda_ms
from extend_host_split import host_split
from prefill_latency import extend_ms, make_reqs, release, rewind
from serving_vs_engine_support import materialise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=["1x16", "1x256", "8x2048"],
                        help="BATCHxTOKENS or BATCHxTOKENS+CACHED (TOKENS new in all, CACHED per request)")
    parser.add_argument("--shape", choices=("llama8b", "smollm2"), default="llama8b")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--host-split", type=int, default=0, help="then N whole extends per case and path, host "
                        "time per part (extend_host_split.py)")
    parser.add_argument("--host-loop-s", type=float, default=0.0, help="then S s of whole extends per case and path")
    parser.add_argument("--trace-dir", type=Path, help="also write a Chrome trace (CPU + CUDA) per piecewise case")
    parser.add_argument("--piecewise-eager-attention", action="store_true", help="the serve flag: attention eager "
                        "between the piecewise graphs (default: one graph per bucket, attentions included)")
    parser.add_argument("--graph-extend-splits", type=int, nargs="+",
                        default=[EngineConfig.piecewise_attention_max_splits], metavar="N",
                        help="most key splits of the attention inside the piecewise graphs (serve's "
                        "--piecewise-attention-max-splits); several values: graphs captured once per value, every "
                        "piecewise measurement made once per value (default: serve's default; 1: unsplit)")
    args = parser.parse_args()
    if min(args.graph_extend_splits) < 1:
        parser.error("--graph-extend-splits: values must be >= 1")
    if args.piecewise_eager_attention and len(args.graph_extend_splits) > 1:
        parser.error("--graph-extend-splits: attention is not in the graphs with --piecewise-eager-attention")
    cases = [parse_case(case) for case in args.cases]
    pool_tokens = max(65536, *(b * (t // b + c) + 4096 for b, t, c in cases))  # NOTE: one case's requests at a time
    with tempfile.TemporaryDirectory() as tmp:
        shape = materialise(args.shape, Path(tmp), None, None)
        target_dir, draft_dir = shape.target, shape.draft
        engine = Engine(model_path=str(target_dir), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=pool_tokens, chunked_prefill_size=8192, cuda_graph_bs=[1],
                        enforce_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=max(t for _, t, _ in cases),
                        speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                        piecewise_eager_attention=args.piecewise_eager_attention,
                        piecewise_attention_max_splits=args.graph_extend_splits[0])
        variants = piecewise_variants(engine, args.graph_extend_splits)
        for bs, tokens, cached in cases:
            name = f"{bs} x {tokens} tokens" + (f" after {cached} cached each" if cached else "")
            case = f"{bs}x{tokens}" + (f"+{cached}" if cached else "")
            for label, runner_piecewise in (("eager", None), *variants.items()):
                engine.runner.piecewise = runner_piecewise
                wall = extend_ms(engine, bs, tokens, 5, cached)
                activities = [ProfilerActivity.CUDA]
                if args.trace_dir and runner_piecewise is not None:
                    activities.append(ProfilerActivity.CPU)
                with profile(activities=activities) as prof:
                    extend_ms(engine, bs, tokens, 3, cached)
                    torch.cuda.synchronize()
                if ProfilerActivity.CPU in activities:
                    args.trace_dir.mkdir(parents=True, exist_ok=True)
                    prof.export_chrome_trace(str(args.trace_dir / f"prefill_{label}_{case}.json"))
                events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
                total = sum(e.device_time_total for e in events) / 3 / 1e3
                print(f"==== bs {name}, {label}: wall {wall:.2f} ms, kernels {total:.2f} ms ====")
                for e in events[: args.top]:
                    print(f"{e.device_time_total / 3 / 1e3:8.3f} ms  {e.count // 3:5d}x  {e.key[:90]}")
        for bs, tokens, cached in cases:
            reqs = make_reqs(engine, bs, tokens, cached)
            for label, piecewise in variants.items():
                engine.runner.piecewise = piecewise
                ms = cuda_ms(lambda: whole_extend(engine, reqs, cached), 10)
                print(f"==== bs {bs} x {tokens} tokens (+{cached} cached each), {label}: the worker's whole extend "
                      f"{ms:.2f} ms ====")
            if args.host_split > 0:
                for label, runner_piecewise in (("eager", None), *variants.items()):
                    engine.runner.piecewise = runner_piecewise
                    split = host_split(engine, reqs, args.host_split, cached)
                    print(f"     host us per part, {label}: " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()))
            if args.host_loop_s > 0:
                engine.runner.piecewise = None
                loops = [f"{1e3 * args.host_loop_s / host_loop_eager(engine, reqs, args.host_loop_s, cached):.2f} "
                         "ms eager"]
                for label, piecewise in variants.items():
                    engine.runner.piecewise = piecewise
                    count = host_loop_piecewise(engine, reqs, args.host_loop_s, cached)
                    loops.append(f"{1e3 * args.host_loop_s / count:.2f} ms {label}")
                print("     host loops per extend: " + ", ".join(loops))
            release(engine, reqs)
        engine.runner.piecewise = variants[next(iter(variants))]
        engine.shutdown()


def piecewise_variants(engine: Engine, max_splits: list[int]) -> dict[str, PiecewiseGraphRunner]:
    """The engine's piecewise graphs (captured with max_splits[0]) and, for each further value, graphs captured
    again with that many splits at most, by label (also in trace file names): "piecewise", or "piecewise_splitsN"
    when several are compared."""
    runner = engine.runner
    first = runner.piecewise
    assert first is not None, "the engine captured no piecewise graphs"
    if len(max_splits) == 1:
        return {"piecewise": first}
    variants = {f"piecewise_splits{max_splits[0]}": first}
    for splits in max_splits[1:]:
        runner.config.piecewise_attention_max_splits = splits
        runner.capture_piecewise(first.aux_consumer)  # NOTE: replaces runner.piecewise; the graphs share one pool
        assert runner.piecewise is not None
        variants[f"piecewise_splits{splits}"] = runner.piecewise
    runner.config.piecewise_attention_max_splits = max_splits[0]
    runner.piecewise = first
    return variants


def parse_case(case: str) -> tuple[int, int, int]:
    """"BATCHxTOKENS" or "BATCHxTOKENS+CACHED" as (batch, tokens, cached)."""
    try:
        shape, _, cached = case.partition("+")
        batch, tokens = shape.split("x")
        parsed = int(batch), int(tokens), int(cached or 0)
    except ValueError:
        raise SystemExit(f"--cases: {case!r} is not BATCHxTOKENS or BATCHxTOKENS+CACHED") from None
    if parsed[0] < 1 or parsed[1] < parsed[0] or parsed[2] < 0:
        raise SystemExit(f"--cases: {case!r} needs BATCH >= 1, TOKENS >= BATCH, CACHED >= 0")
    return parsed


def host_loop_eager(engine: Engine, reqs: list, seconds: float, cached: int = 0) -> int:
    return _loop(engine, reqs, seconds, cached)


def host_loop_piecewise(engine: Engine, reqs: list, seconds: float, cached: int = 0) -> int:
    return _loop(engine, reqs, seconds, cached)


def _loop(engine: Engine, reqs: list, seconds: float, cached: int) -> int:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        whole_extend(engine, reqs, cached)
        count += 1
    torch.cuda.synchronize()
    return count


def whole_extend(engine: Engine, reqs: list, cached: int = 0) -> None:
    engine.worker.extend(reqs, rewind(reqs, cached))


if __name__ == "__main__":
    main()
