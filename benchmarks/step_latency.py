"""Step latency on Llama-3.1-8B shapes (random bf16 weights) with a 5-layer DFlash draft, on one GPU.

Times target verify, draft propose and the whole spec cycle (one scheduler step: the mean of back-to-back steps, so
an overlapped step counts as it runs in a serving loop; also with the overlap schedule off) at several batch sizes and
contexts, CUDA graphs on and off, per attention backend (`--backends triton flashinfer`: same run, same shapes);
the memory-bandwidth floor (weight and KV bytes read per step ÷ copy bandwidth measured in the same run; the
embedding table is not read, only its rows); target-only decode; and z-lab's `dflash_generate` on the
same shapes. With `--tp-size N` every engine also runs at tensor parallelism N (ranks on cuda:0..N-1; rows carry
"tp", floors are per GPU) and the goals add the bs-1 cycle at TP=N over TP=1. Writes
benchmarks/results/step_latency_<date>.json (+ .png).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.device_timing import DeviceSampler, cuda_ms, read_bandwidth, read_only_bandwidth, steady_ms
from benchmarks.results import add_out_argument, plot_result, write_json
from blockspec import Engine
from blockspec.bench.provenance import commit_id
from blockspec.pdl import pdl_enabled

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=128009,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}, rope_theta=500000.0,
)
DRAFT = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-6, max_position_embeddings=8192, rope_theta=500000.0, block_size=10, num_target_layers=32,
    dflash_config={"mask_token_id": 128002, "target_layer_ids": [1, 8, 15, 22, 29]},
)


def write_configs(root: Path) -> tuple[Path, Path]:
    (root / "target").mkdir(parents=True, exist_ok=True)
    (root / "draft").mkdir(parents=True, exist_ok=True)
    (root / "target" / "config.json").write_text(json.dumps(LLAMA_8B))
    (root / "draft" / "config.json").write_text(json.dumps(DRAFT))
    return root / "target", root / "draft"


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def prefill(engine: Engine, bs: int, context: int) -> list:
    reqs, _ = engine.make_requests(
        input_ids=[[int(t) for t in torch.randint(10, 120000, (context,))] for _ in range(bs)],
        sampling_params={"temperature": 0, "max_new_tokens": 100000, "ignore_eos": True},
    )
    for req in reqs:
        engine.scheduler.add_request(req)
    while any(r.pending_len != 1 for r in reqs):
        engine.step()
    return reqs


def measure(engine: Engine, bs: int, context: int, graphs: bool, repeat: int, sustained_s: float) -> dict[str, float]:
    runner, worker, scheduler = engine.runner, engine.worker, engine.scheduler
    runner.graphs.enabled = graphs
    reqs = prefill(engine, bs, context)
    # NOTE: cycle_ms is the steady-state step of a decode loop; synced_step_ms waits for the device around each step.
    result: dict[str, float] = {"synced_step_ms": cuda_ms(scheduler.step, repeat)}
    with DeviceSampler() as sampler:
        result["cycle_ms"] = steady_ms(scheduler.step, repeat)
    result.update(sampler.summary())
    if scheduler.steps.overlap:  # the same loop with the overlap schedule off (each cycle committed before the next)
        scheduler.steps.overlap = False
        result["sync_cycle_ms"] = steady_ms(scheduler.step, repeat)
        scheduler.steps.overlap = True
    if worker.is_speculative:
        for req in reqs:
            engine.runner.allocator.grow(req, req.kv_len + worker.block_size, engine.runner.req_to_token)
        draft_batch, proposals, _ = worker.propose(reqs)
        result["verify_ms"] = cuda_ms(lambda: worker.verify(reqs, proposals), repeat)
        result["propose_ms"] = cuda_ms(lambda: worker.propose(reqs), repeat)
        result["greedy_cycle_ms"] = cuda_ms(lambda: worker.greedy_cycle_tokens(reqs), repeat)
        if sustained_s > 0:  # NOTE: nothing is committed, so the context stays put however long the loop runs
            n = max(repeat, math.ceil(sustained_s * 1e3 / result["greedy_cycle_ms"]))
            with DeviceSampler() as sampler:
                result["sustained_greedy_cycle_ms"] = steady_ms(lambda: worker.greedy_cycle_tokens(reqs), n)
            result.update({f"sustained_{k}": v for k, v in sampler.summary().items()})
            if sampler.energy_j is not None:
                result["sustained_energy_per_cycle_j"] = sampler.energy_j / n
    for req in reqs:
        scheduler.abort(req.rid)
    scheduler.collect_finished()
    runner.graphs.enabled = True
    return result


def run_blockspec(
    root: Path, args: argparse.Namespace, bandwidth: float, save: Callable[[list[dict[str, Any]]], None]
) -> list[dict[str, Any]]:
    target_dir, draft_dir = write_configs(root)
    rows: list[dict[str, Any]] = []
    max_tokens = max(args.batch_sizes) * (max(args.contexts) + 512)
    specs, tp_sizes = (True,) if args.spec_only else (True, False), sorted({1, args.tp_size})
    for backend, spec, tp in itertools.product(args.backends, specs, tp_sizes):
        flags: dict[str, Any] = dict(model_path=str(target_dir), load_format="dummy", dtype="bfloat16",
                                     attention_backend=backend, tp_size=tp,
                                     skip_tokenizer_init=True, max_total_tokens=max_tokens,
                                     max_running_requests=max(args.batch_sizes), chunked_prefill_size=16384,
                                     cuda_graph_bs=args.batch_sizes)
        if spec:
            flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                         speculative_simulate_accept_len=args.accept_len,
                         speculative_adaptive_verify="off")  # NOTE: the full block: adaptive_verify.py times the rest
        start = time.perf_counter()
        engine = Engine(**flags)
        startup = time.perf_counter() - start
        model = engine.runner.model
        # NOTE: bytes read per step: the embedding table is not (only a few rows), unless it is the tied lm_head.
        embedding = 0 if model.config.tie_word_embeddings else param_bytes(model.model.embed_tokens)
        weights = param_bytes(model) - embedding
        draft_weights = param_bytes(engine.worker.draft) + engine.runner.model.lm_head.weight.numel() * 2 if spec else 0
        cfg = engine.runner.target_config
        kv_per_token = 2 * cfg.num_layers * engine.runner.num_local_kv_heads * cfg.head_dim * 2  # NOTE: per GPU
        draft_kv_per_token = 2 * 5 * max(1, 8 // tp) * 128 * 2 if spec else 0
        for context in args.contexts:
            for bs in args.batch_sizes:
                floor_bytes = weights + draft_weights + bs * context * (kv_per_token + draft_kv_per_token)
                for graphs in (True,) if args.graphs_only else (True, False):
                    m = measure(engine, bs, context, graphs, args.repeat, args.sustained_s if graphs else 0.0)
                    row = {"backend": backend, "spec": spec, "tp": tp, "bs": bs, "context": context, "graphs": graphs,
                           **m,
                           "floor_ms": floor_bytes / bandwidth * 1e3, "startup_s": startup}
                    row["cycle_over_floor"] = row["cycle_ms"] / row["floor_ms"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        save(rows)
    return rows


def run_reference(root: Path, context: int, new_tokens: int) -> dict[str, Any]:
    """z-lab's dflash_generate (bs 1) on the same shapes with random weights."""
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config
    except ImportError as error:
        return {"error": f"dflash reference unavailable: {error}"}
    with torch.device("cuda"):
        target_cfg = LlamaConfig(**{k: v for k, v in LLAMA_8B.items() if k != "architectures"})
        target = LlamaForCausalLM(target_cfg).to(torch.bfloat16).eval()
        draft_cfg = Qwen3Config(**{k: v for k, v in DRAFT.items() if k not in ("architectures", "dflash_config")})
        draft_cfg.dflash_config = DRAFT["dflash_config"]
        draft = DFlashDraftModel(draft_cfg).to(torch.bfloat16).eval()
    ids = torch.randint(10, 120000, (1, context), device="cuda")
    dflash_generate(draft, target, ids, 16, None, return_stats=True)
    stats = dflash_generate(draft, target, ids, new_tokens, None, return_stats=True)
    cycles = len(stats.acceptance_lengths)
    decode_s = stats.time_per_output_token * stats.num_output_tokens
    return {"context": context, "cycles": cycles, "cycle_ms": decode_s / max(cycles, 1) * 1e3,
            "accept_lengths_mean": sum(stats.acceptance_lengths) / max(cycles, 1)}


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except ImportError:
        return None
    return str(flashinfer.__version__)


