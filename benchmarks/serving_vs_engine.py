"""The same work through the offline engine and through the HTTP server (issue 18's benchmark).

Per shape (`llama8b`: Llama-3.1-8B config + 5-layer draft; `smollm2`: SmolLM2-135M config + the shipped draft; both
with dummy weights unless --model-dir/--draft-dir; `tiny`: a CPU smoke shape) and mode (`dflash` with a simulated
accept length, `target`): N random-token prompts, greedy, ignore_eos, fixed new tokens. First `Engine.generate` on
all of them in a process of its own (engine tok/s at full batch), and each closed-loop level's work in waves of
that many prompts (the engine number that level's row compares with), then `python -m blockspec.serve` with the same
engine flags and streaming closed-loop clients on `/generate` (input_ids; spread over --client-procs processes) at each
concurrency, plus one Poisson-arrival run: server tok/s, server ÷ engine, TTFT and inter-chunk latency (ITL) p50/p99,
the server's accept length. The demo pair with real weights: --shapes smollm2 --model-dir <converted SmolLM2 dir>
--accept-len 0 (the shipped draft has its weights) --dataset gsm8k (GSM8K test questions as chats, the workload
the draft was trained for; scripts/device_demo_pair.sh serving). A run split over commands: --merge the earlier JSONs.
Writes benchmarks/results/serving_vs_engine_<date>_<commit>[_tag].json after every phase, then a PNG beside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, cast

from benchmarks.results import add_out_argument, plot_result
from benchmarks.serving_server import exit_on_sigterm
from benchmarks.serving_vs_engine_support import (
    DEFAULT_ACCEPT, SHAPES, ServerProcess, Shape, cached_engine_phase, client_namespace, log_tail, materialise,
    measure_level,
)
from benchmarks.serving_workload import gsm8k_chat_prompts, row_weights, serve_dflash_wait_steps
from blockspec.bench.provenance import commit_id
from blockspec.bench.serving import load_prompts

MODES = ("dflash", "target")
POISSON_FRACTION = 0.8  # default Poisson rate: this fraction of the top closed-loop level's request throughput


def _csv(kind: type, choices: Optional[tuple[str, ...]] = None) -> Any:
    def parse(text: str) -> list[Any]:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            of = " of " + ", ".join(choices) if choices else ""
            raise argparse.ArgumentTypeError(f"expected a comma-separated list{of}, got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=_csv(str, SHAPES), default=["smollm2", "llama8b"], help="smollm2,llama8b,tiny")
    parser.add_argument("--modes", type=_csv(str, MODES), default=list(MODES), help="dflash,target")
    parser.add_argument("--concurrency", type=_csv(int), default=[1, 8, 32, 64],
                        help="closed-loop clients, e.g. 1,8,32,64")
    parser.add_argument("--poisson-rate", type=float,
                        help=f"requests/s of the Poisson run (default {POISSON_FRACTION} x "
                        "the request throughput at 64 clients, else at the most clients; 0 skips it)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-rounds", type=int, default=0, help="a closed-loop level sends at most this many "
                        "prompts per client (0: all --num-prompts; e.g. 16 shortens the 1-client level)")
    parser.add_argument("--client-procs", type=int, default=4, help="client processes sharing each level's clients")
    parser.add_argument("--dataset", choices=("random", "gsm8k"), default="random", help="random: --prompt-len random "
                        "token ids; gsm8k: GSM8K test questions as one-turn chats by the tokenizer's chat template "
                        "(--tokenizer-path, else --model-dir; the demo pair's real workload)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=64, help="prompts of the warm-up generate / warm-up level")
    parser.add_argument("--warmup-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accept-len", type=float, help="simulated accept length of dflash (default: llama8b "
                        f"{DEFAULT_ACCEPT['llama8b']}, smollm2 {DEFAULT_ACCEPT['smollm2']}; <= 0: real acceptance)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, help="a real target checkpoint instead of the shape's config.json")
    parser.add_argument("--draft-dir", type=Path, help="a real draft instead of the shape's (smollm2: the shipped one)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), help="default: dummy, or auto with --model-dir")
    parser.add_argument("--tokenizer-path", type=Path, help="a tokenizer directory: detokenization is measured too "
                        "(default: --skip-tokenizer-init)")
    parser.add_argument("--extra-flags", default="", help="more `blockspec serve` flags for both sides, written with "
                        "'=', e.g. --extra-flags=\"--enable-mixed-chunk --enforce-piecewise-cuda-graph\" "
                        "(server-only flags go to the server alone)")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    add_out_argument(parser)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the server to get healthy")
    parser.add_argument("--engine-timeout", type=float, default=1800.0, help="seconds for the whole engine phase")
    parser.add_argument("--merge", type=Path, nargs="*", default=[], help="earlier result JSONs whose rows (and "
                        "engines, errors) come first in this one: a run split over several commands")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--engine-cache", type=Path, help="a directory: an engine phase whose spec (engine flags, "
                        "prompts, levels) ran before is read from it instead of run again (server-only variants)")
    parser.add_argument("--radix-cache", action="store_true", help="keep the prefix cache on (off by default: warm-up "
                        "and levels re-send the same prompts, which would hit it unequally on the two sides)")
    parser.add_argument("--py-spy-s", type=float, default=0.0, help="then the top level again for ~S s under py-spy "
                        "(server + engine process, serving_profile.py): raw stacks and a summary beside the JSON")
    return parser


def extra_engine_kwargs(extra: list[str]) -> dict[str, Any]:
    """The EngineConfig keywords that `blockspec serve` flags in `extra` change from their defaults."""
    from blockspec.server.args import parse_serve_args

    base = parse_serve_args(["--model-path", "unused"]).engine
    changed = parse_serve_args(["--model-path", "unused", *extra]).engine
    return {k: v for k, v in changed.items() if k not in base or base[k] != v}


def serve_flags(kwargs: dict[str, Any]) -> list[str]:
    """Engine keywords as `blockspec serve` flags (each flag is its EngineConfig field, dashed)."""
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def engine_kwargs(shape: Shape, mode: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    load_format = args.load_format or ("auto" if args.model_dir else "dummy")
    kwargs: dict[str, Any] = dict(
        model_path=str(shape.target), load_format=load_format, device=args.device, dtype=args.dtype,
        max_running_requests=args.max_running_requests, random_seed=args.seed,
        skip_tokenizer_init=args.tokenizer_path is None, disable_radix_cache=not args.radix_cache,
        tokenizer_path=str(args.tokenizer_path) if args.tokenizer_path else None,
    )
    if mode == "dflash":
        if shape.draft is None:
            raise ValueError(f"shape {shape.name} has no draft: pass --draft-dir")
        accept = DEFAULT_ACCEPT[shape.name] if args.accept_len is None else args.accept_len
        kwargs.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(shape.draft),
                      speculative_simulate_accept_len=accept if accept > 0 else None,
                      max_prefill_wait_steps=serve_dflash_wait_steps(shlex.split(args.extra_flags)))
    kwargs.update(extra)
    return kwargs


class Report:
    """The result JSON, rewritten after every phase so a cut-short run keeps what it measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        date = datetime.date.today().isoformat()
        commit = commit_id()
        args.out.mkdir(parents=True, exist_ok=True)
        self.path = args.out / f"serving_vs_engine_{date}_{commit}{'_' + args.tag if args.tag else ''}.json"
        flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        self.data: dict[str, Any] = {"gpu": "cpu", "date": date, "commit": commit, "flags": flags, "engines": {},
                                     "errors": [], "rows": []}

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def run_pair(shape: Shape, mode: str, args: argparse.Namespace, extra_tokens: list[str], extra: dict[str, Any],
             prompts: list[list[int]], workdir: Path, report: Report) -> None:
    """Engine phase, then server phase, for one shape and mode; rows appended (and saved) as they are measured."""
    kwargs = engine_kwargs(shape, mode, args, extra)
    key = f"{shape.name}/{mode}"
    report.data["engines"][key] = kwargs
    spec = {"engine": kwargs, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
            "warmup": min(args.warmup, len(prompts)), "warmup_new_tokens": args.warmup_new_tokens,
            "levels": [(c, len(level_prompts(prompts, c, args))) for c in args.concurrency]}
    print(f"== {key}: engine", flush=True)
    engine = cached_engine_phase(spec, workdir, args.engine_timeout, args.engine_cache)
    report.data["gpu"] = engine.pop("gpu")
    report.data["engines"][key + ":result"] = engine
    report.save()
    reused = " (engine phase reused)" if engine["reused_engine_phase"] else ""
    print(f"   engine {engine['engine_tok_s']:.0f} tok/s ({engine['engine_wall_s']:.2f} s){reused}", flush=True)
    print(f"== {key}: server", flush=True)
    base = {"shape": shape.name, "weights": row_weights(kwargs), "mode": mode, "engine_tok_s": engine["engine_tok_s"],
            "engine_full_batch_tok_s": engine["engine_tok_s"],
            "engine_tok_s_by_concurrency": engine["engine_tok_s_by_concurrency"],
            "engine_waves_tok_s_by_concurrency": engine.get("engine_waves_tok_s_by_concurrency", {}),
            "engine_accept_length": engine["engine_accept_length"], "engine_core_mhz": engine.get("engine_core_mhz"),
            "num_prompts": len(prompts),
            "prompt_len": round(sum(map(len, prompts)) / len(prompts)), "max_new_tokens": args.max_new_tokens}
    log_path = workdir / f"server_{shape.name}_{mode}.log"
    try:
        levels = run_server_levels(ServerProcess(serve_flags(kwargs) + extra_tokens, log_path, args.startup_timeout),
                                   args, prompts, base, report)
        if args.py_spy_s > 0 and levels:
            from benchmarks.serving_profile import profile_top_level

            top = max(levels, key=lambda l: l["concurrency"])
            repeats = max(1, math.ceil(1.3 * args.py_spy_s / top["duration_s"]))
            profile_top_level(lambda wrapper: ServerProcess(serve_flags(kwargs) + extra_tokens, log_path,
                                                            args.startup_timeout, wrapper=wrapper),
                              level_prompts(prompts, top["concurrency"], args) * repeats, top["concurrency"], args,
                              args.out / (report.path.stem + f"_py_spy_{shape.name}_{mode}"))
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"{exc}\nserver log tail:\n{log_tail(log_path)}") from exc


