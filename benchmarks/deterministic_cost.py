"""Cost of --enable-deterministic-inference (#22 part 3): step latency with the flag off and on, in the same run.

Llama-3.1-8B shapes (random bf16 weights) with the 5-layer DFlash draft of step_latency.py, Triton attention, full
CUDA graphs and piecewise graphs on (as served), a simulated accept length (--accept-len, adaptive verify off: the
full block). Per flag setting, batch size and context: the DFlash cycle (mean of back-to-back scheduler steps), its
greedy-cycle graph alone, verify and propose forwards, the target-only decode step, and one extend forward of
--prefill-tokens tokens per engine. Engines run one after another (flag off, then on). Writes
results/deterministic_cost_<date>_<commit>.json (rows, the on ÷ off ratios per shape) and the plot beside it; the
commit from --commit, $BLOCKSPEC_COMMIT or git. `--smoke`: tiny shapes on CPU in the Triton interpreter (needs
TRITON_INTERPRET=1 in the environment; tests/benchmarks/test_deterministic_cost_bench.py), timings meaningless.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.adaptive_verify import model_dirs, prefill, release, sync
from benchmarks.results import add_commit_argument, add_out_argument, plot_result, resolved_commit, write_json
from blockspec import Engine
from blockspec.batch import ForwardMode, build_batch
from blockspec.bench.provenance import commit_id

TIMED_KEYS = ("cycle_ms", "greedy_cycle_ms", "verify_ms", "propose_ms", "prefill_ms")


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of fn() in ms, synchronised around each call."""
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def steady_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Mean wall time of `repeat` back-to-back fn() calls (a decode loop in steady state)."""
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / repeat


def engine_flags(dirs: tuple[Path, Path], spec: bool, deterministic: bool, args: argparse.Namespace) -> dict[str, Any]:
    target, draft = dirs
    flags: dict[str, Any] = dict(
        model_path=str(target), load_format="dummy", skip_tokenizer_init=True, attention_backend="triton",
        max_running_requests=max(args.batch_sizes), max_total_tokens=max(args.batch_sizes) * (max(args.contexts) + 512)
        + args.prefill_tokens + 64, chunked_prefill_size=max(args.prefill_tokens, max(args.contexts)),
        enable_deterministic_inference=deterministic,
    )
    if args.smoke:
        flags.update(device="cpu", dtype="float16", triton_attention_split_tile_size=32 if deterministic else None)
    else:
        flags.update(dtype="bfloat16", cuda_graph_bs=args.batch_sizes, enforce_piecewise_cuda_graph=True)
    if spec:
        flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                     speculative_simulate_accept_len=args.accept_len, speculative_adaptive_verify="off")
    return {key: value for key, value in flags.items() if value is not None}


def measure_steps(engine: Engine, bs: int, context: int, repeat: int) -> dict[str, float]:
    worker = engine.worker
    reqs = prefill(engine, bs, context, engine.runner.target_config.vocab_size)
    engine.step()  # NOTE: warm-up, untimed
    result = {"cycle_ms": steady_ms(engine.scheduler.step, repeat)}
    engine.scheduler.drain()
    if worker.is_speculative:
        for req in reqs:
            engine.runner.allocator.grow(req, req.kv_len + worker.block_size, engine.runner.req_to_token)
        _, proposals, _ = worker.propose(reqs)
        result["verify_ms"] = median_ms(lambda: worker.verify(reqs, proposals), repeat)
        result["propose_ms"] = median_ms(lambda: worker.propose(reqs), repeat)
        result["greedy_cycle_ms"] = median_ms(lambda: worker.greedy_cycle_tokens(reqs), repeat)
    release(engine, reqs)
    return result


@torch.inference_mode()
def measure_prefill(engine: Engine, tokens: int, repeat: int) -> float:
    """One extend forward of `tokens` tokens (piecewise graphs when they take it), its KV rewritten in place."""
    (req,) = prefill(engine, 1, tokens + 1, engine.runner.target_config.vocab_size)
    runner = engine.runner
    batch = build_batch(ForwardMode.EXTEND, [req.all_ids[:tokens]], [0], [req.pool_row], runner.req_to_token.table,
                        [tokens - 1], runner.hidden_capture_layer_ids)
    worker = engine.worker
    elapsed = median_ms(lambda: worker.extend_forward(batch), repeat)
    release(engine, [req])
    return elapsed


def run(args: argparse.Namespace, root: Path, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every engine in turn (flag off, then on; target-only, then DFlash); `save` gets the rows after each."""
    dirs = model_dirs(root, args.smoke)
    rows: list[dict[str, Any]] = []
    for deterministic in (False, True):
        for spec in (False, True):
            started = time.perf_counter()
            engine = Engine(**engine_flags(dirs, spec, deterministic, args))
            startup_s = time.perf_counter() - started
            prefill_ms = measure_prefill(engine, args.prefill_tokens, args.repeat)
            for context in args.contexts:
                for bs in args.batch_sizes:
                    row = {"deterministic": deterministic, "spec": spec, "bs": bs, "context": context,
                           **measure_steps(engine, bs, context, args.repeat), "prefill_ms": prefill_ms,
                           "prefill_tokens": args.prefill_tokens, "startup_s": startup_s}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            save(rows)
    return rows


def cost_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (spec, bs, context): each timing with the flag on ÷ off (> 1: the mode costs that factor)."""
    off = {(r["spec"], r["bs"], r["context"]): r for r in rows if not r["deterministic"]}
    ratios = []
    for row in rows:
        base = off.get((row["spec"], row["bs"], row["context"]))
        if not row["deterministic"] or base is None:
            continue
        ratio = {"spec": row["spec"], "bs": row["bs"], "context": row["context"]}
        ratio.update({f"{key[:-3]}_on_over_off": row[key] / base[key]
                      for key in TIMED_KEYS if key in row and key in base})
        ratios.append(ratio)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--accept-len", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1), for tests")
    add_commit_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.batch_sizes, args.contexts, args.prefill_tokens, args.repeat = [1, 2], [40], 24, 2
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs the deterministic kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    commit = resolved_commit(args)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
        "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
        "shapes": "tiny (smoke)" if args.smoke else "Llama-3.1-8B + 5-layer DFlash draft, dummy bf16 weights",
        "accept_len": args.accept_len, "batch_sizes": args.batch_sizes, "contexts": args.contexts, "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"deterministic_cost_{report['date']}_{commit}.json"

    def save(rows: list[dict[str, Any]]) -> None:  # NOTE: after every engine, so a run cut short keeps its rows
        report["rows"], report["cost"] = rows, cost_ratios(rows)
        write_json(path, report)

    with tempfile.TemporaryDirectory() as tmp:
        run(args, Path(tmp), save)
    print(f"wrote {path}; {plot_result(path)}")
    for ratio in report["cost"]:
        print("cost:", ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in ratio.items()))


if __name__ == "__main__":
    main()
