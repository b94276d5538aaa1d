"""Adaptive verify length (#19): decode throughput of target-only, fixed DFlash (the full block every cycle) and
adaptive DFlash (verify length per batch size from the cost model) on Llama-3.1-8B shapes (random bf16 weights, the
5-layer draft of step_latency.py, block 10), one GPU, against batch size, at two contexts and two simulated
acceptance profiles (`--speculative-simulate-accept-profile`): the demo draft's measured histogram
(profiles/smollm2_demo_draft_gsm8k.json) and geometric with mean 6.

Steady state: per (context, batch size) the requests are prefilled once, then fixed and adaptive DFlash run in
alternating blocks of scheduler steps (overlap schedule on; each block ends by committing the step in flight), so
both see the same mean context; tokens/s = tokens committed in the blocks ÷ their wall time. Target-only runs the
same blocks on its own engine. Writes results/adaptive_verify_<date>_<commit>.json (rows: profile, context, bs,
target_tok_s, fixed_tok_s, adaptive_tok_s, ...) and the plot beside it; the commit comes from --commit,
$BLOCKSPEC_COMMIT or git. `--smoke`: a tiny CPU shape in seconds (tests/benchmarks/test_adaptive_verify_bench.py).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.results import add_commit_argument, add_out_argument, plot_result, resolved_commit, write_json
from benchmarks.step_latency import write_configs
from blockspec import Engine
from blockspec.request import Req
from blockspec.speculative.verify_length import AcceptanceStats, full_block

PROFILES = {"demo": str(Path(__file__).parent / "profiles" / "smollm2_demo_draft_gsm8k.json"),
            "geometric6": "geometric:6"}
TINY_TARGET = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2, rope_theta=10000.0,
)
TINY_DRAFT = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    max_position_embeddings=2048, rope_theta=10000.0, block_size=6, num_target_layers=2,
    dflash_config={"mask_token_id": 255, "target_layer_ids": [0, 1]},
)


def model_dirs(root: Path, smoke: bool) -> tuple[Path, Path]:
    if not smoke:
        return write_configs(root)
    for name, config in (("target", TINY_TARGET), ("draft", TINY_DRAFT)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    return root / "target", root / "draft"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill(engine: Engine, bs: int, context: int, vocab: int) -> list[Req]:
    reqs, _ = engine.make_requests(
        input_ids=[[int(t) for t in torch.randint(10, vocab - 10, (context,))] for _ in range(bs)],
        sampling_params={"temperature": 0, "max_new_tokens": 1 << 30, "ignore_eos": True},
    )
    for req in reqs:
        engine.scheduler.add_request(req)
    while any(r.pending_len != 1 for r in reqs):
        engine.step()
    return reqs


def timed_block(engine: Engine, reqs: list[Req], steps: int) -> tuple[int, float]:
    """(tokens committed, seconds) over `steps` scheduler steps and the commit of the last one in flight."""
    before = sum(r.num_output_tokens for r in reqs)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.scheduler.drain()
    sync()
    return sum(r.num_output_tokens for r in reqs) - before, time.perf_counter() - start


def same_draws(simulated: Any, seed: int) -> None:
    """Common random numbers: both modes' blocks of a round draw the same simulated accept lengths, cycle by cycle
    (one [bs, 1] uniform per cycle whatever its verify length), so their difference is the verify length's alone."""
    if simulated.generator is not None:
        simulated.generator.manual_seed(seed)
    else:  # NOTE: captured graphs draw from the default CUDA generator; reseeding it restarts their sequence
        torch.cuda.manual_seed(seed)


def release(engine: Engine, reqs: list[Req]) -> None:
    for req in reqs:
        engine.scheduler.abort(req.rid)
    engine.scheduler.collect_finished()


