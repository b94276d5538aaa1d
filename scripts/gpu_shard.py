"""The test files of one shard of the GPU suite (`scripts/device.sh gpu-test K/N`), one per line.

The suite (every test marked `gpu` or `cuda`) outlasts one device call, so a lease runs it in N calls. Shards split
by file (a module's fixtures are built once), balanced by test count: files in descending count go to the shard with
the fewest tests so far (ties: the lower shard). Every selected file lands in exactly one shard, and the split depends
only on the tree, so the N calls together run the whole suite."""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys

SUITE_MARKS = "gpu or cuda"


def suite_counts(tests_dir: str = "tests") -> dict[str, int]:
    """{test file: number of its tests the suite selects}, from pytest's own collection (errors are fatal)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", SUITE_MARKS,
         tests_dir],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"collecting the GPU suite failed:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    counts: collections.Counter[str] = collections.Counter()
    for line in done.stdout.splitlines():
        if "::" in line:
            counts[line.split("::", 1)[0]] += 1
    return dict(counts)


def shards(counts: dict[str, int], n: int) -> list[list[str]]:
    """The files of each of `n` shards (each list sorted)."""
    groups: list[list[str]] = [[] for _ in range(n)]
    loads = [0] * n
    for path in sorted(counts, key=lambda p: (-counts[p], p)):
        lightest = min(range(n), key=lambda i: (loads[i], i))
        groups[lightest].append(path)
        loads[lightest] += counts[path]
    return [sorted(group) for group in groups]


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" → (K, N) with 1 ≤ K ≤ N."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shard is K/N, e.g. 1/2; got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"a shard K/N needs 1 <= K <= N; got {text!r}")
    return k, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shard", type=parse_shard, help="K/N: the K-th of N shards")
    parser.add_argument("--tests-dir", default="tests")
    args = parser.parse_args()
    k, n = args.shard
    print("\n".join(shards(suite_counts(args.tests_dir), n)[k - 1]))


if __name__ == "__main__":
    main()