def run_server_levels(process: ServerProcess, args: argparse.Namespace, prompts: list[list[int]], base: dict[str, Any],
                      report: Report) -> list[dict[str, Any]]:
    """The closed-loop levels (and the Poisson run) against one server; returns the closed-loop levels."""
    with process as server:
        warm = prompts[: min(args.warmup, len(prompts))]
        if warm:
            measure_level(client_namespace(server.base_url, args.warmup_new_tokens, args.request_timeout), warm,
                          len(warm), 0.0, args.seed)
        ns = client_namespace(server.base_url, args.max_new_tokens, args.request_timeout)
        levels: list[dict[str, Any]] = []
        for concurrency in args.concurrency:
            sent = level_prompts(prompts, concurrency, args)
            levels.append(measure_level(ns, sent, concurrency, 0.0, args.seed, args.client_procs))
            add_row(report, base, levels[-1])
        rate = args.poisson_rate
        if rate is None and levels:
            top = next((l for l in levels if l["concurrency"] == 64), max(levels, key=lambda l: l["concurrency"]))
            rate = POISSON_FRACTION * top["request_throughput"]
        if rate:
            add_row(report, base, measure_level(ns, prompts, None, rate, args.seed, args.client_procs))
    return levels


def level_prompts(prompts: list[list[int]], concurrency: int, args: argparse.Namespace) -> list[list[int]]:
    """What a closed-loop level sends (the engine side does the same work at the same concurrency)."""
    return prompts[: args.max_rounds * concurrency] if args.max_rounds > 0 else prompts