def measure_target(
    engine: Engine, contexts: list[int], sizes: list[int], args: argparse.Namespace
) -> dict[tuple[int, int], dict[str, float]]:
    out: dict[tuple[int, int], dict[str, float]] = {}
    vocab = engine.runner.target_config.vocab_size
    for context in contexts:
        for bs in sizes:
            reqs = prefill(engine, bs, context, vocab)
            timed_block(engine, reqs, args.block_steps)  # NOTE: warm-up, untimed
            tokens, seconds = 0, 0.0
            for _ in range(args.rounds):
                t, s = timed_block(engine, reqs, args.block_steps)
                tokens, seconds = tokens + t, seconds + s
            out[(context, bs)] = {"target_tok_s": tokens / seconds, "target_mean_context": mean_context(reqs)}
            release(engine, reqs)
            print(f"target ctx {context} bs {bs}: {tokens / seconds:.0f} tok/s", flush=True)
    return out


def mean_context(reqs: list[Req]) -> float:
    return sum(r.kv_len for r in reqs) / len(reqs)


def measure_dflash(engine: Engine, profile: str, context: int, bs: int, args: argparse.Namespace) -> dict[str, Any]:
    worker = engine.worker
    adaptive = worker.verify_policy
    fixed = full_block(worker.block_size, "benchmark: the full block every cycle")
    worker.simulated.set_profile(profile)
    # NOTE: each mode learns acceptance from its own cycles only: adaptive must not see full-block verifies it
    # would not have run itself.
    stats = {"fixed": AcceptanceStats(worker.block_size - 1), "adaptive": AcceptanceStats(worker.block_size - 1)}
    policies = {"fixed": fixed, "adaptive": adaptive}
    reqs = prefill(engine, bs, context, engine.runner.target_config.vocab_size)
    totals = {"fixed": [0, 0.0], "adaptive": [0, 0.0]}
    for mode in ("fixed", "adaptive", "adaptive"):  # NOTE: warm-up: live acceptance and cycle times settle here
        worker.verify_policy, worker.acceptance = policies[mode], stats[mode]
        timed_block(engine, reqs, args.block_steps)
    used: dict[int, int] = {}
    for round_index in range(args.rounds):
        order = ("fixed", "adaptive") if round_index % 2 == 0 else ("adaptive", "fixed")
        for mode in order:
            worker.verify_policy, worker.acceptance = policies[mode], stats[mode]
            same_draws(worker.simulated, 1000 + round_index)
            tokens, seconds = timed_block(engine, reqs, args.block_steps)
            totals[mode][0] += tokens
            totals[mode][1] += seconds
            if mode == "adaptive":
                n = adaptive.last[bs].num_draft_tokens
                used[n] = used.get(n, 0) + 1
    worker.verify_policy, worker.acceptance = adaptive, stats["adaptive"]
    choice = adaptive.last[bs]
    row = {"fixed_tok_s": totals["fixed"][0] / totals["fixed"][1],
           "adaptive_tok_s": totals["adaptive"][0] / totals["adaptive"][1],
           "adaptive_num_draft_tokens": choice.num_draft_tokens, "adaptive_reason": choice.reason,
           "adaptive_blocks_by_num_draft_tokens": {str(n): c for n, c in sorted(used.items())},
           "expected_tokens_full_block": worker.acceptance.expected_tokens(worker.block_size),
           "profile_mean_accept_length": worker.simulated.mean_accept_length, "dflash_mean_context": mean_context(reqs)}
    release(engine, reqs)
    return row


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """#19's goals: adaptive ≥ 0.97 × max(fixed, target) and ≥ target everywhere; within 2 % of fixed at bs 1;
    ≥ 1.3 × target for the mean-6 profile at bs 64, context 512."""
    envelope = [r["adaptive_tok_s"] / max(r["fixed_tok_s"], r["target_tok_s"]) for r in rows]
    over_target = [r["adaptive_tok_s"] / r["target_tok_s"] for r in rows]
    bs1 = [r["adaptive_tok_s"] / r["fixed_tok_s"] for r in rows if r["bs"] == 1]
    big = [r["adaptive_tok_s"] / r["target_tok_s"] for r in rows
           if r["profile"] == "geometric6" and r["bs"] == 64 and r["context"] == 512]
    return {"min_adaptive_over_envelope": min(envelope), "envelope_goal_met": min(envelope) >= 0.97,
            "min_adaptive_over_target": min(over_target), "target_goal_met": min(over_target) >= 1.0,
            "min_bs1_adaptive_over_fixed": min(bs1, default=None),
            "bs1_goal_met": bool(bs1) and min(bs1) >= 0.98,
            "geometric6_bs64_ctx512_over_target": big[0] if big else None,
            "bs64_goal_met": bool(big) and big[0] >= 1.3}