def print_backend_comparison(rows: list[dict[str, Any]], backends: list[str]) -> None:
    """Graphed spec cycles side by side: each backend's cycle/verify/propose ms and the ratio to the first."""
    if len(backends) < 2:
        return
    base = backends[0]
    index = {(r["backend"], r["bs"], r["context"]): r for r in rows if r["spec"] and r["graphs"] and r["tp"] == 1}
    print(f"\nspec cycle with graphs, ms (ratio to {base}):")
    ordered = sorted(index.items(), key=lambda kv: (kv[0][2], kv[0][1], backends.index(kv[0][0])))
    for (backend, bs, context), row in ordered:
        ref = index.get((base, bs, context))
        parts = []
        for key in ("cycle_ms", "verify_ms", "propose_ms"):
            ratio = f" ({row[key] / ref[key]:.2f}x)" if ref is not None and backend != base else ""
            parts.append(f"{key[:-3]} {row[key]:7.2f}{ratio}")
        print(f"{backend:>10} bs {bs:>3} ctx {context:>5}: " + "  ".join(parts))


def goal_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """#4's goals per backend and context: bs-1 DFlash cycle / floor (<= 1.25) and bs-32 / bs-1 cycle (<= 2), at
    TP=1; #23's: the bs-1 DFlash cycle at TP=N over TP=1 (<= 0.6)."""
    index = {(r["backend"], r["bs"], r["context"]): r for r in rows if r["spec"] and r["graphs"] and r["tp"] == 1}
    parallel = {(r["backend"], r["context"], r["tp"]): r for r in rows
                if r["spec"] and r["graphs"] and r["tp"] > 1 and r["bs"] == 1}
    goals = []
    for (backend, bs, context), one in sorted(index.items()):
        if bs != 1:
            continue
        thirty_two = index.get((backend, 32, context))
        goal = {"backend": backend, "context": context, "bs1_cycle_over_floor": one["cycle_over_floor"]}
        for (tp_backend, tp_context, tp), row in parallel.items():
            if (tp_backend, tp_context) == (backend, context):
                goal[f"bs1_cycle_tp{tp}_over_tp1"] = row["cycle_ms"] / one["cycle_ms"]
        if thirty_two is not None:
            goal["bs32_over_bs1_cycle"] = thirty_two["cycle_ms"] / one["cycle_ms"]
            if "sync_cycle_ms" in one and "sync_cycle_ms" in thirty_two:
                goal["bs32_over_bs1_sync_cycle"] = thirty_two["sync_cycle_ms"] / one["sync_cycle_ms"]
            goal["bs32_over_bs1_graph_alone"] = thirty_two["greedy_cycle_ms"] / one["greedy_cycle_ms"]
            if "sustained_greedy_cycle_ms" in one and "sustained_greedy_cycle_ms" in thirty_two:
                goal["bs32_over_bs1_sustained_graph"] = (thirty_two["sustained_greedy_cycle_ms"]
                                                         / one["sustained_greedy_cycle_ms"])
        goals.append(goal)
    return goals


