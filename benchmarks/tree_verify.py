"""Issue #52: DDTree (a draft tree of B nodes verified in one target forward, speculative_tree_budget) against the
DFlash chain. Writes tree_verify_<date>_<commit>.json into the --out directory (default benchmarks/results) with

  rows  {shape, workload, bs, budget, accept_length, tok_s, chain_tok_s}: greedy offline-engine generation of `bs`
        prompts of the workload at a time (graphs and the overlap schedule as served), --rounds such batches one after
        the other (after a warm-up batch on other prompts); tokens/s = output tokens over the wall time of the rounds,
        accept_length = committed tokens per verify; chain_tok_s is the same (workload, bs) at budget 0 (the chain;
        its own row has both); cycles_by_batch_size: the cycles each batch size ran (bs, and below it as requests
        finish); wall_ms_per_cycle: the rounds' wall time over their cycles (prefills included: compare it with
        policy_view's cycle_ms, the device time the policy prices);
        `policy`: chain, tree (every cycle a tree) or, with --adaptive, adaptive (adaptive verify choosing per batch
        size between the chain lengths and the tree: the issue's "never below 0.97x the chain");
        cycles_by_verify_length: the cycles each verify length ran in the measured round (the tree's length is
        block + budget), and with a tree, tree_cycle_share (the share of those cycles that were trees); with
        adaptive verify, policy_view: the policy's cost model at the end of the row for the graph batch size that
        serves bs (expected tokens, cycle ms and tokens/s per request of each verify length; the start-up cycle ms,
        the chain's live offset and the tree's live excess it is made of) and its choice there

Workloads: `gsm8k` (GSM8K test questions in the demo's chat template, --gsm8k, default the evals' data path) and
`code` (code-completion prefixes written below, as raw text). The pair: the demo pair by default (SmolLM2-135M-Instruct
converted from its GGUF + the shipped DFlash draft), or --target / --draft.

`--dummy-shape llama8b` measures the cost side on Llama-3.1-8B shapes with dummy weights, where no draft accepts
anything: every cycle commits a simulated accept length (geometric draws: --simulate-accept-profile for chain cycles,
--simulate-tree-accept-profile for tree cycles, the tree's gain over the chain stated, not measured), so the rows show
whether a tree's wider verify pays at each batch size for that gain and whether adaptive verify picks the chain where
it does not (the issue's "never below 0.97x the chain"; compare with --chain-adaptive). Its workload is `random`
(token ids). `--smoke` runs tiny random weights on the CPU (its numbers mean nothing; it checks the script)."""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.results import add_commit_argument, add_out_argument, write_json, write_rows
from benchmarks.serving_vs_engine_support import TINY, TINY_DRAFT
from blockspec import Engine

# NOTE: code-completion prompts: the model continues each prefix (the second workload)
CODE_PREFIXES = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def binary_search(values, target):\n    low, high = 0, len(values) - 1\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def word_count(text):\n    counts = {}\n",
    "def flatten(nested):\n    \"\"\"Flatten a list of lists.\"\"\"\n    result = []\n",
    "def gcd(a, b):\n",
    "def reverse_words(sentence: str) -> str:\n",
    "def transpose(matrix):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
]


def workload_prompts(name: str, args: argparse.Namespace, model_dir: Path, count: int) -> list[list[int]]:
    """`count` prompts (token ids) of a workload, cycling through the set when it is shorter."""
    if args.smoke:
        return [[5 + (i * 7 + j) % 400 for j in range(8 + i % 5)] for i in range(count)]
    if name == "random":
        generator = torch.Generator().manual_seed(count)
        return torch.randint(10, 32000, (count, args.random_prompt_len), generator=generator).tolist()
    from blockspec.tokenizer import chat_to_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if name == "gsm8k":
        from blockspec.evals.gsm8k import default_data_path, load_lines
        from blockspec.models.smollm2 import build_messages

        rows = load_lines(args.gsm8k or default_data_path())
        prompts = [chat_to_ids(tokenizer, build_messages(row["question"])) for row in rows[:count]]
    else:
        prompts = [list(tokenizer.encode(prefix, add_special_tokens=False)) for prefix in CODE_PREFIXES]
    return [prompts[i % len(prompts)] for i in range(count)]


def engine_flags(args: argparse.Namespace, target: Path, draft: Path, budget: int, policy: str) -> dict[str, Any]:
    flags: dict[str, Any] = dict(
        model_path=str(target), speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
        speculative_tree_budget=budget, skip_tokenizer_init=True, max_running_requests=max(args.batch_sizes),
        cuda_graph_bs=sorted(set(args.batch_sizes)),
        # NOTE: the chain verifies the full block every cycle, as the tree drafts it (adaptive verify would pick
        # shorter chains per batch size: compare against it with --chain-adaptive)
        speculative_adaptive_verify="on" if policy == "adaptive" or (args.chain_adaptive and policy == "chain")
        else "off",
    )
    if args.smoke:
        flags.update(device="cpu", dtype="float32", load_format="dummy", max_total_tokens=4096)
    if args.dummy_shape is not None:
        flags.update(load_format="dummy")
    if args.simulate_accept_profile is not None:
        flags.update(speculative_simulate_accept_profile=args.simulate_accept_profile)
        if budget > 0:
            flags.update(speculative_simulate_tree_accept_profile=args.simulate_tree_accept_profile)
    return flags


