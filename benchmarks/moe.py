"""Mixture-of-experts targets on one GPU (#51): Qwen3-30B-A3B shapes (48 layers, hidden 2048, 128 experts, top 8,
expert intermediate 768, 32 query / 4 KV heads, vocab 151,936), dummy bf16 weights, a 5-layer DFlash draft of the
same hidden size (block 16, simulated accept length 6).

Rows (`rows` in the result), each with mode, bs, step_ms, touched_experts_per_layer, floor_ms:
- "layer_decode" / "layer_verify": one MoE layer (SparseMoe, the fused Triton experts) over bs tokens / bs verify
  blocks of 16 tokens: --layer-copies layers with their own weights run in sequence in one CUDA graph replayed back
  to back, per layer (what a layer costs inside a model's graph, without a graph launch and sync per layer); its
  floor is the bytes of the experts the batch touches (and the router) at the copy bandwidth measured in the same
  run, so a verify block that hits more experts is judged fairly.
- "target_decode" / "dflash_cycle" / "dflash_adaptive": one scheduler step of the engine (CUDA graphs; the mean of
  back-to-back steps) at context --context, with tokens_per_step (committed tokens per step, all requests) and
  verify_tokens (the verify length in use); the DFlash cycle with the whole block and with adaptive verify on. Its
  floor: every weight but the experts and the embedding table, the touched experts of every sparse layer, the KV
  read (and the draft and lm_head under DFlash).
Touched experts: the layer rows count the router's picks on random hidden states of that many tokens (dummy weights
route at random; real routing is more correlated: fewer experts). The step rows count what the engine's own batch
routes to: after the timed steps, one more step runs eagerly (`graphs.enabled` off: a graph replay runs no Python
hooks) with a forward hook on every sparse layer (it routes the layer's input with the layer's router: the fused
router of a few tokens never calls the gate module), and touched_experts_per_layer is the mean over those layers
(touched_experts_random beside it: the random-input count the step rows used before, for comparison). The floor
sums each layer's own count.
The layer rows route up to 16 tokens (decode bs 1 and 8, one verify block) with the fused router
(layers/fused_router.py); `--router-tokens 0` times the same rows on the router's GEMM and `fused_route` instead,
the path before it (the flag is in the result's `args`).

With `--parts kernels`, where each layer row's time goes (`kernel_breakdown`: mode, bs, tokens, device, in_graph,
wall_us_per_layer, kernel_us_per_layer, launches_per_layer, kernels): the layer rows' graph replayed under
torch.profiler, each kernel's calls and device µs per layer (in_graph False: CUPTI reported no kernel inside the
replays, so the layers ran eagerly; on the CPU, the leaf ops instead: counts only).

With `--parts router`, the router alone (`router_sweep`: tokens, path, experts_per_program, num_warps, us, chosen)
at each token count of the layer rows up to the fused router's limit: the fused router at each launch shape of
ROUTER_GRID beside the router's GEMM + `fused_route`, in a CUDA graph of --layer-copies routers.

With `--parts tiles`, the fused experts' tile sweep: per layer mode and batch size, `fused_experts` with each tile
set of a grid (BLOCK_M × BLOCK_N × BLOCK_K × warps × pipeline stages; `--tile-grid full`, `small`, or `large`: tall
blocks, wide column tiles and deeper pipelines for batches with many rows per expert; batches of up to 8 tokens also
the direct sets, one pair per block without the sort, each with the down and combine kernels (down_columns None),
those again with the down weights asked of L2 while the gate/up kernel runs (prefetch_down), and with the combine
folded into the down projection at each down_columns) on the layer's own routing, in a CUDA graph, beside the tiles
`choose_tiles` picks; rows go to `tile_sweep` (mode, bs, block_m, block_n, block_k, num_warps, num_stages, direct,
down_columns, prefetch_down, step_ms, over_floor, chosen). It is how choose_tiles's thresholds are set from
measurements.

With `--parts serving`, #51's serving table: benchmarks/serving_vs_engine.py on the same shapes (dummy weights),
DFlash (simulated accept length --accept-len) and target-only at 1 and 64 closed-loop clients, the offline engine and
`blockspec serve` side by side; its rows go to `serving`, and `serving_summary` holds DFlash ÷ target-only per client
and concurrency (served tokens/s, the engine's ratio beside it). Its workload is per shape (SERVING_DEFAULTS; each
number a --serving-* flag): 30b-a3b sends 256 prompts of 512 tokens, 128 new tokens each (8 a client at 1 client, 4 at
64), and is sized to one device call of its own (estimated ~400 s of its 600: the 30B target is built three times a
mode, one engine per level and the server); a mode that has not started by --serving-budget-s is left out
(`serving_errors`; a next call with --serving-modes target), and at --serving-timeout-s the run is stopped and the
rows it measured kept (`serving_timed_out`). Its own result JSON lands in --out/moe_serving.
--shape tiny runs everything small on the CPU (plumbing only, timings meaningless; tests/benchmarks/test_moe_bench.py;
its serving workload is sized for a 2-core CPU). Writes moe_<date>_<commit>[_<tag>].json under --out.
On the device: `scripts/device.sh bench moe --parts layer step`, and `scripts/device.sh bench moe --parts serving`
alone in a call.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.adaptive_verify import prefill
from benchmarks.profile_events import CycleTable, cycle_table
from benchmarks.results import add_out_argument, plot_result, result_path, write_json
from benchmarks.serving_vs_engine import MODES as SERVING_MODES
from benchmarks.serving_vs_engine_support import CLIENTS
from blockspec import Engine
from blockspec.bench.provenance import run_identity
from blockspec.layers.moe import ExpertRouting, SparseMoe, StackedExperts, route

TILE_GRIDS = {
    "full": dict(block_m=(16, 32, 64, 128), block_n=(16, 32, 64, 128), block_k=(64, 128), num_warps=(4, 8),
                 num_stages=(3,), down_columns=(None, 16, 32)),
    "small": dict(block_m=(16, 32), block_n=(64,), block_k=(128,), num_warps=(4,), num_stages=(3,),
                  down_columns=(None, 16)),
    # NOTE: the full grid's blocks pipelined deeper (4 and 5 stages) and wider (256 columns of gate and of up): the
    # published tunings for 128 experts of 768 on an H100 at 512 and 1024 tokens use 64-row blocks, 3-5 stages
    "large": dict(block_m=(32, 64, 128), block_n=(64, 128, 256), block_k=(64, 128), num_warps=(4, 8),
                  num_stages=(4, 5), down_columns=(None,)),
}
DIRECT_MAX_TOKENS = 8  # NOTE: batches up to this many tokens also time the direct sets (one pair per block, no sort)
# NOTE: the fused router's launch shapes the `router` part times: experts a program and warps, those pairs whose
# program holds at most ROUTER_MAX_PARTIALS fp32 partial sums a thread (the default, 4 experts over 4 warps at hidden
# 2048, holds 64; more would spill)
ROUTER_GRID = dict(experts_per_program=(1, 2, 4, 8), num_warps=(1, 2, 4, 8))
ROUTER_MAX_PARTIALS = 128

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1e6,
    tie_word_embeddings=False, eos_token_id=151645,
)
DRAFT_30B_A3B = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1e6, block_size=16, num_target_layers=48,
    dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]},
)
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
            num_experts_per_tok=4, max_position_embeddings=2048, eos_token_id=2)
TINY_DRAFT = dict(DRAFT_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  block_size=4, num_target_layers=4, dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 2]})
SHAPES = {"30b-a3b": (QWEN3_30B_A3B, DRAFT_30B_A3B), "tiny": (TINY, TINY_DRAFT)}


@dataclass(frozen=True)
class ServingWorkload:
    """The `--parts serving` workload of a shape (each field the default of its --serving-* flag): prompts, closed-loop
    rounds per client (the 1-client level sends `rounds` prompts, the 64-client level min(64 x rounds, prompts)),
    prompt and new-token lengths, the seconds after which no new mode starts (budget_s) and after which the run is
    stopped (timeout_s)."""

    prompts: int
    rounds: int
    prompt_len: int
    new_tokens: int
    budget_s: float
    timeout_s: float


# NOTE: 30b-a3b fits one device call (600 s, of which moe.py's start and the device script's set-up take ~25 s) on an
# H100 80 GB. Each mode builds the dummy 30B target (61 GB bf16, initialised on the GPU) three times: one engine per
# level in the engine phase, then the server. What costs is not the weights but each build's CUDA graphs (12 batch
# sizes, 48 layers; DFlash also its verify lengths and draft) and, in the first build of a fresh machine, the Triton
# compiles: estimated ~90 s cold and ~30-40 s warm a build, plus ~10 s (engine process) and ~25 s (server) of process
# start. The levels are short beside that: the 1-client level sends 8 prompts (1,024 new tokens), the 64-client level
# 256 (32,768 new tokens, 4 rounds a client), each on both sides: ~20 s a mode for DFlash and ~40 s for target-only at
# the engine step rates of --parts step. So DFlash ~220 s (first, cold) and target-only ~170 s: ~400 s in all. The
# budget (270 s) starts target-only only if it can still end before the timeout (480 s), and the timeout leaves
# SERVING_STOP_GRACE_S for the stop and the JSON before the call's limit. The tiny shape's workload is sized to finish
# on a 2-core CPU in a few minutes.
SERVING_DEFAULTS = {
    "30b-a3b": ServingWorkload(prompts=256, rounds=8, prompt_len=512, new_tokens=128, budget_s=270.0, timeout_s=480.0),
    "tiny": ServingWorkload(prompts=128, rounds=2, prompt_len=64, new_tokens=32, budget_s=240.0, timeout_s=480.0),
}
SERVING_CONCURRENCY = (1, 64)  # NOTE: #51's levels
SERVING_STOP_GRACE_S = 75.0  # NOTE: serving_vs_engine's server stop waits up to 60 s on SIGTERM before SIGKILL


def write_configs(root: Path, shape: str) -> tuple[Path, Path]:
    target, draft = SHAPES[shape]
    for name, config in (("target", target), ("draft", draft)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    return root / "target", root / "draft"


def timer(device: torch.device, repeat: int) -> Callable[[Callable[[], Any]], float]:
    """ms per call: benchmarks.device_timing on CUDA, a plain clock on the CPU (--shape tiny)."""
    if device.type == "cuda":
        from benchmarks.device_timing import cuda_ms

        return lambda fn: cuda_ms(fn, repeat)

    def cpu_ms(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeat

    return cpu_ms


def steady(device: torch.device, repeat: int, fn: Callable[[], Any]) -> float:
    if device.type == "cuda":
        from benchmarks.device_timing import steady_ms

        return steady_ms(fn, repeat)
    return timer(device, repeat)(fn)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device copy (read + written), the floor's bandwidth; 1e11 on the CPU (plumbing)."""
    if device.type != "cuda":
        return 1e11
    from benchmarks.device_timing import read_bandwidth

    return read_bandwidth()


