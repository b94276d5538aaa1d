"""Radix prefix cache on vs off through the HTTP server (issue 20's benchmark).

Workloads (benchmarks/prefix_cache_workloads.py): (a) gsm8k: 5-shot GSM8K chats, (b) sysprompt: a ~4k-token shared
system prompt with 32 different questions, (c) multiturn: 4-turn chats. Shapes: `llama8b` (Llama-3.1-8B config +
5-layer draft, dummy weights, simulated accept length as in serving_vs_engine.py) and `demo` (SmolLM2-135M-Instruct
with real weights, --demo-model-dir, + the shipped DFlash draft, real acceptance); `tiny` is the CPU smoke shape
(--smoke); adaptive verify off (the whole block every cycle). One `python -m blockspec.serve` per shape and cache
setting (--disable-radix-cache for "off"); before each workload the server runs random prompts of the same lengths
(kernel warm-up) and POST /flush_cache, so every workload starts with a cold cache. Greedy decoding: both settings
produce the same tokens.

Rows: workload, shape, cache ("on"/"off"), tok_s (output tokens / wall time), ttft_p50_ms, ttft_p99_ms, accept_len
(the server's, over the workload's verifies), cache_hit_rate; each workload runs --repeats times per server (a cold
cache each time) and its row holds the medians, every sample's tok/s and TTFT kept. Goals: (b) TTFT p50 on ≤ 0.1 ×
off, (a) tok/s on ≥ 1.5 × off, accept length on = off within 1 %. Writes
benchmarks/results/prefix_cache_<date>_<commit>.json (+ PNG).
The device has no git: pass --commit (or BLOCKSPEC_COMMIT). Prompts need a ChatML tokenizer and GSM8K: build them
once with --save-workloads FILE where those are (--smoke for the small ones), and pass --workloads FILE on the device.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from benchmarks.prefix_cache_rows import describe, folded, goals, measured_row
from benchmarks.prefix_cache_workloads import SMOKE, Sizes, Workload, build_workloads, fit_ids, run_workload
from benchmarks.results import (
    add_commit_argument, add_out_argument, plot_result, resolved_commit, result_path, write_json,
)
from benchmarks.serving_profile import profile_server
from benchmarks.serving_server import ServerProcess, exit_on_sigterm, log_tail
from benchmarks.serving_vs_engine import extra_engine_kwargs, serve_flags
from benchmarks.serving_vs_engine_support import DEFAULT_ACCEPT, SMOLLM2_DRAFT, materialise
from blockspec.bench.provenance import commit_id
from blockspec.evals.client import get_server_info, metrics_text

SHAPES = ("llama8b", "demo", "tiny")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama8b,demo", help="comma-separated: llama8b, demo, tiny")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shape, tiny workloads")
    parser.add_argument("--workloads", type=Path, help="prompts saved by --save-workloads (else built now)")
    parser.add_argument("--only", default="", help="comma-separated workloads to run (gsm8k, sysprompt, multiturn; "
                        "default all)")
    parser.add_argument("--caches", default="off,on", help="comma-separated cache settings to serve (off, on)")
    parser.add_argument("--save-workloads", type=Path, help="write the prompts to this JSON, then exit")
    parser.add_argument("--tokenizer-path", type=Path, help="ChatML tokenizer (default: the demo model dir)")
    parser.add_argument("--gsm8k-path", type=Path, help="GSM8K test.jsonl (default: the eval's)")
    parser.add_argument("--demo-model-dir", type=Path, help="converted SmolLM2-135M-Instruct (default: make demo's)")
    parser.add_argument("--accept-len", type=float, default=DEFAULT_ACCEPT["llama8b"],
                        help="simulated accept length of the dummy shapes (<= 0: real acceptance)")
    parser.add_argument("--extra-flags", default="", help="more `blockspec serve` flags for every server, written "
                        "with '=', e.g. --extra-flags=\"--page-size 16\"")
    parser.add_argument("--eager-extend", action="store_true",
                        help="serve without --enforce-piecewise-cuda-graph (the documented serve command's extends run "
                             "as piecewise CUDA graphs; this benchmark serves the same unless told)")
    add_commit_argument(parser)
    parser.add_argument("--tag", default="")
    add_out_argument(parser)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-procs", type=int, default=4, help="client processes sharing each turn's clients "
                        "(one Python event loop adds its own queueing to every TTFT)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each workload per server (cold cache each); "
                        "a row holds the medians (a 64-request run of the demo pair lasts ≈ 1.5 s: one run is noisy)")
    parser.add_argument("--py-spy", action="store_true",
                        help="run each server under py-spy: its serving loop's busiest functions (warm-ups included) "
                        "to <result>_py_spy_<shape>_<cache>_summary.txt, raw stacks .txt.gz")
    parser.add_argument("--no-plot", action="store_true")
    return parser


def comma_list(flag: str, text: str, allowed: list[str]) -> list[str]:
    """The names in a comma-separated flag value, each one of `allowed` (else a clear exit)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def selected(workloads: list[Workload], only: str) -> list[Workload]:
    names = comma_list("--only", only, [w.name for w in workloads])
    return [w for w in workloads if not names or w.name in names]


