"""Where a benchmark's result goes and how it is written: the results directory, the `--out`/`--commit` flags every
result-writing benchmark takes, the JSON document, and its plot where matplotlib is installed (the device may lack
it: the JSON is the result, the plot can be drawn later with `python -m benchmarks.plots RESULT.json`).

What a result names about its run (commit, GPU, date) comes from blockspec.bench.provenance."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from blockspec.bench.provenance import commit_id, gpu_name, today

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_out_argument(parser: argparse.ArgumentParser,
                     what: str = "directory of the result JSON (and its plot)") -> None:
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"{what} (default: benchmarks/results)")


def add_commit_argument(parser: argparse.ArgumentParser) -> None:
    """--commit: the commit a result names (the device's tree has no git); `resolved_commit` reads it."""
    parser.add_argument("--commit", default=None, help="commit id for the file name and JSON "
                                                       "(default: $BLOCKSPEC_COMMIT, else git)")


def interpreter_or_cuda(parser: argparse.ArgumentParser, smoke: bool) -> None:
    """Where a Triton benchmark runs: with --smoke, on the CPU under Triton's interpreter (set here, before a kernel's
    module is imported: Triton decides when it decorates); without it on CUDA, or the parser's error."""
    import os

    import torch

    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        parser.error(f"{parser.prog} needs CUDA (or --smoke)")


def resolved_commit(args: argparse.Namespace) -> str:
    return str(args.commit) if args.commit else commit_id()


def result_path(out: Path, kind: str, date: str, commit: str, tag: str = "") -> Path:
    """`<out>/<kind>_<date>_<commit>[_<tag>].json`: a tag keeps a second run of one commit on one day apart."""
    return out / f"{kind}_{date}_{commit}{'_' + tag if tag else ''}.json"


def write_json(path: Path, report: dict[str, Any]) -> Path:
    """Writes the result document (indented; values JSON cannot hold as their str); rewritten after every row by the
    benchmarks that save as they go, so a run cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return path


def plot_result(path: Path) -> str:
    """Draws the result's plot beside it (benchmarks/plots.py, by the file's kind); what happened, as a line."""
    try:
        from benchmarks.plots import plot_file
    except ImportError as error:
        return f"no plot ({error}); later: python -m benchmarks.plots {path}"
    return f"plot {plot_file(path)}"


def write_rows(kind: str, args: argparse.Namespace,
               measure: Callable[[argparse.Namespace, Path, dict[str, Any]], Any]) -> int:
    """`<kind>_<date>_<commit>[_<tag>].json` under --out (the tag: `args.tag`, where the benchmark takes one): {commit,
    gpu, date, rows}; `measure(args, path, result)` fills result["rows"] (writing the file as it goes, if it likes),
    then the file is written and plotted. Exit status 0."""
    commit = resolved_commit(args)
    out = result_path(args.out, kind, today(), commit, getattr(args, "tag", ""))
    result: dict[str, Any] = {"commit": commit, "gpu": gpu_name(), "date": today(), "rows": []}
    measure(args, out, result)
    print(f"wrote {write_json(out, result)}; {plot_result(out)}", flush=True)
    return 0
