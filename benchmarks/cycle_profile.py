"""What a DDTree cycle launches beyond the chain's, and what each launch costs on the device: the greedy DFlash cycle
profiled with torch.profiler, the chain (verify length = the draft's block) and a tree per --budgets B (verify length
block + B, `speculative_tree_budget` B), per batch size, through the DFlash worker's `dummy_cycle` (the cycle a
served greedy batch runs, on padding rows: the graphs serving replays, the host waiting for the tokens). Writes
cycle_profile_<date>_<commit>.json (+ .png) into --out with

  settings  {shape, block_size, cycles (profiled per row), repeat (timed per row), kernels_in_graphs (whether the
            traces of graph replays held kernels; None: no graph rows)}
  rows      {cycle: chain | tree, budget (0: the chain), bs, verify_length, graphs, device, wall_ms,
            device_us_per_cycle, ops_per_cycle, top_kernels, top_sources}: one per (graphs, cycle, budget, bs).
            graphs: every profiled cycle ran as one CUDA graph replay (False: eagerly, each op launched from the
            host); device: "cuda" (the profiler's device activities: kernels, copies, fills) or "cpu" (leaf CPU ops
            that would be kernels on the GPU, benchmarks/profile_events.py); wall_ms: the median of --repeat single
            cycles timed with CUDA events (host work and the wait for the tokens included; perf_counter on the CPU);
            device_us_per_cycle / ops_per_cycle: summed over the launches of --cycles profiled cycles, per cycle;
            top_kernels: the --top heaviest launch names {name, calls_per_cycle, us_per_cycle}; top_sources, where
            the trace has Python stacks (eager rows): the same per innermost blockspec function {source, ...}
  diffs     {budget, bs, graphs, device, added_ops_per_cycle, added_device_us_per_cycle, added_wall_ms, kernels,
            sources}: each tree row minus the chain row of the same bs and graphs; kernels (and sources): the
            entries whose calls or µs per cycle grow {name, base_calls, calls, base_us, us, added_calls,
            added_us}, most added µs first (on the CPU, whose µs mean little: those whose calls grow, most first)

On CUDA the rows run with CUDA graphs (as served); CUPTI reports the kernels inside a graph replay on recent CUDA. If
it reports none, every row is profiled again with graphs off (graphs: False) and settings.kernels_in_graphs says so;
--eager adds those rows anyway (they show each launch's Python source, and the host's cost of launching eagerly).

The pair: the demo pair by default (SmolLM2-135M-Instruct converted from its GGUF + the shipped DFlash draft), or
--target / --draft, or --dummy-shape (dummy weights of that shape: the cost side only). `--smoke` runs tiny random
weights on the CPU: its op counts are what the test checks (a tree cycle launches more than the chain's)."""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_events import CycleTable, cycle_table, grown
from benchmarks.results import add_commit_argument, add_out_argument, write_json, write_rows
from benchmarks.tree_verify import pair_dirs
from blockspec import Engine
from blockspec.speculative.cycle_timing import measure_cycle_times
from blockspec.speculative.dflash import DFlashWorker

NAME_WIDTH = 72  # NOTE: kernel names (C++ templates) are cut to this width in the printed tables, not in the JSON


def engine_flags(args: argparse.Namespace, target: Path, draft: Path, budget: int, graphs: bool) -> dict[str, Any]:
    """The engine of one variant: DFlash, the tree budget (0: the chain) verified every cycle (adaptive verify off)."""
    flags: dict[str, Any] = dict(
        model_path=str(target), speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
        speculative_tree_budget=budget, speculative_adaptive_verify="off", skip_tokenizer_init=True,
        max_running_requests=max(args.batch_sizes), cuda_graph_bs=sorted(set(args.batch_sizes)),
        disable_cuda_graph=not graphs,
    )
    if args.smoke:
        flags.update(device="cpu", dtype="float32", load_format="dummy", max_total_tokens=4096)
    if args.dummy_shape is not None:
        flags.update(load_format="dummy")
    return flags


def verify_length(worker: DFlashWorker, budget: int) -> int:
    """The cycle's verify length: the block for the chain, block + budget for the tree."""
    if budget == 0:
        return worker.block_size
    assert worker.tree is not None and worker.tree.budget == budget
    return worker.tree.cycle_length


