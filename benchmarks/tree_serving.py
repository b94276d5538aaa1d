"""Issue #52's serving goal: DDTree against the chain through `blockspec serve`, at 1 client by default. Writes
tree_serving_<date>_<commit>.json into the --out directory (default benchmarks/results) with

  rows  {shape, workload, clients, budget, policy, tok_s, accept_length, chain_tok_s, over_chain, ...}: per server
        variant (the chain, then one server per --budgets B with `--speculative-tree-budget B`) and workload, the
        workload's prompts sent by `clients` closed-loop streaming `/generate` clients (greedy, the server's default
        flags otherwise: adaptive verify where the cycle is one graph, so the tree is a candidate per batch size);
        tok_s = output tokens over the level's wall time, accept_length = the server's committed tokens per verify
        over the level (`/server_info`), chain_tok_s the chain server's on the same workload, over_chain = tok_s ÷
        chain_tok_s; ttft/itl percentiles, completed/failed counts, cycles_by_verify_length (the cycles each verify
        length ran in the level; the tree's length is block + B), verify_policy (the server's: "adaptive", where
        the tree is one candidate per batch size, or "fixed") and, on tree servers, tree_cycle_share (the share of
        the level's cycles that were trees).

Workloads (tree_verify.py's): `gsm8k`, GSM8K test questions in the demo's chat template (the chat's ids), and `code`,
code-completion prefixes as raw text. The pair: the demo pair by default (SmolLM2-135M-Instruct converted from its
GGUF + the shipped DFlash draft), or --target / --draft. Answers stop at EOS (--ignore-eos runs every answer to
--max-new-tokens; past an answer's end the draft's acceptance is not the workload's). A warm-up level of
--warmup prompts runs on each server first (the code set has 12 prefixes: they repeat, so some hit the prefix
cache alike on every server; the cache is flushed before each measured level). `--smoke` serves tiny random weights on
the CPU (its numbers mean nothing; it checks the script)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from benchmarks.results import add_commit_argument, add_out_argument, write_json, write_rows
from benchmarks.serving_server import ServerProcess, exit_on_sigterm, log_tail
from benchmarks.serving_vs_engine_support import client_namespace, flush_server_cache, measure_level
from benchmarks.tree_verify import cycles_by_length, pair_dirs, since, tree_cycle_share, workload_prompts
from blockspec.evals.client import get_server_info


def server_flags(args: argparse.Namespace, target: Path, draft: Path, budget: int) -> list[str]:
    """`blockspec serve`'s flags for one variant: the pair, DFlash, the tree budget (0: the chain), --extra-flags."""
    flags = ["--model-path", str(target), "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
             str(draft)]
    if budget > 0:
        flags += ["--speculative-tree-budget", str(budget)]
    if args.smoke:
        flags += ["--device", "cpu", "--dtype", "float32", "--load-format", "dummy", "--skip-tokenizer-init",
                  "--max-total-tokens", "4096"]
    return flags + args.extra_flags.split()


def verify_length_info(base_url: str) -> dict[str, Any]:
    return get_server_info(base_url)["internal_states"][0].get("verify_length") or {}


def measure_variant(args: argparse.Namespace, flags: list[str], prompts: dict[str, list[list[int]]],
                    log_path: Path) -> dict[str, dict[str, Any]]:
    """One server with `flags`: per workload a warm-up level, then the measured one; the level and its cycles."""
    levels: dict[str, dict[str, Any]] = {}
    try:
        with ServerProcess(flags, log_path, args.startup_timeout) as server:
            ns = client_namespace(server.base_url, args.max_new_tokens, args.request_timeout)
            ns.ignore_eos = args.ignore_eos
            for workload, ids in prompts.items():
                warm, measured = ids[:args.warmup], ids[args.warmup:]
                if warm:
                    measure_level(ns, warm, args.clients, 0.0, 0)
                flush_server_cache(server.base_url)
                before = cycles_by_length(verify_length_info(server.base_url))
                level = measure_level(ns, measured, args.clients, 0.0, 0)
                info = verify_length_info(server.base_url)
                level["cycles_by_verify_length"] = since(cycles_by_length(info), before)
                level["verify_policy"] = info.get("mode")
                share = tree_cycle_share(info, level["cycles_by_verify_length"])
                if share is not None:
                    level["tree_cycle_share"] = share
                levels[workload] = level
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"{exc}\nserver log tail:\n{log_tail(log_path)}") from exc
    return levels


def tree_serving_rows(args: argparse.Namespace, out: Path, result: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, shape = pair_dirs(args, Path(tmp))
        count = args.warmup + args.num_prompts
        prompts = {workload: workload_prompts(workload, args, target, count) for workload in args.workloads}
        chain: dict[str, float] = {}
        for budget in [0] + sorted({b for b in args.budgets if b > 0}):
            flags = server_flags(args, target, draft, budget)
            named = ([f"--speculative-tree-budget {budget}"] if budget else []) + \
                ([args.extra_flags] if args.extra_flags else [])
            levels = measure_variant(args, flags, prompts, Path(tmp) / f"server_{budget}.log")
            for workload, level in levels.items():
                if budget == 0:
                    chain[workload] = level["server_tok_s"]
                row = {"shape": shape, "workload": workload, "clients": args.clients, "budget": budget,
                       "policy": "chain" if budget == 0 else "tree", "tok_s": round(level["server_tok_s"], 2),
                       "accept_length": level["server_accept_length"], "chain_tok_s": round(chain[workload], 2),
                       "over_chain": round(level["server_tok_s"] / chain[workload], 4),
                       "ttft_p50_ms": level["ttft_p50_ms"], "itl_p50_ms": level["itl_p50_ms"],
                       "itl_p99_ms": level["itl_p99_ms"], "completed": level["completed"], "failed": level["failed"],
                       "first_error": level["first_error"], "num_prompts": len(prompts[workload]) - args.warmup,
                       "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
                       "serve_flags": " ".join(named) or "default",
                       "cycles_by_verify_length": level["cycles_by_verify_length"],
                       "verify_policy": level["verify_policy"]}
                if "tree_cycle_share" in level:
                    row["tree_cycle_share"] = level["tree_cycle_share"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                result["rows"] = rows
                write_json(out, result)  # NOTE: a run cut short keeps what it measured
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32], help="tree budgets (the chain always runs)")
    parser.add_argument("--workloads", nargs="+", choices=["gsm8k", "code"], default=["gsm8k", "code"])
    parser.add_argument("--clients", type=int, default=1, help="closed-loop clients")
    parser.add_argument("--num-prompts", type=int, default=32, help="measured prompts per workload")
    parser.add_argument("--warmup", type=int, default=4, help="warm-up prompts per workload and server")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-new-tokens")
    parser.add_argument("--target", type=Path, default=None, help="target model directory (default: the demo's)")
    parser.add_argument("--draft", type=Path, default=None, help="DFlash draft directory (default: the demo's)")
    parser.add_argument("--shape", default=None, help="the rows' shape name with --target")
    parser.add_argument("--gsm8k", type=Path, default=None, help="GSM8K test JSONL (default: the evals' path)")
    parser.add_argument("--extra-flags", default="", help="more `blockspec serve` flags for every server")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--tag", default="", help="suffix of the result file name (e.g. forced: a second run of one "
                        "commit on one day)")
    add_out_argument(parser)
    add_commit_argument(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny random weights on the CPU")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # NOTE: tree_verify's pair and workload helpers read these
    args.dummy_shape, args.random_prompt_len = None, 0
    exit_on_sigterm()
    return write_rows("tree_serving", args, tree_serving_rows)


if __name__ == "__main__":
    sys.exit(main())
