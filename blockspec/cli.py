"""`blockspec serve | eval gsm8k | bench serving | train-draft | generate-prompts`."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from blockspec.engine.process_exit import exit_now


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from blockspec.bench.serving import add_bench_arguments
    from blockspec.config.cli_help import DefaultsHelpFormatter
    from blockspec.evals.gsm8k import add_gsm8k_arguments
    from blockspec.server.args import add_serve_arguments

    parser = argparse.ArgumentParser(prog="blockspec", description="DFlash speculative decoding LLM server.")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{serve,eval,bench,train-draft,generate-prompts}"
    )
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI- and SGLang-compatible)",
                                formatter_class=DefaultsHelpFormatter)
    add_serve_arguments(serve)

    evals = commands.add_parser("eval", help="accuracy evaluations against a running server")
    eval_kinds = evals.add_subparsers(dest="eval_name", required=True, metavar="{gsm8k}")
    gsm8k = eval_kinds.add_parser("gsm8k", help="few-shot GSM8K through /v1/chat/completions",
                                  formatter_class=DefaultsHelpFormatter)
    add_gsm8k_arguments(gsm8k)

    bench = commands.add_parser("bench", help="benchmarks against a running server")
    bench_kinds = bench.add_subparsers(dest="bench_name", required=True, metavar="{serving}")
    serving = bench_kinds.add_parser("serving", help="throughput, TTFT, TPOT and accept length per concurrency",
                                     formatter_class=DefaultsHelpFormatter)
    add_bench_arguments(serving)
    commands.add_parser("train-draft", help="train a DFlash draft for a target (train-draft --help for its flags)")
    commands.add_parser("generate-prompts", help="sample user prompts from a chat target (Magpie-style) for draft "
                        "training, with a held-out split (generate-prompts --help for its flags)")
    return parser, {"serve": serve, "gsm8k": gsm8k, "serving": serving}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train-draft"]:  # NOTE: its own parser (blockspec.train.cli) owns every flag after the name
        from blockspec.train.cli import main as train_draft_main

        return train_draft_main(args[1:])
    if args[:1] == ["generate-prompts"]:
        from blockspec.train.magpie_cli import main as generate_prompts_main

        return generate_prompts_main(args[1:])
    parser, subparsers = build_parser()
    ns, unknown = parser.parse_known_args(args)
    if unknown:  # NOTE: argparse would print the top-level usage; the subcommand's names the flags it takes
        subparser = subparsers["serve" if ns.command == "serve" else "gsm8k" if ns.command == "eval" else "serving"]
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.command == "serve":
        from blockspec.server.args import serve_args_from_namespace
        from blockspec.server.launch import run_server

        return run_server(serve_args_from_namespace(ns, subparsers["serve"]))
    if ns.command == "eval":
        from blockspec.evals.gsm8k import run_from_args

        return run_from_args(ns, subparsers["gsm8k"])
    from blockspec.bench.serving import run_from_args as run_bench

    return run_bench(ns, subparsers["serving"])


def entry() -> NoReturn:
    """The `blockspec` console script: main(); `serve` then exits without the interpreter's teardown (process_exit.py:
    it counted against --shutdown-grace-s), the other commands as usual."""
    code = main()
    if sys.argv[1:2] == ["serve"]:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