def profile_cycles(engine: Engine, worker: DFlashWorker, bs: int, length: int, args: argparse.Namespace,
                   cuda: bool, stacks: bool) -> tuple[CycleTable, bool]:
    """--cycles cycles under torch.profiler: their launches, and whether every one ran as a graph replay.

    NOTE: Python stacks (the launches' sources) only where the cycle runs eagerly: a replay has no Python caller,
    and the tracer's cost would only slow the host."""
    counts = engine.runner.graphs.counts
    replays_before = counts["graph"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=stacks) as trace:
        for _ in range(args.cycles):
            worker.dummy_cycle(bs, length)
        if cuda:
            torch.cuda.synchronize()
    replays = counts["graph"] - replays_before
    return cycle_table(trace.events(), args.cycles, cuda), replays == args.cycles


def profile_row(engine: Engine, budget: int, bs: int, args: argparse.Namespace, cuda: bool,
                graphs: bool) -> tuple[dict[str, Any], CycleTable]:
    worker = engine.dflash_worker
    assert worker is not None, "the cycle profile needs DFlash"
    length = verify_length(worker, budget)
    for _ in range(args.warmup):
        worker.dummy_cycle(bs, length)
    wall_ms = measure_cycle_times(worker.dummy_cycle, [bs], [length], repeat=args.repeat, warmup=1)[(bs, length)]
    table, replayed = profile_cycles(engine, worker, bs, length, args, cuda, stacks=not graphs)
    row = {"cycle": "chain" if budget == 0 else "tree", "budget": budget, "bs": bs, "verify_length": length,
           "graphs": replayed, "device": table.device, "wall_ms": round(wall_ms, 4),
           "device_us_per_cycle": round(table.us_per_cycle, 3), "ops_per_cycle": round(table.ops_per_cycle, 3),
           "top_kernels": table.top("name", args.top)}
    if table.has_sources():
        row["top_sources"] = table.top("source", args.top)
    return row, table


def diff_row(chain: tuple[dict[str, Any], CycleTable], tree: tuple[dict[str, Any], CycleTable],
             top: int) -> dict[str, Any]:
    """What the tree row adds over the chain row (same bs and graphs)."""
    (chain_row, chain_table), (tree_row, tree_table) = chain, tree
    by_calls = tree_table.device == "cpu"
    diff = {"budget": tree_row["budget"], "bs": tree_row["bs"], "graphs": tree_row["graphs"],
            "device": tree_row["device"],
            "added_ops_per_cycle": round(tree_table.ops_per_cycle - chain_table.ops_per_cycle, 3),
            "added_device_us_per_cycle": round(tree_table.us_per_cycle - chain_table.us_per_cycle, 3),
            "added_wall_ms": round(tree_row["wall_ms"] - chain_row["wall_ms"], 4),
            "kernels": grown(chain_table.by("name"), tree_table.by("name"), "name", top, by_calls)}
    if tree_table.has_sources():
        diff["sources"] = grown(chain_table.by("source"), tree_table.by("source"), "source", top, by_calls)
    return diff


def measure(args: argparse.Namespace, out: Path, result: dict[str, Any]) -> None:
    cuda = torch.cuda.is_available() and not args.smoke
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, shape = pair_dirs(args, Path(tmp))
        result["settings"] = {"shape": shape, "cycles": args.cycles, "repeat": args.repeat, "kernels_in_graphs": None}
        result["rows"], result["diffs"] = [], []
        # NOTE: graphs first where CUDA has them; eager rows with --eager, or when the graph rows saw no kernel
        modes = [True] if cuda else [False]
        tables: dict[tuple[bool, int, int], tuple[dict[str, Any], CycleTable]] = {}
        while modes:
            graphs = modes.pop(0)
            for budget in [0] + sorted({b for b in args.budgets if b > 0}):
                engine = Engine(**engine_flags(args, target, draft, budget, graphs))
                assert engine.dflash_worker is not None
                result["settings"]["block_size"] = engine.dflash_worker.block_size
                for bs in args.batch_sizes:
                    row, table = profile_row(engine, budget, bs, args, cuda, graphs)
                    tables[(graphs, budget, bs)] = (row, table)
                    result["rows"].append(row)
                    if budget > 0:
                        result["diffs"].append(diff_row(tables[(graphs, 0, bs)], (row, table), args.top))
                    print(json.dumps({key: row[key] for key in ("cycle", "budget", "bs", "graphs", "wall_ms",
                                                                  "device_us_per_cycle", "ops_per_cycle")}), flush=True)
                    write_json(out, result)  # NOTE: a run cut short keeps what it measured
                engine.shutdown()
                del engine
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            if graphs:
                replayed = [table for (g, _, _), (row, table) in tables.items() if g and row["graphs"]]
                seen = bool(replayed) and all(table.kernels_per_cycle > 0 for table in replayed)
                result["settings"]["kernels_in_graphs"] = seen
                if args.eager or not seen:
                    modes.append(False)
    print_tables(result, args.top)


