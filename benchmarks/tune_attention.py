"""Sweeps the Triton paged-attention launch shape (rows/keys per program, warps, stages, split-K) on 8B shapes.

For decode, verify, draft and extend batches (bf16, 32 query / 8 KV heads, head dim 128) every configuration is
timed as 20 launches inside one CUDA graph (launch gaps as in the engine's graphs) and checked against the
default configuration's output. Prints, per case, the default's time and the best few; writes JSON to --out."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from blockspec.attention.triton_backend import (
    DEFAULT_ATTENTION_KERNELS, AttentionKernels, KernelTiles, TritonAttentionBackend, TritonAttentionMeta,
)
from blockspec.batch import ForwardBatch, ForwardMode, build_batch
from blockspec.kv.pool import KVPool
from device_timing import graphed_us, read_bandwidth, save_report

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CASES = [  # name, mode, batch size, cached context, new tokens per request
    ("decode bs1 ctx4096", ForwardMode.DECODE, 1, 4096, 1),
    ("decode bs64 ctx4096", ForwardMode.DECODE, 64, 4096, 1),
    ("decode bs64 ctx512", ForwardMode.DECODE, 64, 512, 1),
    ("decode bs16 ctx512", ForwardMode.DECODE, 16, 512, 1),
    ("verify bs1 ctx512", ForwardMode.VERIFY, 1, 512, 10),
    ("verify bs1 ctx4096", ForwardMode.VERIFY, 1, 4096, 10),
    ("verify bs32 ctx512", ForwardMode.VERIFY, 32, 512, 10),
    ("verify bs32 ctx4096", ForwardMode.VERIFY, 32, 4096, 10),
    ("verify bs16 ctx512", ForwardMode.VERIFY, 16, 512, 10),
    ("verify bs64 ctx512", ForwardMode.VERIFY, 64, 512, 10),
    ("verify bs64 ctx4096", ForwardMode.VERIFY, 64, 4096, 10),
    ("draft bs1 ctx512", ForwardMode.DRAFT, 1, 512, 10),
    ("draft bs32 ctx512", ForwardMode.DRAFT, 32, 512, 10),
    ("draft bs32 ctx4096", ForwardMode.DRAFT, 32, 4096, 10),
    ("draft bs64 ctx4096", ForwardMode.DRAFT, 64, 4096, 10),
    ("extend bs1 x256", ForwardMode.EXTEND, 1, 0, 256),
    ("extend bs8 x256", ForwardMode.EXTEND, 8, 0, 256),
    ("extend bs1 x2048", ForwardMode.EXTEND, 1, 0, 2048),
    # NOTE: after a prefix-cache hit (issue 20's (b): 32 questions of ≈ 24 tokens behind a cached 4k system prompt)
    ("extend bs32 x24 ctx4096", ForwardMode.EXTEND, 32, 4096, 24),
    ("extend bs16 x48 ctx4096", ForwardMode.EXTEND, 16, 4096, 48),
]


def make_batch(mode: ForwardMode, bs: int, context: int, new: int) -> tuple[ForwardBatch, KVPool, torch.Tensor]:
    total = context + new
    pool = KVPool(bs * total + 1, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    table = (torch.arange(bs * total, device="cuda") + 1).view(bs, total)
    ids = [[1] * new for _ in range(bs)]
    batch = build_batch(mode, ids, [context] * bs, list(range(bs)), table, [0])
    q = torch.randn(bs * new, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return batch, pool, q


def graph_us(backend: TritonAttentionBackend, q: torch.Tensor, batch: ForwardBatch, launches: int = 20) -> float:
    k = v = q[:, :KV_HEADS]
    return graphed_us(lambda: backend.forward(q, k, v, 0, batch, kv_stored=True), launches)


def load_candidate(path: Path) -> AttentionKernels:
    """The two kernels defined in `path`, for TritonAttentionBackend(kernels=...) (an A/B of a kernel change within
    one run). A candidate without the PDL constexpr launches plainly: run with BLOCKSPEC_PDL=0 to compare like with
    like."""
    spec = importlib.util.spec_from_file_location("candidate_attention_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return AttentionKernels(attention=module.paged_attention_kernel, merge=module.merge_splits_kernel)


def sweep(
    name: str, mode: ForwardMode, bs: int, context: int, new: int, quick: bool, bandwidth: float, wide: bool = False,
    default_only: bool = False, candidate: Optional[AttentionKernels] = None,
    sweep_candidate: bool = False,
) -> dict[str, Any]:
    batch, pool, q = make_batch(mode, bs, context, new)
    swept = candidate if sweep_candidate and candidate is not None else DEFAULT_ATTENTION_KERNELS
    backend = TritonAttentionBackend(pool, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, kernels=swept)
    default: TritonAttentionMeta = backend.plan(batch)
    batch.attn_meta = default
    reference = backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 0, batch, kv_stored=True).float()
    candidate_result: dict[str, Any] = {}
    if candidate is not None:  # same run, same batch, the engine's launch policy: candidate kernels vs current
        contender = TritonAttentionBackend(pool, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, kernels=candidate)
        got = contender.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 0, batch, kv_stored=True).float()
        error = ((got - reference).norm() / reference.norm()).item()
        candidate_result = {"us": graph_us(contender, q, batch), "error": error}
    rows = new * HEADS // KV_HEADS
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)]
    splits = [1] if mode is ForwardMode.EXTEND and context == 0 else [1, 2, 4, 8, 16]
    results = [{"config": "default", "tiles": vars(default.tiles), "splits": default.num_splits,
                "us": graph_us(backend, q, batch)}]

    def run(tiles: KernelTiles, split: int) -> None:
        batch.attn_meta = replace(default, tiles=tiles, num_splits=split)
        try:
            got = backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 0, batch, kv_stored=True).float()
            error = ((got - reference).norm() / reference.norm()).item()
            us = graph_us(backend, q, batch) if error < 1e-2 else float("inf")
        except Exception as exc:  # NOTE: e.g. out of shared memory for a large tile: skip that configuration
            us, error = float("inf"), repr(exc)[:80]
        results.append({"tiles": vars(tiles), "splits": split, "us": us, "error": error})

    if wide and not default_only:  # every tile x (warps, stages) at the split counts that matter at this size
        wide_splits = [1, 2] if bs >= 16 else [4, 8, 16]
        for block_m, block_n, (warps, stages), split, edges_only in itertools.product(
            (16, 64), (32, 64, 128), ((4, 2), (4, 3), (8, 2), (8, 3)), wide_splits, (False, True)
        ):
            run(KernelTiles(block_m, block_n, warps, stages, edges_only), split)
    elif not default_only:
        for block_m, block_n, split in itertools.product(block_ms, (32, 64, 128), splits):
            run(KernelTiles(block_m, block_n, 4, 2), split)
    best = min(results, key=lambda r: r["us"])
    if not quick and not wide and not default_only:
        for warps, stages in itertools.product((2, 4, 8), (1, 2, 3, 4)):
            tiles = KernelTiles(best["tiles"]["block_m"], best["tiles"]["block_n"], warps, stages)
            run(tiles, best["splits"])
    ranked = sorted(results, key=lambda r: r["us"])
    floor_us = bs * (context + new) * 2 * KV_HEADS * HEAD_DIM * 2 / bandwidth * 1e6  # K and V read once
    print(f"== {name}: default {results[0]['us']:.1f} us {results[0]['tiles']} splits {results[0]['splits']}"
          f" (KV read floor {floor_us:.1f} us)")
    if candidate_result:
        print(f"   candidate kernels: {candidate_result['us']:.1f} us (relative error {candidate_result['error']:.1e})")
    for r in ranked[:4]:
        print(f"   {r['us']:7.1f} us  {r['tiles']} splits {r['splits']}")
    return {"case": name, "default": results[0], "ranked": ranked[:12], "kv_floor_us": floor_us,
            "candidate": candidate_result or None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="*", help="substrings of case names to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="skip the warps x stages sweep")
    parser.add_argument("--candidate", type=Path, help="a .py file defining paged_attention_kernel and "
                        "merge_splits_kernel with the current signatures: timed against the current kernels")
    parser.add_argument("--sweep-candidate", action="store_true",
                        help="sweep launch shapes over the --candidate kernels instead of the current ones")
    parser.add_argument("--default-only", action="store_true", help="time only the engine's own launch policy")
    parser.add_argument("--wide", action="store_true",
                        help="rows 16/64 x keys 32/64/128 x (warps, stages) x splits x edge-only masks or not")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("BLOCKSPEC_COMMIT", "unknown"), "cases": []}
    candidate = load_candidate(args.candidate) if args.candidate else None
    bandwidth = read_bandwidth()
    report["bandwidth_bytes_per_s"] = bandwidth
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for case in CASES:
        if args.cases and not any(s in case[0] for s in args.cases):
            continue
        report["cases"].append(sweep(*case, quick=args.quick, bandwidth=bandwidth, wide=args.wide,
                                     default_only=args.default_only, candidate=candidate,
                                     sweep_candidate=args.sweep_candidate))
    save_report(args.out, "tune_attention", report)


if __name__ == "__main__":
    main()