AB_KEYS = ("cycle_ms", "sync_cycle_ms", "greedy_cycle_ms")


def summarise_ab(paths: list[Path]) -> dict[str, Any]:
    """A same-run A/B (scripts/device_ab.sh: files tagged ab_new_* and ab_parent_*): per side and row, the cycle times
    of every round, their median and spread, and new ÷ parent."""
    reports = [json.loads(p.read_text()) for p in paths]
    sides: dict[str, list[dict[str, Any]]] = {}
    for path, report in zip(paths, reports):
        side = "new" if "_ab_new_" in path.name else "parent"
        sides.setdefault(side, []).append(report)
    commits = {side: runs[0]["commit"] for side, runs in sides.items()}
    rows = []
    for row in sides["new"][0]["rows"]:
        key = (row["spec"], row["bs"], row["context"])
        entry: dict[str, Any] = {"spec": row["spec"], "bs": row["bs"], "context": row["context"]}
        for side, runs in sides.items():
            for name in AB_KEYS:
                values = [r[name] for run in runs for r in run["rows"]
                          if (r["spec"], r["bs"], r["context"]) == key and name in r]
                if values:
                    entry[f"{side}_{name}"] = values
                    entry[f"{side}_{name}_median"] = statistics.median(values)
        entry["new_over_parent"] = entry["new_cycle_ms_median"] / entry["parent_cycle_ms_median"]
        entry["parent_spread_ms"] = max(entry["parent_cycle_ms"]) - min(entry["parent_cycle_ms"])
        rows.append(entry)
    first = sides["new"][0]
    return {"gpu": first["gpu"], "date": first["date"], "new_commit": commits["new"],
            "parent_commit": commits["parent"], "rounds": {s: len(r) for s, r in sides.items()},
            "accept_len": first["accept_len"], "backends": first["backends"], "rows": rows,
            "sources": [p.name for p in paths]}