def demo_dir(args: argparse.Namespace) -> Path:
    if args.demo_model_dir is not None:
        return Path(args.demo_model_dir)
    from blockspec.models.smollm2 import ensure_smollm2_dir

    return ensure_smollm2_dir()


def prepare_workloads(args: argparse.Namespace) -> dict[str, Any]:
    if args.workloads is not None:
        return json.loads(args.workloads.read_text())
    from blockspec.evals.gsm8k import default_data_path

    data = build_workloads(args.tokenizer_path or demo_dir(args), args.gsm8k_path or default_data_path(),
                           SMOKE if args.smoke else Sizes())
    if args.save_workloads is not None:
        args.save_workloads.write_text(json.dumps(data))
        print(f"wrote {args.save_workloads}", flush=True)
        raise SystemExit(0)
    return data


def shape_kwargs(name: str, root: Path, args: argparse.Namespace) -> tuple[dict[str, Any], int, bool]:
    """Engine keywords of a shape, its vocabulary size, whether its weights are real (then EOS is honoured)."""
    if name == "demo":
        target, draft, real = demo_dir(args), SMOLLM2_DRAFT, True
    else:
        shape = materialise(name, root, None, None)
        target, draft, real = shape.target, shape.draft, False
    kwargs: dict[str, Any] = dict(
        model_path=str(target), load_format="auto" if real else "dummy", skip_tokenizer_init=True,
        speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft), max_running_requests=64,
        cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64], random_seed=args.seed,
        # NOTE: adaptive verify picks verify lengths from live timings, which differ between the two servers; a fixed
        # block keeps the accept-length comparison about the cache alone
        speculative_adaptive_verify="off",
    )
    if not real and args.accept_len > 0:
        kwargs["speculative_simulate_accept_len"] = args.accept_len
    if args.smoke:
        kwargs.update(device="cpu", dtype="float32", max_total_tokens=16384, cuda_graph_bs=[1])
    elif not args.eager_extend:
        kwargs["enforce_piecewise_cuda_graph"] = True
    vocab = int(json.loads((Path(target) / "config.json").read_text())["vocab_size"])
    return kwargs, vocab, real


def fitted(workload: Workload, vocab: int, source_vocab: int) -> Workload:
    return Workload(workload.name, [fit_ids(p, vocab, source_vocab) for p in workload.prompts], workload.concurrency,
                    workload.max_new_tokens, [fit_ids(p, vocab, source_vocab) for p in workload.warmup],
                    [[fit_ids(f, vocab, source_vocab) for f in turn] for turn in workload.follow_ups])


def warm_kernels(base_url: str, workload: Workload, vocab: int, seed: int, timeout: float) -> None:
    """Random prompts of the workload's first lengths (no shared prefix with it), then an empty cache."""
    rng = random.Random(seed)
    lengths = [len(p) for p in (workload.warmup + workload.prompts)[:workload.concurrency]]
    noise = Workload("warmup", [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths], workload.concurrency, 8)
    run_workload(base_url, noise, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}, 2, timeout)
    response = httpx.post(base_url + "/flush_cache", timeout=60)
    if response.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {response.status_code}: {response.text}")