def add_row(report: Report, base: dict[str, Any], level: dict[str, Any]) -> None:
    row = {**base, **level}
    # NOTE: a closed-loop row is compared with the engine doing its work at its concurrency; Poisson with full batches.
    matching = base["engine_tok_s_by_concurrency"].get(str(row["concurrency"]))
    if matching is not None:
        row["engine_tok_s"] = matching
        row["engine_waves_tok_s"] = base.get("engine_waves_tok_s_by_concurrency", {}).get(str(row["concurrency"]))
    row["server_over_engine"] = row["server_tok_s"] / row["engine_tok_s"] if row["engine_tok_s"] else None
    report.data["rows"].append(row)
    report.save()
    print("   " + describe(row), flush=True)


# NOTE: one line per row, as the benchmark prints it (scripts/device_serving_ab.sh greps it)
def describe(row: dict[str, Any]) -> str:
    accept = row.get("server_accept_length")
    conc = f"{row['concurrency']}" + (f"@{row['rate']:.1f}/s" if row["concurrency"] == "poisson" else "")
    ratio = row["server_over_engine"]
    return (f"{row['shape']:>8} {row['mode']:>6} {conc:>14} {row['engine_tok_s']:>10.0f} {row['server_tok_s']:>10.0f} "
            f"{ratio if ratio is not None else float('nan'):>6.2f} "
            f"{row['ttft_p50_ms']:>8.1f} {row['ttft_p99_ms']:>8.1f} "
            f"{row['itl_p50_ms']:>7.2f} {row['itl_p99_ms']:>7.2f} {'-' if accept is None else f'{accept:.2f}':>6} "
            f"{row['completed']}/{row['completed'] + row['failed']} {row.get('kernel_compiles', '-')} "
            f"{row.get('clients_cpu_share', float('nan')):.2f}/{row.get('client_procs', '-')} "
            f"{_num(row.get('http_cpu_share'), '.2f')}/{_num(row.get('engine_cpu_share'), '.2f')} "
            f"{_num(row.get('engine_receive_mean_ms'), '.1f')}/{_num(row.get('engine_queue_mean_ms'), '.1f')}/"
            f"{_num(row.get('engine_prefill_mean_ms'), '.1f')} {_num(row.get('engine_steps_per_s'), '.0f')}/"
            f"{_num(row.get('extend_step_share'), '.2f')} {_num(row.get('engine_extend_step_mean_ms'), '.1f')}/"
            f"{_num(row.get('engine_other_step_mean_ms'), '.2f')} {_extends(row.get('server_forward_counts'))} "
            f"{'/'.join(_num(row.get(f'engine_{p}_per_step_ms'), '.3f') for p in ('intake', 'publish', 'flush'))} "
            f"{_num(row.get('engine_core_mhz'), '.0f')}/{_num(row.get('server_engine_core_mhz'), '.0f')}"
            f"{' ' + str(row['kernel_compiles_by_kernel']) if row.get('kernel_compiles_by_kernel') else ''}")