def touched_experts(gate: torch.nn.Linear, routing: ExpertRouting, tokens: int, seed: int) -> int:
    """Distinct experts the router picks for `tokens` random hidden states (random routing, as dummy weights give)."""
    generator = torch.Generator(device=gate.weight.device).manual_seed(seed)
    x = torch.randn(tokens, gate.in_features, generator=generator, device=gate.weight.device, dtype=gate.weight.dtype)
    with torch.no_grad():
        return int(route(gate(x), routing)[1].unique().numel())


def engine_touched_experts(engine: Engine, sparse: list[SparseMoe], routing: ExpertRouting) -> tuple[list[int], int]:
    """Distinct experts each sparse layer's router picked in one more engine step, run eagerly (a graph replay runs
    no hooks), in the order the layers ran (the step's forwards of the target, one count per layer each), and the
    tokens that step routed. NOTE: the step's own cycle time (eager, with a host read in every hook) reaches adaptive
    verify's live offset of this batch size's graphs: the caller measures this batch size no more."""
    counts: list[int] = []
    tokens: list[int] = []

    def count(layer: torch.nn.Module, inputs: Any, _out: torch.Tensor) -> None:
        # NOTE: the routing recomputed from the layer's input: up to FUSED_ROUTER_MAX_TOKENS tokens the layer routes
        # in one fused launch and never calls its `gate` module, so a hook on the gate would miss those steps
        x = inputs[0]
        counts.append(int(route(layer.gate(x), routing)[1].unique().numel()))
        tokens.append(x.shape[0])

    handles = [layer.register_forward_hook(count) for layer in sparse]
    graphs = engine.runner.graphs
    enabled, graphs.enabled = graphs.enabled, False
    try:
        engine.scheduler.drain()  # NOTE: the graphed step in flight commits first; then one eager step, committed
        engine.step()
        engine.scheduler.drain()
    finally:
        graphs.enabled = enabled
        for handle in handles:
            handle.remove()
    return counts, max(tokens, default=0)