def write_ab_summary(sources: list[Path]) -> Path:
    """`--ab-summary`: step_latency_ab_<date>_<new>_vs_<parent>.json beside the sources, printed, and its plot."""
    summary = summarise_ab(sources)
    name = f"step_latency_ab_{summary['date']}_{summary['new_commit']}_vs_{summary['parent_commit']}.json"
    out = write_json(sources[0].parent / name, summary)
    for row in summary["rows"]:
        print(f"{'DFlash' if row['spec'] else 'target'} bs {row['bs']:>2}: new {row['new_cycle_ms_median']:.2f} ms, "
              f"parent {row['parent_cycle_ms_median']:.2f} ms ({row['new_over_parent']:.3f}x; parent spread "
              f"{row['parent_spread_ms']:.2f} ms)")
    print(out, plot_result(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--backends", nargs="+", default=["triton"], choices=("triton", "flashinfer", "torch"),
                        help="attention backends to time in this run (each gets its own engines)")
    parser.add_argument("--accept-len", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=15)
    add_out_argument(parser)
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--spec-only", action="store_true", help="skip the target-only engine")
    parser.add_argument("--graphs-only", action="store_true", help="skip the rows with CUDA graphs off")
    parser.add_argument("--sustained-s", type=float, default=0.0,
                        help="also replay the greedy-cycle graph for this many seconds (clock and power settle)")
    parser.add_argument("--tp-size", type=int, default=1, help="also run every engine at this tensor-parallel size")
    parser.add_argument("--tag", default="", help="suffix of the result file name, e.g. an A/B label")
    parser.add_argument("--ab-summary", type=Path, nargs="+", metavar="JSON",
                        help="measure nothing: summarise a same-run A/B's step_latency_<date>_ab_*.json files")
    args = parser.parse_args()
    if args.ab_summary:
        write_ab_summary(args.ab_summary)
        return
    bandwidth = read_bandwidth()
    read_only = read_only_bandwidth()
    print(f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s, read-only {read_only / 1e12:.2f} TB/s", flush=True)
    reference = [] if args.skip_reference else [run_reference(Path("."), c, 64) for c in args.contexts]
    report = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit_id(),
              "torch": torch.__version__, "bandwidth_bytes_per_s": bandwidth,
              "read_only_bandwidth_bytes_per_s": read_only, "accept_len": args.accept_len,
              "backends": args.backends, "tp_size": args.tp_size, "flashinfer": flashinfer_version(),
              "pdl": pdl_enabled(torch.device("cuda")),
              "rows": [], "dflash_reference": reference}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_latency_{report['date']}{'_' + args.tag if args.tag else ''}.json"

    def save(rows: list[dict[str, Any]]) -> None:  # NOTE: after every engine, so a cut-short run keeps its rows
        report["rows"] = rows
        write_json(path, report)

    with tempfile.TemporaryDirectory() as tmp:
        rows = run_blockspec(Path(tmp), args, bandwidth, save)
    print(f"wrote {path}")
    print(f"{'backend':>10} {'spec':>5} {'bs':>3} {'ctx':>5} {'graph':>5} {'cycle':>8} {'sync':>8} {'verify':>8} "
          f"{'propose':>8} {'g-cycle':>8} {'floor':>7} {'x':>5}")
    for r in rows:
        print(f"{r['backend']:>10} {r['spec']!s:>5} {r['bs']:>3} {r['context']:>5} {r['graphs']!s:>5} "
              f"{r['cycle_ms']:8.2f} {r.get('sync_cycle_ms', 0):8.2f} {r.get('verify_ms', 0):8.2f} "
              f"{r.get('propose_ms', 0):8.2f} {r.get('greedy_cycle_ms', 0):8.2f} "
              f"{r['floor_ms']:7.2f} {r['cycle_over_floor']:5.2f}")
    for ref in reference:
        print("dflash reference:", ref)
    print_backend_comparison(rows, args.backends)
    report["goals"] = goal_summary(rows)
    write_json(path, report)
    for goal in report["goals"]:
        print("goals:", ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in goal.items()))


if __name__ == "__main__":
    main()
