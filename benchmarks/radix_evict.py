"""The radix cache's eviction under a full KV pool, without a model: a tree of `--cached` finished sequences, then
steps that each evict a decode step's worth of pages (`--rows` pages) and cache one more finished sequence, as a
full batch does once the pool is full. Prints and writes microseconds per step (run it on two commits for an A/B).

    python -m benchmarks.radix_evict --out /tmp/radix.json [--cached 2000 --rows 256 --length 300]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Optional

from blockspec.bench.provenance import run_identity
from blockspec.kv.radix_tree import RadixTree


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cached", type=int, nargs="+", default=[250, 1000, 4000], help="sequences in the tree")
    parser.add_argument("--rows", type=int, default=256, help="pages evicted a step (page size 1)")
    parser.add_argument("--length", type=int, default=300, help="tokens of a cached sequence")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    rows = []
    for cached in args.cached:
        tree, page = RadixTree(page_size=1), 0

        def add_sequence() -> None:
            nonlocal page
            tokens = [rng.randrange(1000) for _ in range(args.length)]
            tree.insert(tokens, list(range(page, page + args.length)))
            page += args.length

        for _ in range(cached):
            add_sequence()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            tree.evict(args.rows)
            add_sequence()
            times.append(time.perf_counter() - started)
        row = {"cached_sequences": cached, "us_per_step_median": 1e6 * statistics.median(times),
               "us_per_step_mean": 1e6 * statistics.fmean(times)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {**run_identity(), "settings": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1))
    from benchmarks.plots import plot_radix_evict  # NOTE: here: matplotlib only where a plot is drawn

    print(f"wrote {args.out} and {plot_radix_evict(report, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
