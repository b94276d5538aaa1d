"""The Triton attention of a verify block, as a served CUDA graph runs it, at each launch variant: the chain's causal
block of --chain-tokens (the draft's block) and a DDTree tree's [root, B nodes] under a random draft tree's ancestor
mask (--budgets), over a cached context of each --contexts length, at each split-K count (--splits) and tile set
(--tiles). A graph fixes its split count for the longest context it serves (the max_seq hint), while a server's
contexts are mostly far shorter: this finds the variant a verify block wants over the contexts it meets (#52: a B = 32
tree's attention and merge were the largest part of what it adds to the chain's cycle at batch 1).

Each variant runs --layers attention calls (its attention kernel and, with more than one split, its merge; PDL on as
in a model's graph) captured in one CUDA graph, replayed --repeat times back to back: µs per layer. Writes
verify_attention_<date>_<commit>.json (+ .png) into --out with

  settings  {shape, heads, kv_heads, head_dim, layers, repeat, max_seq_hint}
  rows      {block: chain | tree, query_tokens, budget (0: the chain), bs, context, splits, tiles
            ("block_m,block_n,warps,stages"), mask_edges_only, us_per_layer, served, max_diff_vs_served}: served
            marks the variant the engine launches for that block (launch_policy and choose_splits at max_seq_hint);
            max_diff_vs_served, the largest difference of its output from the served variant's (every variant
            computes the same attention: only the rounding of the split merge may differ)

--smoke runs tiny shapes on the CPU (the kernels under Triton's interpreter, no graphs: timings mean nothing)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.device_timing import replay_ms
from benchmarks.results import add_commit_argument, add_out_argument, interpreter_or_cuda, write_rows

if TYPE_CHECKING:
    from blockspec.attention.triton_backend import KernelTiles, TritonAttentionBackend
    from blockspec.batch import ForwardBatch
    from blockspec.kv.pool import KVPool

# NOTE: the blockspec modules that hold Triton kernels are imported where used: --smoke must set TRITON_INTERPRET
# before Triton sees a kernel's decoration

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # NOTE: query heads, KV heads, head dim
DRAFT_DEPTHS = 15  # NOTE: a block of 16: the tree's depths


@dataclasses.dataclass(frozen=True)
class VerifyCase:
    """One verify batch over random cached K/V: the batch (its tree mask and depth positions for a tree), the pool
    its backend reads, and the new rows' q, k, v."""

    batch: ForwardBatch
    pool: KVPool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def verify_case(shape: tuple[int, int, int], bs: int, context: int, query_tokens: int, tree: bool,
                device: torch.device, dtype: torch.dtype) -> VerifyCase:
    """`bs` requests, each `context` cached tokens then `query_tokens` new rows (a tree's: query_tokens = B + 1)."""
    from blockspec.batch import ForwardMode, build_batch
    from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
    from blockspec.kv.pool import KVPool
    from blockspec.request import Req, SamplingParams
    from blockspec.speculative.tree_build import build_tree

    heads, kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(bs * 7919 + context + query_tokens)
    total = context + query_tokens
    allocator = PageAllocator(bs * total + 2, 1)
    table = ReqToTokenTable(bs + 1, total + 1, device)
    rows = []
    for _ in range(bs):
        req = Req([1] * total, SamplingParams())
        req.pool_row = table.acquire()
        allocator.grow(req, total, table)
        rows.append(req.pool_row)
    pool = KVPool(allocator.num_pages, 1, kv_heads, head_dim, dtype, device)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=generator).to(dtype))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=generator).to(dtype))
    batch = build_batch(ForwardMode.VERIFY, [[1] * query_tokens for _ in range(bs)], [context] * bs, rows,
                        table.table, [0])
    if tree:
        logits = torch.randn(bs, DRAFT_DEPTHS, 256, generator=generator).to(device)
        drafted = build_tree(logits.log_softmax(-1), query_tokens - 1)
        positions = (torch.full((bs, 1), context, device=device) + drafted.depths).reshape(-1)
        batch = dataclasses.replace(batch, positions=positions, tree_mask=drafted.ancestors)
    tokens = bs * query_tokens
    q, k, v = (torch.randn(tokens, n, head_dim, generator=generator).to(device=device, dtype=dtype)
               for n in (heads, kv_heads, kv_heads))
    return VerifyCase(batch, pool, q, k, v)


def tiles_spec(spec: str) -> str:
    """An argparse type: "block_m,block_n,warps,stages[,edges]" (edges: mask only the key blocks that need it)."""
    parts = spec.split(",")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "edges") or not all(
            p.isdigit() for p in parts[:4]):
        raise argparse.ArgumentTypeError(f"tiles are block_m,block_n,warps,stages[,edges], got {spec!r}")
    return spec