def measure_server(shape: str, cache: str, kwargs: dict[str, Any], extra: list[str], workloads: list[Workload],
                   vocab: int, real: bool, eos_id: int, args: argparse.Namespace, workdir: Path,
                   profile_stem: Optional[Path] = None) -> list[dict[str, Any]]:
    """Every workload through one server; under py-spy when `profile_stem` is given (raw stacks to STEM.txt.gz, the
    serving loop's summary to STEM_summary.txt)."""
    flags = serve_flags(kwargs) + extra + (["--disable-radix-cache"] if cache == "off" else [])
    log_path = workdir / f"server_{shape}_{cache}.log"
    rows: list[dict[str, Any]] = []

    def start(wrapper: Optional[list[str]]) -> ServerProcess:
        return ServerProcess(flags, log_path, args.startup_timeout, wrapper=wrapper)

    def run_all(base_url: str) -> None:
        for workload in workloads:
            params = {"temperature": 0.0, "max_new_tokens": workload.max_new_tokens, "ignore_eos": not real}
            samples = []
            for _ in range(args.repeats):
                warm_kernels(base_url, workload, vocab, args.seed, args.request_timeout)
                before, metrics_before = get_server_info(base_url), metrics_text(base_url)
                result = run_workload(base_url, workload, params, eos_id, args.request_timeout, args.client_procs)
                after, metrics_after = get_server_info(base_url), metrics_text(base_url)
                samples.append({"workload": workload.name, "shape": shape, "cache": cache,
                                **measured_row(result, before, after, metrics_before, metrics_after)})
                print("   " + describe(samples[-1]), flush=True)
            rows.append(folded(samples))

    try:
        if profile_stem is None:
            with start(None) as server:
                run_all(server.base_url)
        else:
            summary = profile_server(start, profile_stem.with_suffix(".txt"), run_all)
            profile_stem.with_name(profile_stem.name + "_summary.txt").write_text(summary + "\n")
            print(summary, flush=True)
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"{exc}\nserver log tail:\n{log_tail(log_path)}") from exc
    return rows


def gpu_name() -> str:
    """From nvidia-smi, so this process keeps no CUDA context beside the servers'; "cpu" without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True, timeout=30)
        return out.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: Optional[list[str]] = None) -> int:
    exit_on_sigterm()
    args = build_parser().parse_args(argv)
    shapes = ["tiny"] if args.smoke else comma_list("--shapes", args.shapes, list(SHAPES))
    caches = comma_list("--caches", args.caches, ["off", "on"])
    if not shapes or not caches:
        raise SystemExit("--shapes and --caches each need at least one name")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    data = prepare_workloads(args)
    base_workloads = selected([Workload(**w) for w in data["workloads"]], args.only)
    source_vocab, eos_id = int(data["vocab_size"]), int(data["eos_id"])
    extra = shlex.split(args.extra_flags)
    extra_engine_kwargs(extra)  # NOTE: validates the flags before any server starts
    date, commit = datetime.date.today().isoformat(), resolved_commit(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = result_path(args.out, "prefix_cache", date, commit, args.tag)
    report: dict[str, Any] = {"gpu": gpu_name(), "date": date, "commit": commit,
                              "flags": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "rows": [], "errors": [], "goals": []}
    failed = False
    with tempfile.TemporaryDirectory(prefix="prefix_cache_") as tmp:
        for shape in shapes:
            try:
                kwargs, vocab, real = shape_kwargs(shape, Path(tmp), args)
            except (RuntimeError, OSError, ValueError) as exc:
                failed = True
                report["errors"].append({"shape": shape, "error": str(exc)})
                print(f"!! {shape}: {exc}", file=sys.stderr, flush=True)
                continue
            workloads = [fitted(w, vocab, source_vocab) for w in base_workloads]
            report.setdefault("engines", {})[shape] = kwargs
            for cache in caches:
                start = time.perf_counter()
                print(f"== {shape} cache {cache}", flush=True)
                try:
                    stem = path.with_name(f"{path.stem}_py_spy_{shape}_{cache}") if args.py_spy else None
                    report["rows"] += measure_server(shape, cache, kwargs, extra, workloads, vocab, real,
                                                     fit_ids([eos_id], vocab, source_vocab)[0], args, Path(tmp), stem)
                except (RuntimeError, OSError) as exc:
                    failed = True
                    report["errors"].append({"shape": shape, "cache": cache, "error": str(exc)})
                    print(f"!! {shape}/{cache} failed: {exc}", file=sys.stderr, flush=True)
                print(f"   {shape} cache {cache} took {time.perf_counter() - start:.0f} s", flush=True)
                report["goals"] = goals(report["rows"])
                write_json(path, report)
    print(f"wrote {path}")
    if not args.no_plot and report["rows"]:
        print(plot_result(path))
    for goal in report["goals"]:
        print(json.dumps(goal))
    return 1 if failed or any(r["failed"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