def short(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 1] + "…"


def print_tables(result: dict[str, Any], top: int) -> None:
    """The rows, each row's heaviest launches, and what each tree adds over the chain, as text."""
    print(f"\n{'cycle':>6} {'B':>4} {'bs':>4} {'graphs':>6} {'device':>6} {'wall ms':>9} {'device µs':>10} "
          f"{'ops':>8}")
    for row in result["rows"]:
        print(f"{row['cycle']:>6} {row['budget']:>4} {row['bs']:>4} {str(row['graphs']):>6} {row['device']:>6} "
              f"{row['wall_ms']:>9.3f} {row['device_us_per_cycle']:>10.1f} {row['ops_per_cycle']:>8.1f}")
    for row in result["rows"]:
        print(f"\n{row['cycle']} B={row['budget']} bs={row['bs']} graphs={row['graphs']}: top launches per cycle")
        for entry in row["top_kernels"][:top]:
            print(f"  {entry['calls_per_cycle']:>7.1f} x {entry['us_per_cycle']:>9.1f} µs  {short(entry['name'])}")
    for diff in result["diffs"]:
        print(f"\ntree B={diff['budget']} minus chain, bs={diff['bs']} graphs={diff['graphs']} ({diff['device']}): "
              f"+{diff['added_ops_per_cycle']:.1f} ops, +{diff['added_device_us_per_cycle']:.1f} µs device, "
              f"+{diff['added_wall_ms']:.3f} ms wall per cycle")
        print(f"  {'calls chain→tree':>18} {'µs chain→tree':>20}  name")
        for entry in diff["kernels"][:top]:
            print(f"  {entry['base_calls']:>7.1f} → {entry['calls']:<7.1f} {entry['base_us']:>8.1f} → "
                  f"{entry['us']:<8.1f}  {short(entry['name'])}")
        for entry in diff.get("sources", [])[:top]:
            print(f"  {entry['base_calls']:>7.1f} → {entry['calls']:<7.1f} {entry['base_us']:>8.1f} → "
                  f"{entry['us']:<8.1f}  [source] {short(entry['source'])}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64],
                        help="tree budgets (the chain always runs)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--cycles", type=int, default=20, help="cycles profiled per row")
    parser.add_argument("--repeat", type=int, default=50, help="cycles timed per row (wall_ms: their median)")
    parser.add_argument("--warmup", type=int, default=3, help="cycles run per row before anything is measured")
    parser.add_argument("--top", type=int, default=15, help="entries per top and diff list")
    parser.add_argument("--eager", action="store_true", help="on CUDA, also rows with graphs off")
    parser.add_argument("--target", type=Path, default=None, help="target model directory (default: the demo's)")
    parser.add_argument("--draft", type=Path, default=None, help="DFlash draft directory (default: the demo's)")
    parser.add_argument("--shape", default=None, help="the shape's name with --target")
    parser.add_argument("--dummy-shape", choices=["llama8b"], default=None, help="dummy weights of this shape")
    parser.add_argument("--smoke", action="store_true", help="tiny random weights on the CPU")
    add_out_argument(parser)
    add_commit_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.cycles, args.repeat, args.warmup = min(args.cycles, 2), min(args.repeat, 3), 1
    return write_rows("cycle_profile", args, measure)


if __name__ == "__main__":
    sys.exit(main())