def expert_bytes(config: dict[str, Any], element: int) -> int:
    """Bytes of one expert (gate, up and down)."""
    return 3 * config["hidden_size"] * config["moe_intermediate_size"] * element


def expert_routing(config: dict[str, Any]) -> ExpertRouting:
    return ExpertRouting(config["num_experts"], config["num_experts_per_tok"], config["norm_topk_prob"])


def dummy_layer(config: dict[str, Any], device: torch.device, dtype: torch.dtype,
                backend: Optional[str] = None) -> SparseMoe:
    """One MoE layer of the shape with random weights (`backend`: SparseMoe's; None picks by device)."""
    layer = SparseMoe(config["hidden_size"], config["moe_intermediate_size"], expert_routing(config), backend=backend)
    layer = layer.to(device, dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.02)
    return layer


def graphed(runs: list[Callable[[], Any]], device: torch.device) -> Callable[[], Any]:
    """What runs `runs` once each, in order, after one warm-up of each (which compiles its kernels): on CUDA the
    replay of one CUDA graph that captured them all (which also shows they capture), on the CPU the runs."""
    for run in runs:
        run()
    if device.type != "cuda":
        return lambda: [run() for run in runs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    return graph.replay


def graphed_ms(runs: list[Callable[[], Any]], device: torch.device, repeat: int) -> float:
    """ms per run of `runs` (one per layer copy, each reading its own weights), replayed back to back (`graphed`): a
    layer's share of the device time, as inside a model's graph, without the launch and synchronisation of a graph of
    its own. NOTE: distinct copies, so no layer reads weights a previous run left in L2."""
    replay = graphed(runs, device)
    if device.type == "cuda":
        return steady(device, repeat, replay) / len(runs)
    return timer(device, repeat)(replay) / len(runs)


def layer_copies(config: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 backend: Optional[str] = None) -> list[SparseMoe]:
    """--layer-copies MoE layers of the shape, each with its own random weights (on the CPU: one), routing with the
    fused router up to --router-tokens tokens when given (else the layer's default)."""
    copies = args.layer_copies if device.type == "cuda" else 1
    layers = [dummy_layer(config, device, dtype, backend) for _ in range(copies)]
    if args.router_tokens is not None:
        for layer in layers:
            layer.fused_router_tokens = args.router_tokens
    return layers


def routed_copies(layers: list[SparseMoe], x: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """Each layer copy's routing of x (weights, ids) and the experts they touch, on average over the copies."""
    routed = [route(layer.gate(x), layer.routing) for layer in layers]
    return routed, sum(int(ids.unique().numel()) for _, ids in routed) / len(routed)


def layer_shapes(args: argparse.Namespace) -> Iterator[tuple[str, int, int]]:
    """The layer rows, in their order: (mode, bs, tokens) for decode (one token a request) and verify (--block tokens
    a request) at each --batch-sizes."""
    for mode, per_request in (("layer_decode", 1), ("layer_verify", args.block)):
        for bs in args.batch_sizes:
            yield mode, bs, bs * per_request


def layer_batches(config: dict[str, Any], args: argparse.Namespace, device: torch.device,
                  dtype: torch.dtype) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """Per layer row (`layer_shapes`): (mode, bs, random hidden states x [tokens, H], an output like x)."""
    for mode, bs, tokens in layer_shapes(args):
        x = torch.randn(tokens, config["hidden_size"], device=device, dtype=dtype)
        yield mode, bs, x, torch.empty_like(x)


def layer_calls(layers: list[SparseMoe], x: torch.Tensor, out: torch.Tensor) -> list[Callable[[], Any]]:
    """One call per layer copy: the layer over x, into out."""
    return [lambda layer=layer: layer(x, out) for layer in layers]


def layer_rows(config: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
               bandwidth: float) -> list[dict[str, Any]]:
    """One MoE layer per mode and batch size: --layer-copies layers in sequence in one CUDA graph on CUDA, per layer."""
    layers = layer_copies(config, args, device, dtype)
    element = torch.empty(0, dtype=dtype).element_size()
    router_bytes = layers[0].gate.weight.numel() * element
    rows = []
    for mode, bs, x, out in layer_batches(config, args, device, dtype):
        with torch.no_grad():
            _, touched = routed_copies(layers, x)
            ms = graphed_ms(layer_calls(layers, x, out), device, args.repeat)
        floor_ms = (touched * expert_bytes(config, element) + router_bytes) / bandwidth * 1e3
        rows.append({"mode": mode, "bs": bs, "tokens": x.shape[0], "step_ms": ms,
                     "touched_experts_per_layer": touched, "floor_ms": floor_ms, "over_floor": ms / floor_ms})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kernel_rows(config: dict[str, Any], args: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> list[dict[str, Any]]:
    """Where a layer row's time goes: per mode and batch size, --profile-replays replays of the layer rows' graph
    (--layer-copies layers) under torch.profiler, reduced per layer (benchmarks/profile_events.py): each kernel's
    calls and device µs, their sum, and the layer's wall time (timed replays of the same graph). NOTE: under PDL a
    kernel's start overlaps its predecessor's tail, so the kernels' sum can exceed the wall time; where it falls
    short, the device sat idle between kernels (launch gaps, dependent waits)."""
    layers = layer_copies(config, args, device, dtype)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def launches(run: Callable[[], Any]) -> CycleTable:
        with profile(activities=activities) as trace:
            for _ in range(args.profile_replays):
                run()
            if cuda:
                torch.cuda.synchronize()
        return cycle_table(trace.events(), args.profile_replays * len(layers), cuda)

    rows = []
    for mode, bs, x, out in layer_batches(config, args, device, dtype):
        calls = layer_calls(layers, x, out)
        with torch.no_grad():
            replay = graphed(calls, device)
            wall_ms = steady(device, args.repeat, replay)
            table, in_graph = launches(replay), cuda
            if cuda and table.kernels_per_cycle == 0:  # NOTE: CUPTI saw no kernel inside the replays: the calls eagerly
                table, in_graph = launches(lambda: [call() for call in calls]), False
        rows.append({"mode": mode, "bs": bs, "tokens": x.shape[0], "device": table.device, "in_graph": in_graph,
                     "wall_us_per_layer": wall_ms * 1e3 / len(layers),
                     "kernel_us_per_layer": table.us_per_cycle, "launches_per_layer": table.ops_per_cycle,
                     "kernels": table.top("name", args.top_kernels)})
        print(json.dumps({key: value for key, value in rows[-1].items() if key != "kernels"}), flush=True)
        for kernel in rows[-1]["kernels"]:
            print(f"    {kernel['us_per_cycle']:9.2f} us {kernel['calls_per_cycle']:6.2f}x  {kernel['name'][:90]}")
    return rows


def router_rows(config: dict[str, Any], args: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> list[dict[str, Any]]:
    """The router alone (the routing's logits, softmax and top k) per token count a layer row routes with the fused
    router: the fused router at each launch shape of ROUTER_GRID, and the router's GEMM + `fused_route` (the path
    past FUSED_ROUTER_MAX_TOKENS), --layer-copies routers (own weights and counters each) in one CUDA graph, µs per
    router; `chosen` marks the shape the layer launches."""
    import triton

    from blockspec.layers.fused_moe import fused_route
    from blockspec.layers.fused_router import (EXPERTS_PER_PROGRAM, FUSED_ROUTER_MAX_TOKENS, MAX_BLOCK_H, NUM_WARPS,
                                               fused_router, new_router_counters)

    layers = layer_copies(config, args, device, dtype, backend="triton")
    routing = layers[0].routing
    gates = [layer.gate.weight for layer in layers]
    counters = [new_router_counters(device) for _ in layers]
    chunk = min(MAX_BLOCK_H, triton.next_power_of_2(config["hidden_size"]))
    shapes = [(experts, warps) for experts in ROUTER_GRID["experts_per_program"] for warps in ROUTER_GRID["num_warps"]
              if experts * chunk <= ROUTER_MAX_PARTIALS * 32 * warps]
    token_counts = sorted({tokens for _, _, tokens in layer_shapes(args) if tokens <= FUSED_ROUTER_MAX_TOKENS})
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, config["hidden_size"], device=device, dtype=dtype)
        with torch.no_grad():
            for experts, warps in shapes:
                runs = [lambda gate=gate, counter=counter, experts=experts, warps=warps: fused_router(
                    x, gate, counter, routing.top_k, routing.renormalize, experts, warps)
                    for gate, counter in zip(gates, counters)]
                rows.append({"tokens": tokens, "path": "fused", "experts_per_program": experts, "num_warps": warps,
                             "us": graphed_ms(runs, device, args.repeat) * 1e3,
                             "chosen": (experts, warps) == (EXPERTS_PER_PROGRAM, NUM_WARPS)})
            runs = [lambda gate=gate: fused_route(torch.nn.functional.linear(x, gate), routing.num_experts,
                                                  routing.top_k, routing.renormalize) for gate in gates]
            rows.append({"tokens": tokens, "path": "gemm_route", "experts_per_program": None, "num_warps": None,
                         "us": graphed_ms(runs, device, args.repeat) * 1e3, "chosen": False})
        best = min((row for row in rows if row["tokens"] == tokens), key=lambda row: row["us"])
        print(json.dumps({"tokens": tokens, "chosen_us": next(r["us"] for r in rows if r["tokens"] == tokens
                                                              and r["chosen"]), "best": best}), flush=True)
    return rows


def tile_rows(config: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              bandwidth: float) -> list[dict[str, Any]]:
    """fused_experts per tile set of the grid, per layer mode and batch size (the layer's routing of random tokens),
    replayed from a CUDA graph on CUDA; `chosen` marks the set choose_tiles picks for that batch."""
    import triton

    from blockspec.layers.fused_moe import ExpertTiles, choose_tiles, fused_experts

    layers = layer_copies(config, args, device, dtype, backend="triton")
    routing = layers[0].routing
    grid = TILE_GRIDS[args.tile_grid]
    sets = [ExpertTiles(m, n, k, warps, stages) for m in grid["block_m"] for n in grid["block_n"]
            for k in grid["block_k"] for warps in grid["num_warps"] for stages in grid["num_stages"]]
    direct_sets = [ExpertTiles(16, n, k, warps, stages, direct=True, down_columns=columns, prefetch_down=prefetch)
                   for n in grid["block_n"] for k in grid["block_k"] for warps in grid["num_warps"]
                   for stages in grid["num_stages"] for columns in grid["down_columns"]
                   for prefetch in ((False, True) if columns is None else (False,))]
    element = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for mode, per_request in (("layer_decode", 1), ("layer_verify", args.block)):
        for bs in args.batch_sizes:
            x = torch.randn(bs * per_request, config["hidden_size"], device=device, dtype=dtype)
            out = torch.empty_like(x)
            with torch.no_grad():
                routed, touched = routed_copies(layers, x)
                chosen = choose_tiles(routed[0][1].numel(), routing.num_experts, num_tokens=x.shape[0])
                floor_ms = touched * expert_bytes(config, element) / bandwidth * 1e3
                for tiles in sets + (direct_sets if x.shape[0] <= DIRECT_MAX_TOKENS else []):
                    runs = [lambda layer=layer, weights=weights, ids=ids, tiles=tiles: fused_experts(
                        x, layer.experts.gate_up_proj, layer.experts.down_proj, weights, ids, out, tiles=tiles)
                        for layer, (weights, ids) in zip(layers, routed)]
                    try:
                        ms = graphed_ms(runs, device, args.repeat)
                    except triton.runtime.errors.OutOfResources:  # NOTE: the set's tiles do not fit this GPU
                        continue
                    rows.append({"mode": mode, "bs": bs, "block_m": tiles.block_m, "block_n": tiles.block_n,
                                 "block_k": tiles.block_k, "num_warps": tiles.num_warps,
                                 "num_stages": tiles.num_stages, "direct": tiles.direct,
                                 "down_columns": tiles.down_columns, "prefetch_down": tiles.prefetch_down,
                                 "step_ms": ms, "over_floor": ms / floor_ms, "chosen": tiles == chosen})
            best = min((row for row in rows if row["mode"] == mode and row["bs"] == bs), key=lambda row: row["step_ms"])
            print(json.dumps({"mode": mode, "bs": bs, "best": best}), flush=True)
    return rows


def param_bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def step_rows(config: dict[str, Any], target_dir: Path, draft_dir: Path, args: argparse.Namespace,
              device: torch.device, bandwidth: float) -> list[dict[str, Any]]:
    """Scheduler steps of target-only decode and of the DFlash cycle (whole block, adaptive verify) per batch size."""
    rows = []
    modes: list[tuple[str, dict[str, Any]]] = [
        ("target_decode", {}),
        ("dflash_cycle", dict(speculative_adaptive_verify="off")),
        ("dflash_adaptive", dict(speculative_adaptive_verify="on")),
    ]
    for mode, extra in modes:
        flags: dict[str, Any] = dict(model_path=str(target_dir), load_format="dummy", device=str(device),
                                     dtype=args.dtype, skip_tokenizer_init=True,
                                     max_total_tokens=max(args.batch_sizes) * (args.context + 1024),
                                     max_running_requests=max(args.batch_sizes), cuda_graph_bs=args.batch_sizes)
        if mode != "target_decode":
            flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                         speculative_simulate_accept_len=args.accept_len, **extra)
        engine = Engine(**flags)
        model = engine.runner.model
        routing = expert_routing(config)
        sparse = [m for m in model.modules() if isinstance(m, SparseMoe)]
        experts = [p for m in model.modules() if isinstance(m, StackedExperts) for p in m.parameters()]
        expert_ids = {id(p) for p in experts}
        dense_bytes = param_bytes(p for p in model.parameters() if id(p) not in expert_ids)
        dense_bytes -= param_bytes(model.model.embed_tokens.parameters())  # NOTE: only its rows are read
        element = experts[0].element_size()
        kv_per_token = 2 * config["num_hidden_layers"] * engine.runner.num_local_kv_heads * config["head_dim"] * element
        draft_bytes = 0 if mode == "target_decode" else (
            param_bytes(engine.worker.draft.parameters()) + model.lm_head.weight.numel() * element)
        for bs in args.batch_sizes:
            reqs = prefill(engine, bs, args.context, config["vocab_size"])
            engine.step()  # NOTE: warm-up (adaptive verify: its first choices)
            before = sum(len(r.output_ids) for r in reqs)
            ms = steady(device, args.repeat, engine.step)
            tokens_per_step = (sum(len(r.output_ids) for r in reqs) - before) / args.repeat
            verify_tokens = 1
            if mode != "target_decode":  # NOTE: the verify length in use at this batch size (adaptive: its choice)
                verify = engine.get_server_info()["internal_states"][0].get("verify_length") or {}
                verify_tokens = int(verify.get("in_use", {}).get(str(bs), {}).get("num_draft_tokens", args.block))
            touched_random = touched_experts(sparse[0].gate, routing, bs * verify_tokens, seed=bs)
            # NOTE: one layer's count per forward of the target in that step: a layer's share of the sum is its mean
            per_layer, counted_tokens = engine_touched_experts(engine, sparse, routing)
            touched = sum(per_layer) / len(per_layer)
            floor_bytes = (dense_bytes + draft_bytes + touched * expert_bytes(config, element) * len(sparse)
                           + bs * args.context * kv_per_token)
            row = {"mode": mode, "bs": bs, "step_ms": ms, "tokens_per_step": tokens_per_step,
                   "touched_experts_per_layer": touched, "touched_experts_random": touched_random,
                   "floor_ms": floor_bytes / bandwidth * 1e3, "verify_tokens": verify_tokens,
                   # NOTE: the tokens of the counted step (bs x verify_tokens unless that step explored another length)
                   "counted_tokens": counted_tokens, "context": args.context}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            for req in reqs:
                engine.scheduler.abort(req.rid)
            engine.scheduler.collect_finished()
        engine.shutdown()
        del engine, model, sparse, experts  # NOTE: every reference to the model, or the next engine will not fit
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def serving_command(target_dir: Path, draft_dir: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The serving_vs_engine.py command of `--parts serving`: its "tiny" shape with --model-dir / --draft-dir (these
    config.json files, dummy weights), the simulated accept length, 1 and 64 closed-loop clients, no Poisson run
    (NOTE: #51's table is the closed-loop levels; a Poisson run sends every prompt again, per client), one timed pass
    of each engine level (NOTE: #51 compares DFlash with target-only through the server; a second pass of the offline
    engine would cost a 30B level's time again), and the --serving-* workload."""
    return [sys.executable, "-m", "benchmarks.serving_vs_engine", "--shapes", "tiny", "--model-dir", str(target_dir),
            "--draft-dir", str(draft_dir), "--load-format", "dummy", "--accept-len", str(args.accept_len),
            "--concurrency", ",".join(map(str, SERVING_CONCURRENCY)), "--modes", ",".join(args.serving_modes),
            "--clients", ",".join(args.serving_clients), "--poisson-rate", "0",
            "--num-prompts", str(args.serving_prompts), "--max-rounds", str(args.serving_rounds),
            "--prompt-len", str(args.serving_prompt_len), "--max-new-tokens", str(args.serving_new_tokens),
            "--budget-s", str(args.serving_budget_s), "--engine-reads", "1", "--out", str(out), "--tag", "moe",
            "--no-plot"]


def serving_rows(target_dir: Path, draft_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Runs serving_command; what its result JSON holds when it ends: `serving` (its rows), `serving_errors` (a mode
    that failed, or that --serving-budget-s left unstarted), `serving_exit_status` (non-zero when a row failed: the
    others are kept), `serving_timed_out` and `serving_wall_s`. Past --serving-timeout-s it is stopped with SIGTERM
    (it stops its server and engine process and keeps the rows it saved), so this process can still write its JSON
    before the device call's own limit."""
    out = args.out / "moe_serving"
    out.mkdir(parents=True, exist_ok=True)
    started, wall_started = time.perf_counter(), time.time()
    proc = subprocess.Popen(serving_command(target_dir, draft_dir, out, args))
    timed_out = False
    try:
        status = proc.wait(timeout=args.serving_timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"!! serving part past --serving-timeout-s {args.serving_timeout_s:.0f}: stopping it", flush=True)
        proc.terminate()
        try:
            status = proc.wait(timeout=SERVING_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    # NOTE: the file this run wrote (a rerun of the commit on the same day rewrites the same name): by its time
    for path in sorted(out.glob("serving_vs_engine_*.json")):
        if path.stat().st_mtime >= wall_started - 1.0:
            data = json.loads(path.read_text())
            rows += data.get("rows", [])
            errors += data.get("errors", [])
    return {"serving": rows, "serving_errors": errors, "serving_exit_status": status, "serving_timed_out": timed_out,
            "serving_wall_s": time.perf_counter() - started}


def row_ratio(top: Optional[dict[str, Any]], bottom: Optional[dict[str, Any]], key: str) -> Optional[float]:
    """top[key] / bottom[key]; None where a row is missing or either value is missing or zero."""
    if top is None or bottom is None or not top.get(key) or not bottom.get(key):
        return None
    return float(top[key]) / float(bottom[key])


def serving_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """#51's serving table from the serving rows: per client and closed-loop concurrency, DFlash's and target-only's
    served tokens/s, dflash_over_target (and the offline engine's ratio beside it), DFlash's accept length as served
    and the failed requests of both rows. A ratio is None where either mode has no row (failed, cut or not run)."""
    by_key = {(row.get("client", "generate"), row["concurrency"], row["mode"]): row for row in rows}
    levels = sorted({(client, conc) for client, conc, _ in by_key if isinstance(conc, int)},
                    key=lambda level: (CLIENTS.index(level[0]) if level[0] in CLIENTS else len(CLIENTS), level[1]))
    summary: list[dict[str, Any]] = []
    for client, concurrency in levels:
        dflash, target = by_key.get((client, concurrency, "dflash")), by_key.get((client, concurrency, "target"))
        summary.append({
            "client": client, "concurrency": concurrency,
            "dflash_tok_s": None if dflash is None else dflash["server_tok_s"],
            "target_tok_s": None if target is None else target["server_tok_s"],
            "dflash_over_target": row_ratio(dflash, target, "server_tok_s"),
            "engine_dflash_over_target": row_ratio(dflash, target, "engine_tok_s"),
            "dflash_accept_length": None if dflash is None else dflash.get("server_accept_length"),
            "failed": sum(row.get("failed", 0) for row in (dflash, target) if row is not None),
        })
    return summary


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The flags; every --serving-* number left out takes its shape's SERVING_DEFAULTS value."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="30b-a3b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--block", type=int, default=16, help="verify block of the layer rows")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--accept-len", type=float, default=6.0)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layer-copies", type=int, default=8,
                        help="layers (own weights each) in the layer and tile parts' graph; their time is per layer")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--router-tokens", type=int, default=None,
                        help="the layer rows' fused router runs up to this many tokens (0: the router's GEMM and "
                             "fused_route at every batch, the path before the fused router); default: SparseMoe's")
    parser.add_argument("--parts", nargs="+", choices=("layer", "kernels", "router", "tiles", "step", "serving"),
                        default=["layer", "step"])
    parser.add_argument("--profile-replays", type=int, default=5,
                        help="kernels: graph replays profiled per row (each runs --layer-copies layers)")
    parser.add_argument("--top-kernels", type=int, default=12, help="kernels: the heaviest kernels kept per row")
    parser.add_argument("--tile-grid", choices=tuple(TILE_GRIDS), default="full",
                        help="the tile sets the `tiles` part times (full, the default: 64 sets and 64 direct ones; "
                             "small: 2 and 3; large: 72)")
    parser.add_argument("--serving-prompts", type=int, help="serving: prompts (serving_vs_engine's --num-prompts); "
                        "default per shape (SERVING_DEFAULTS), as every --serving-* number")
    parser.add_argument("--serving-rounds", type=int, help="serving: prompts per client of a closed-loop level "
                        "(--max-rounds; 0: all --serving-prompts at every level)")
    parser.add_argument("--serving-prompt-len", type=int, help="serving: prompt tokens, about (--prompt-len)")
    parser.add_argument("--serving-new-tokens", type=int, help="serving: new tokens a request (--max-new-tokens)")
    parser.add_argument("--serving-budget-s", type=float, help="serving: no new mode starts after this many seconds "
                        "(--budget-s; one left out is listed in serving_errors)")
    parser.add_argument("--serving-timeout-s", type=float, help="serving: the run is stopped after this many seconds "
                        "(SIGTERM: it keeps the rows it measured) and this JSON written")
    parser.add_argument("--serving-modes", nargs="+", choices=SERVING_MODES, default=list(SERVING_MODES),
                        help="serving: the modes, in order (a call that ran out of budget: --serving-modes target)")
    parser.add_argument("--serving-clients", nargs="+", choices=CLIENTS, default=["generate"],
                        help="serving: the clients (generate: closed-loop /generate; chat_stream: streaming chat)")
    parser.add_argument("--tag", default="", help="suffix of the result file name (two runs of one commit on one day "
                        "otherwise write the same file)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    workload = SERVING_DEFAULTS[args.shape]
    for flag, value in (("serving_prompts", workload.prompts), ("serving_rounds", workload.rounds),
                        ("serving_prompt_len", workload.prompt_len), ("serving_new_tokens", workload.new_tokens),
                        ("serving_budget_s", workload.budget_s), ("serving_timeout_s", workload.timeout_s)):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.shape == "tiny":
        args.block = min(args.block, TINY_DRAFT["block_size"])
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    config = SHAPES[args.shape][0]
    identity = run_identity()
    bandwidth = copy_bandwidth(device)
    report: dict[str, Any] = {**identity, "shape": args.shape, "config": config, "bandwidth_bytes_per_s": bandwidth,
                              "args": vars(args), "rows": [], "serving": [], "tile_sweep": []}
    path = result_path(args.out, "moe", identity["date"], identity["commit"], args.tag)
    # NOTE: the shapes' config.json files (dummy weights) live only as long as the run, not beside the results
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = write_configs(Path(tmp), args.shape)
        if "layer" in args.parts:
            report["rows"] += layer_rows(config, args, device, dtype, bandwidth)
            write_json(path, report)
        if "kernels" in args.parts:
            report["kernel_breakdown"] = kernel_rows(config, args, device, dtype)
            write_json(path, report)
        if "router" in args.parts:
            report["router_sweep"] = router_rows(config, args, device, dtype)
            write_json(path, report)
        if "tiles" in args.parts:
            report["tile_sweep"] = tile_rows(config, args, device, dtype, bandwidth)
            write_json(path, report)
        if "step" in args.parts:
            report["rows"] += step_rows(config, target_dir, draft_dir, args, device, bandwidth)
            write_json(path, report)
        if "serving" in args.parts:
            # NOTE: written before it starts too: a call cut off during it still brings back a JSON (exit status None)
            report.update(serving_errors=[], serving_exit_status=None, serving_timed_out=False, serving_summary=[])
            write_json(path, report)
            report.update(serving_rows(target_dir, draft_dir, args))
            report["serving_summary"] = serving_summary(report["serving"])
            for level in report["serving_summary"]:
                print(json.dumps(level), flush=True)
            write_json(path, report)
    print(f"wrote {path}; {plot_result(path)}")  # NOTE: each part above wrote it (--parts names at least one)
    # NOTE: a failed or stopped serving run is the call's failure too; its JSON holds what it measured
    return 1 if report.get("serving_exit_status") or report.get("serving_timed_out") else 0


if __name__ == "__main__":
    sys.exit(main())