def build(target_dir: Path, draft_dir: Path | None, args: argparse.Namespace, sizes: list[int],
          contexts: list[int]) -> Engine:
    flags: dict[str, Any] = dict(model_path=str(target_dir), load_format="dummy", skip_tokenizer_init=True,
                                 max_total_tokens=max(sizes) * (max(contexts) + args.headroom),
                                 max_running_requests=max(sizes), chunked_prefill_size=16384, cuda_graph_bs=sizes)
    flags.update(device="cpu", dtype="float32") if args.smoke else flags.update(dtype="bfloat16")
    if draft_dir is not None:
        flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                     speculative_simulate_accept_profile=PROFILES[args.profiles[0]])
        if args.smoke:
            flags["speculative_adaptive_verify"] = "on"  # NOTE: no CUDA graphs on the CPU: time eager cycles
    return Engine(**flags)


def free(engine: Engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--block-steps", type=int, default=8, help="scheduler steps per timed block")
    parser.add_argument("--rounds", type=int, default=4, help="timed blocks per mode (fixed and adaptive alternate)")
    parser.add_argument("--headroom", type=int, default=1024, help="KV slots per request beyond the context")
    add_commit_argument(parser)
    add_out_argument(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (bs 1 2, context 16)")
    args = parser.parse_args()
    if args.smoke:
        args.batch_sizes, args.contexts, args.block_steps, args.rounds = [1, 2], [16], 3, 2
    commit = resolved_commit(args)
    date = datetime.date.today().isoformat()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    report: dict[str, Any] = {"gpu": device, "date": date, "commit": commit, "torch": torch.__version__,
                              "shapes": "tiny" if args.smoke else "llama-3.1-8b + 5-layer draft, block 10",
                              "profiles": {name: PROFILES[name] for name in args.profiles}, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"adaptive_verify_{date}_{commit}.json"
    sizes, contexts = sorted(args.batch_sizes), sorted(args.contexts)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = model_dirs(Path(tmp), args.smoke)
        began = time.perf_counter()
        engine = build(target_dir, None, args, sizes, contexts)
        report["target_startup_s"] = time.perf_counter() - began
        target = measure_target(engine, contexts, sizes, args)
        free(engine)
        began = time.perf_counter()
        engine = build(target_dir, draft_dir, args, sizes, contexts)
        report["dflash_startup_s"] = time.perf_counter() - began  # NOTE: graphs for every verify length + their timing
        report["verify_length_startup"] = engine.get_server_info()["internal_states"][0]["verify_length"]
        for context in contexts:
            for bs in sizes:
                for name in args.profiles:
                    row = {"profile": name, "context": context, "bs": bs, **target[(context, bs)],
                           **measure_dflash(engine, PROFILES[name], context, bs, args)}
                    report["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    write_json(path, report)  # NOTE: a cut-short run keeps its rows
        report["verify_length_end"] = engine.get_server_info()["internal_states"][0]["verify_length"]
        free(engine)
    report["goals"] = goals(report["rows"])
    report["wall_s"] = time.perf_counter() - started
    write_json(path, report)
    print(f"wrote {path}; {plot_result(path)}")
    print(f"{'profile':>10} {'ctx':>5} {'bs':>3} {'target':>9} {'fixed':>9} {'adaptive':>9} {'n':>3} "
          f"{'÷ envelope':>10}")
    for r in report["rows"]:
        envelope = r["adaptive_tok_s"] / max(r["fixed_tok_s"], r["target_tok_s"])
        print(f"{r['profile']:>10} {r['context']:>5} {r['bs']:>3} {r['target_tok_s']:9.0f} {r['fixed_tok_s']:9.0f} "
              f"{r['adaptive_tok_s']:9.0f} {r['adaptive_num_draft_tokens']:>3} {envelope:10.3f}")
    print("goals:", json.dumps(report["goals"]))


if __name__ == "__main__":
    main()