def parse_tiles(spec: str) -> KernelTiles:
    """A tiles_spec → KernelTiles."""
    from blockspec.attention.triton_backend import KernelTiles

    parts = spec.split(",")
    block_m, block_n, warps, stages = (int(p) for p in parts[:4])
    return KernelTiles(block_m, block_n, warps, stages, mask_edges_only=len(parts) == 5)


def tiles_name(tiles: KernelTiles) -> str:
    return f"{tiles.block_m},{tiles.block_n},{tiles.num_warps},{tiles.num_stages}"


def served_variant(backend: TritonAttentionBackend, case: VerifyCase, max_seq_hint: int) -> tuple[int, KernelTiles]:
    """The split count and tiles the engine launches for this block in a graph of hint `max_seq_hint`: the backend's
    own plan of the batch."""
    meta = backend.plan(dataclasses.replace(case.batch, max_seq_len_hint=max_seq_hint))
    return meta.num_splits, meta.tiles


def time_variant(backend: TritonAttentionBackend, case: VerifyCase, splits: int, tiles: KernelTiles, layers: int,
                 repeat: int) -> tuple[float, torch.Tensor]:
    """µs per layer of `layers` attention calls of this variant in one graph (eagerly on the CPU), and its output."""
    from blockspec.attention.triton_backend import TritonAttentionMeta, query_layout

    q_starts, q_lens, max_q = query_layout(case.batch)
    batch = dataclasses.replace(case.batch, attn_meta=TritonAttentionMeta(q_starts, q_lens, max_q, splits, tiles))
    outputs = [torch.empty(case.q.shape[0], backend.num_heads, backend.head_dim, dtype=case.q.dtype,
                           device=case.q.device) for _ in range(layers)]
    # NOTE: the new rows' K/V stored once, as a model's fused RoPE + store does before its attention
    case.pool.store(0, batch.out_cache_loc, case.k, case.v)

    def run() -> None:
        for out in outputs:
            backend.forward(case.q, case.k, case.v, 0, batch, kv_stored=True, out=out)

    return replay_ms(run, case.q.device, repeat) * 1e3 / layers, outputs[0]


def measure(args: argparse.Namespace, out: Path, result: dict[str, Any]) -> None:
    from blockspec.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = SHAPES[args.shape]
    heads, kv_heads, head_dim = shape
    result["settings"] = dict(shape=args.shape, heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=args.layers,
                              repeat=args.repeat, max_seq_hint=args.max_seq_hint)
    blocks = [("chain", args.chain_tokens, 0)] + [("tree", budget + 1, budget) for budget in args.budgets]
    for bs in args.batch_sizes:
        for block, query_tokens, budget in blocks:
            for context in args.contexts:
                case = verify_case(shape, bs, context, query_tokens, block == "tree", device, dtype)
                backend = TritonAttentionBackend(case.pool, head_dim ** -0.5, heads, kv_heads, head_dim,
                                                 max_splits=max(args.splits))
                served = served_variant(backend, case, args.max_seq_hint)
                variants = [(splits, parse_tiles(tiles)) for tiles in args.tiles for splits in args.splits]
                variants = [served] + [variant for variant in variants if variant != served]
                reference = None
                for splits, tiles in variants:
                    us, output = time_variant(backend, case, splits, tiles, args.layers, args.repeat)
                    reference = output.float() if reference is None else reference
                    row = dict(block=block, query_tokens=query_tokens, budget=budget, bs=bs, context=context,
                               splits=splits, tiles=tiles_name(tiles), mask_edges_only=tiles.mask_edges_only,
                               us_per_layer=us, served=(splits, tiles) == served,
                               max_diff_vs_served=float((output.float() - reference).abs().max()))
                    result["rows"].append(row)
                    print(f"{block:5s} q {query_tokens:3d} bs {bs:3d} ctx {context:6d} splits {splits:3d} "
                          f"tiles {row['tiles']:>12s}{' edges' if tiles.mask_edges_only else '      '} "
                          f"{row['us_per_layer']:8.2f} us{'  served' if row['served'] else ''}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--chain-tokens", type=int, default=16, help="the chain's verify block (the draft's block)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64], help="tree budgets B (B + 1 rows)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--tiles", type=tiles_spec, nargs="+", default=["64,32,4,2", "64,64,4,3,edges", "128,32,8,2"],
                        help="block_m,block_n,warps,stages[,edges] each")
    parser.add_argument("--max-seq-hint", type=int, default=8192, help="the graph's max_seq hint (served variant)")
    parser.add_argument("--layers", type=int, default=30, help="attention calls per graph (the target's layers)")
    parser.add_argument("--repeat", type=int, default=50, help="graph replays timed per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    add_out_argument(parser)
    add_commit_argument(parser)
    args = parser.parse_args(argv)
    interpreter_or_cuda(parser, args.smoke)
    if args.smoke:
        args.contexts, args.budgets, args.chain_tokens, args.layers, args.repeat = [40], [6], 4, 2, 1
        args.splits, args.tiles = [1, 2], ["16,16,4,1"]
    return write_rows("verify_attention", args, measure)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