def _extends(counts: Optional[dict[str, int]]) -> str:
    """The level's extend forwards: on piecewise graphs / eager (no bucket fitted)."""
    if not counts:
        return "-"
    return f"{counts.get('piecewise', 0)}/{counts.get('piecewise_fallback', 0)}"


def _num(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'shape':>8} {'mode':>6} {'concurrency':>14} {'engine t/s':>10} {'server t/s':>10} {'s/e':>6} "
          f"{'ttft50':>8} {'ttft99':>8} {'itl50':>7} {'itl99':>7} {'accept':>6} ok compiles clients-cpu/procs "
          "http/engine-cpu receive/queue/prefill-ms steps-per-s/extend-share extend/other-step-ms "
          "extends-piecewise/eager "
          "loop-ms-per-step-intake/publish/flush engine-core-mhz-offline/server")


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_sigterm()  # NOTE: the engine phase's process is stopped by its context manager too
    for flag in ("num_prompts", "prompt_len", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    extra_tokens = shlex.split(args.extra_flags)
    extra = extra_engine_kwargs(extra_tokens)
    report = Report(args)
    for earlier in args.merge:
        data = json.loads(earlier.read_text())
        for key in ("rows", "errors"):
            report.data[key] += data.get(key, [])
        report.data["engines"].update(data.get("engines", {}))
        report.data["gpu"] = data.get("gpu", report.data["gpu"])
    report.save()
    failed = False
    with tempfile.TemporaryDirectory(prefix="serving_vs_engine_") as tmp:
        for name in args.shapes:
            shape = materialise(name, Path(tmp), args.model_dir, args.draft_dir)
            prompt_ns = argparse.Namespace(seed=args.seed, dataset_name="random", num_prompts=args.num_prompts,
                                           random_input_len=args.prompt_len)
            prompts = (gsm8k_chat_prompts(args.tokenizer_path or shape.target, args.num_prompts)
                       if args.dataset == "gsm8k" else cast(list[list[int]], load_prompts(prompt_ns, shape.vocab_size)))
            for mode in args.modes:
                start = time.perf_counter()
                try:
                    run_pair(shape, mode, args, extra_tokens, extra, prompts, Path(tmp), report)
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    failed = True
                    report.data["errors"].append({"shape": name, "mode": mode, "error": str(exc)})
                    report.save()
                    print(f"!! {name}/{mode} failed: {exc}", file=sys.stderr, flush=True)
                print(f"   {name}/{mode} took {time.perf_counter() - start:.0f} s", flush=True)
    print(f"wrote {report.path}")
    if not args.no_plot and report.data["rows"]:
        print(plot_result(report.path))
    print(HEADER)
    for row in report.data["rows"]:
        print(describe(row))
    return 1 if failed or any(row["failed"] for row in report.data["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