def verify_length_info(engine: Engine) -> dict[str, Any]:
    return engine.get_server_info()["internal_states"][0].get("verify_length") or {}


def cycles_by_length(info: dict[str, Any]) -> dict[str, int]:
    """Cycles each verify length ran so far, over every batch size, from a /server_info verify_length `info`."""
    counts: dict[str, int] = {}
    for row in info.get("cycles_by_verify_length", {}).values():
        for length, count in row.items():
            counts[length] = counts.get(length, 0) + count
    return counts


def cycles_by_batch_size(info: dict[str, Any]) -> dict[str, int]:
    """Cycles each batch size ran so far, over every verify length, from a /server_info verify_length `info`."""
    return {bs: sum(row.values()) for bs, row in info.get("cycles_by_verify_length", {}).items()}


def tree_cycle_share(info: dict[str, Any], cycles: dict[str, int]) -> Optional[float]:
    """The share of `cycles` (by verify length) that were trees; None without a tree (`info`: as above)."""
    tree_length = (info.get("tree") or {}).get("verify_length")
    if tree_length is None:
        return None
    return round(cycles.get(str(tree_length), 0) / max(sum(cycles.values()), 1), 4)


def since(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """The counts added between two snapshots, keys in numeric order, zeros left out."""
    added = {key: count - before.get(key, 0) for key, count in after.items()}
    return {key: count for key, count in sorted(added.items(), key=lambda kv: int(kv[0])) if count}


def measure(engine: Engine, rounds: list[list[list[int]]], warmup: list[list[int]], max_new: int) -> dict[str, Any]:
    """tok_s and accept length of generating each round's prompts together, one round after the other (after
    `warmup`), greedy to max_new tokens, and the cycles each verify length and batch size ran in the rounds.

    NOTE: one Engine.generate per round: prompts of one call all run at once (up to max_running_requests), so a
    batch size's row must not hand the engine more than that many prompts at a time."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    engine.generate(input_ids=warmup, sampling_params=params)
    info = verify_length_info(engine)
    lengths_before, batches_before = cycles_by_length(info), cycles_by_batch_size(info)
    before = engine.scheduler.spec.as_dict()
    tokens, seconds = 0, 0.0
    for prompts in rounds:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds += time.perf_counter() - start
        tokens += sum(len(o["output_ids"]) for o in outputs)
    after = engine.scheduler.spec.as_dict()
    verifies = after["spec_verify_ct"] - before["spec_verify_ct"]
    committed = after["avg_spec_accept_length"] * after["spec_verify_ct"] - \
        before["avg_spec_accept_length"] * before["spec_verify_ct"]
    info = verify_length_info(engine)
    batches = since(cycles_by_batch_size(info), batches_before)
    return {"tok_s": tokens / seconds, "accept_length": committed / verifies if verifies else 0.0,
            "cycles_by_verify_length": since(cycles_by_length(info), lengths_before),
            "cycles_by_batch_size": batches, "wall_ms_per_cycle": seconds * 1e3 / max(sum(batches.values()), 1)}


def policy_view(engine: Engine, bs: int) -> Optional[dict[str, Any]]:
    """Adaptive verify's cost model and choice for the graph batch size that serves `bs` (None: not adaptive)."""
    info = verify_length_info(engine)
    if info.get("mode") != "adaptive":
        return None
    sizes = sorted(int(size) for size in info["cost_model"])
    bucket = next((size for size in sizes if size >= bs), sizes[-1])
    startup = {key.split("x")[1]: ms for key, ms in info["cycle_ms_startup"].items()
               if key.split("x")[0] == str(bucket)}
    return {"graph_bs": bucket, "cost_model": info["cost_model"][str(bucket)], "in_use": info["in_use"].get(str(bs)),
            "cycle_ms_startup": startup, "cycle_ms_live_offset": info["cycle_ms_live_offset"].get(str(bucket)),
            "tree_cycle_ms_live_excess": info["tree_cycle_ms_live_excess"].get(str(bucket))}


def pair_dirs(args: argparse.Namespace, root: Path) -> tuple[Path, Path, str]:
    """(target dir, draft dir, shape name)."""
    if args.smoke:
        (root / "target").mkdir()
        (root / "target" / "config.json").write_text(json.dumps(TINY))
        (root / "draft").mkdir()
        (root / "draft" / "config.json").write_text(json.dumps({**TINY_DRAFT, "block_size": 8}))
        return root / "target", root / "draft", "smoke"
    if args.dummy_shape is not None:
        from benchmarks.serving_vs_engine_support import materialise

        shape = materialise(args.dummy_shape, root, None, None)
        assert shape.draft is not None
        return shape.target, shape.draft, f"{args.dummy_shape}/dummy"
    if args.target is not None:
        assert args.draft is not None, "--target needs --draft"
        return args.target, args.draft, args.shape or args.target.name
    from blockspec.models.smollm2 import DEMO_DRAFT_DIR, ensure_smollm2_dir

    return ensure_smollm2_dir(), args.draft or DEMO_DRAFT_DIR, "smollm2-135m/demo-draft"


def tree_rows(args: argparse.Namespace, out: Path, result: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, shape = pair_dirs(args, Path(tmp))
        # NOTE: the chain first: every row names its speed
        variants = [(0, "chain")] + [(b, "tree") for b in sorted(set(args.budgets)) if b > 0]
        variants += [(b, "adaptive") for b in sorted(set(args.budgets)) if b > 0 and args.adaptive]
        for budget, policy in variants:
            engine = Engine(**engine_flags(args, target, draft, budget, policy))
            for workload in args.workloads:
                for bs in args.batch_sizes:
                    prompts = workload_prompts(workload, args, target, bs * (args.rounds + 1))
                    rounds = [prompts[bs * (r + 1):bs * (r + 2)] for r in range(args.rounds)]
                    measured = measure(engine, rounds, prompts[:bs], args.max_new_tokens)
                    chain = next((r["tok_s"] for r in rows if (r["workload"], r["bs"], r["policy"]) ==
                                  (workload, bs, "chain")), measured["tok_s"])
                    row = {"shape": shape, "workload": workload, "bs": bs, "budget": budget, "policy": policy,
                           "accept_length": round(measured["accept_length"], 4), "tok_s": round(measured["tok_s"], 2),
                           "chain_tok_s": round(chain, 2), "max_new_tokens": args.max_new_tokens,
                           "cycles_by_verify_length": measured["cycles_by_verify_length"],
                           "cycles_by_batch_size": measured["cycles_by_batch_size"],
                           "wall_ms_per_cycle": round(measured["wall_ms_per_cycle"], 3)}
                    view = policy_view(engine, bs)
                    if view is not None:
                        row["policy_view"] = view
                    share = tree_cycle_share(verify_length_info(engine), measured["cycles_by_verify_length"])
                    if share is not None:
                        row["tree_cycle_share"] = share
                    if args.simulate_accept_profile is not None:
                        row.update(simulated_chain=args.simulate_accept_profile,
                                   simulated_tree=args.simulate_tree_accept_profile if budget > 0 else None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    result["rows"] = rows
                    write_json(out, result)  # NOTE: a run cut short keeps what it measured
            engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64], help="tree budgets (0, the chain, "
                                                                                    "always runs)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--workloads", nargs="+", choices=["gsm8k", "code", "random"], default=None,
                        help="default: gsm8k and code; random with --dummy-shape")
    parser.add_argument("--rounds", type=int, default=4,
                        help="batches of bs prompts measured one after the other per row")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--target", type=Path, default=None, help="target model directory (default: the demo's)")
    parser.add_argument("--draft", type=Path, default=None, help="DFlash draft directory (default: the demo's)")
    parser.add_argument("--shape", default=None, help="the rows' shape name with --target")
    parser.add_argument("--gsm8k", type=Path, default=None, help="GSM8K test JSONL (default: the evals' path)")
    parser.add_argument("--adaptive", action="store_true",
                        help="also rows of adaptive verify with each budget (the tree a candidate per batch size)")
    parser.add_argument("--chain-adaptive", action="store_true",
                        help="the chain with adaptive verify (default: the full block, as the tree drafts it)")
    add_out_argument(parser)
    add_commit_argument(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny random weights on the CPU")
    parser.add_argument("--dummy-shape", choices=["llama8b"], default=None,
                        help="dummy weights of this shape with simulated acceptance (module docstring)")
    parser.add_argument("--simulate-accept-profile", default=None,
                        help="chain cycles' simulated acceptance (default with --dummy-shape: geometric:4)")
    parser.add_argument("--simulate-tree-accept-profile", default=None,
                        help="tree cycles' simulated acceptance (default with --dummy-shape: geometric:5)")
    parser.add_argument("--random-prompt-len", type=int, default=128, help="tokens per prompt of the random workload")
    args = parser.parse_args(argv)
    if args.dummy_shape is not None:
        args.simulate_accept_profile = args.simulate_accept_profile or "geometric:4"
        args.simulate_tree_accept_profile = args.simulate_tree_accept_profile or "geometric:5"
    if (args.simulate_accept_profile is None) != (args.simulate_tree_accept_profile is None):
        parser.error("--simulate-accept-profile and --simulate-tree-accept-profile go together")
    if args.workloads is None:
        args.workloads = ["random"] if args.dummy_shape is not None else ["gsm8k", "code"]
    return write_rows("tree_verify", args, tree_rows)


if __name__ == "__main__":
    sys.exit(main())
