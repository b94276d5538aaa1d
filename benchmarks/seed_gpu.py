"""The seed's own command on a GPU: `blockspec serve` with exactly the flags blockspec promises (FlashInfer, piecewise
CUDA graphs enforced, DFlash with the shipped draft, page size 1, 64 running requests, CUDA graphs for every batch
size 1..64) on the demo pair with real weights, then 64 GSM8K chats from 64 concurrent clients; the same with
`--attention-backend triton`. A backend passes when the server starts, every answer comes back, the run's average
accept length is above 2.8, piecewise forwards ran and no kernel compiled after start-up.

Writes `seed_gpu_<date>_<commit>.json` (rows: backend, accept_length, piecewise_forwards,
kernel_compiles_after_startup, errors, plus accuracy and timings) and exits 1 when a row fails.
Usage (on the GPU machine): python3 -m benchmarks.seed_gpu --model-dir DIR [--backends flashinfer triton] --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.serving_server import ServerProcess, exit_on_sigterm, log_tail
from blockspec.evals.client import accept_length_between, compiles_between, forwards_between, get_server_info
from blockspec.bench.provenance import run_identity
from blockspec.evals.gsm8k import default_data_path, run_gsm8k
from blockspec.models.smollm2 import DEMO_DRAFT_DIR

MIN_ACCEPT_LENGTH = 2.8
SEED_BATCH_SIZES = [str(bs) for bs in range(1, 65)]


def seed_flags(model_dir: Path, backend: str) -> list[str]:
    """The seed's flags, word for word, with the attention backend under test."""
    return ["--model-path", str(model_dir), "--attention-backend", backend, "--enforce-piecewise-cuda-graph",
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(DEMO_DRAFT_DIR),
            "--page-size", "1", "--max-running-requests", "64", "--cuda-graph-bs", *SEED_BATCH_SIZES]


def run_backend(model_dir: Path, backend: str, ns: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": backend, "flags": " ".join(seed_flags(model_dir, backend)[2:])}
    log_path = ns.out / f"seed_gpu_{backend}_server.log"
    started = time.perf_counter()
    try:
        with ServerProcess(seed_flags(model_dir, backend), log_path, ns.startup_timeout) as server:
            row["startup_s"] = round(time.perf_counter() - started, 1)
            before = get_server_info(server.base_url)
            result = run_gsm8k(server.base_url, ns.data_path or default_data_path(), num_examples=ns.num_examples,
                               num_threads=ns.concurrency, max_tokens=ns.max_tokens, progress=False)
            after = get_server_info(server.base_url)
    except RuntimeError as exc:  # NOTE: the server did not start (the failure this benchmark exists to catch)
        row.update(started=False, error=str(exc), server_log_tail=log_tail(log_path), passed=False)
        return row
    forwards = forwards_between(before, after)["server_forward_counts"] or {}
    compiles = compiles_between(before, after)
    row.update(
        started=True,
        accept_length=accept_length_between(before, after),
        piecewise_forwards=forwards.get("piecewise"),
        forward_counts=forwards,
        kernel_compiles_after_startup=compiles["kernel_compiles"],
        kernel_compiles_by_kernel=compiles["kernel_compiles_by_kernel"],
        errors=result.num_errors,
        answers=result.num_examples - result.num_errors,
        accuracy=round(result.score, 4),
        latency_s=round(result.latency_s, 2),
        output_tokens_per_s=round(result.output_throughput, 1),
    )
    row["passed"] = (
        row["errors"] == 0 and row["answers"] == ns.num_examples
        and (row["accept_length"] or 0.0) > MIN_ACCEPT_LENGTH
        and (row["piecewise_forwards"] or 0) > 0 and row["kernel_compiles_after_startup"] == 0
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="the demo target (blockspec.smollm2 makes it)")
    parser.add_argument("--backends", nargs="+", default=["flashinfer", "triton"], choices=["flashinfer", "triton"])
    parser.add_argument("--num-examples", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--data-path", type=Path, help="GSM8K test.jsonl (default: the split shipped in the package)")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ns = parser.parse_args()
    exit_on_sigterm()
    ns.out.mkdir(parents=True, exist_ok=True)
    identity = run_identity()
    rows = [run_backend(ns.model_dir, backend, ns) for backend in ns.backends]
    report = {**identity, "benchmark": "seed_gpu", "min_accept_length": MIN_ACCEPT_LENGTH,
              "num_examples": ns.num_examples, "concurrency": ns.concurrency, "rows": rows}
    path = ns.out / f"seed_gpu_{identity['date']}_{identity['commit']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        keys = ("backend", "passed", "accept_length", "piecewise_forwards", "kernel_compiles_after_startup", "errors",
                "accuracy", "error")
        print(json.dumps({key: row.get(key) for key in keys}))
    print(f"wrote {path}")
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
