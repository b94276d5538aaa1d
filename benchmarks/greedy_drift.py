"""Greedy drift of bf16 DFlash against target-only decoding, measured against rounding (issue 22, part 2).

For N GSM8K test questions (the demo's prompt format and chat template) and the demo pair (SmolLM2-135M-Instruct
+ the embedded DFlash draft), generates greedy with the offline Engine four ways: DFlash and target-only, each at
bs 1 (one prompt per generate call) and at bs B (one call of B rows: the prompts repeated to B, the first copy of
each compared). Pairs: dflash_bs1 vs target_bs1, dflash_bsB vs target_bsB, and the baseline target_bs1 vs
target_bsB (target-only against itself: pure rounding). At each pair's first divergent output token the target's
logits are recomputed in fp32 (HF transformers, the same weights upcast, TF32 off) on the common prefix, and the
top-1 − top-2 margin there is recorded: a divergence at a margin no larger than the baseline's largest is rounding;
a larger one is a defect to find. --baseline-batch-sizes S... adds target-only runs with the prompts S at a time; the
baseline is every pair of target-only runs, so it spans more batch shapes (`baseline_max_margin` is the largest);
--deterministic runs every engine with --enable-deterministic-inference, where DFlash should equal target-only.

    python -m benchmarks.greedy_drift                      # H200: bf16, 16 prompts, 256 tokens, bs 64
    python -m benchmarks.greedy_drift --device cpu --dtype float32 --prompts 2 --max-new-tokens 8 --batch-size 4

Writes benchmarks/results/greedy_drift_<date>_<commit>.json (rows: pair, prompt, first_divergence, fp32_margin;
summary per pair: max_margin, share_identical; baseline_pairs, baseline_max_margin, deterministic; gpu, date,
commit) and the histogram PNG beside it.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import time
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import torch

from benchmarks.results import add_out_argument, plot_result, result_path, write_json
from blockspec.bench.provenance import commit_id

Outputs = list[list[int]]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="GSM8K test questions (the first N)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="rows of the batched call (prompts repeated)")
    add_out_argument(parser)
    parser.add_argument("--tag", default="", help="suffix of the result file name, e.g. the attention backend")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch, triton or flashinfer")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the engines (float32 for a CPU smoke test)")
    parser.add_argument("--data-path", type=Path, default=None, help="GSM8K test.jsonl (default: the shared copy)")
    parser.add_argument("--model-path", type=Path, default=None, help="HF target dir (default: converted SmolLM2)")
    parser.add_argument("--draft-path", type=Path, default=None, help="DFlash draft (default: the embedded one)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root of the converted SmolLM2")
    parser.add_argument("--cpu-threads", type=int, default=2)
    parser.add_argument("--baseline-batch-sizes", type=int, nargs="*", default=[], help="more target-only runs at "
                        "these batch sizes (the prompts in groups of that many); every pair of target-only runs is "
                        "the rounding baseline")
    parser.add_argument("--deterministic", action="store_true", help="every engine with "
                        "--enable-deterministic-inference (then DFlash should equal target-only everywhere)")
    args = parser.parse_args(argv)
    if min(args.prompts, args.max_new_tokens, args.batch_size, args.cpu_threads, *args.baseline_batch_sizes) < 1:
        parser.error("--prompts, --max-new-tokens, --batch-size, --cpu-threads and --baseline-batch-sizes must be "
                     "positive")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_questions(data_path: Optional[Path], count: int) -> list[str]:
    from blockspec.evals.gsm8k import default_data_path, load_lines

    path = data_path if data_path is not None else default_data_path()
    in_tree = Path(__file__).resolve().parents[1] / "shared/data/gsm8k/test.jsonl"  # a device copy of the tree
    if data_path is None and not path.is_file() and in_tree.is_file():
        path = in_tree
    if not path.is_file():
        raise SystemExit(f"error: GSM8K test split not found at {path}; pass --data-path")
    lines = load_lines(path)
    if len(lines) < count:
        raise SystemExit(f"error: {path} has {len(lines)} questions, fewer than --prompts {count}")
    return [line["question"] for line in lines[:count]]


def engine_kwargs(args: argparse.Namespace, device: torch.device, rows: int) -> dict[str, Any]:
    # NOTE: the demo's GSM8K test prompts are <= 241 tokens; 1024 per row leaves room for them and a verify block.
    # The batched run re-sends the bs-1 prompts: without the radix cache each batch computes its own prefill.
    return {
        "model_path": str(args.model_path), "device": str(device), "dtype": args.dtype,
        "attention_backend": args.attention_backend, "max_running_requests": args.batch_size,
        "max_total_tokens": max(4096, rows * (1024 + args.max_new_tokens)), "disable_radix_cache": True,
        "enable_deterministic_inference": args.deterministic,
    }


def grouped(engine: Any, prompts: list[list[int]], size: int, params: dict[str, Any]) -> Outputs:
    """Each prompt's output when the prompts run `size` at a time (the last group filled up with repeats)."""
    outputs: Outputs = []
    for start in range(0, len(prompts), size):
        group = prompts[start:start + size]
        rows = group + [group[i % len(group)] for i in range(size - len(group))]
        results = cast(list[dict[str, Any]], engine.generate(input_ids=rows, sampling_params=params))
        outputs += [list(out["output_ids"]) for out in results[: len(group)]]
    return outputs


def run_mode(
    args: argparse.Namespace, device: torch.device, questions: list[str], draft: Optional[Path],
    extra: Optional[dict[str, Outputs]] = None,
) -> tuple[list[list[int]], Outputs, Outputs, str]:
    """(prompts, bs-1 outputs, bs-B outputs of the first copy of each prompt, attention backend) of one engine;
    with `extra`, also target_bsS outputs per --baseline-batch-sizes S into it."""
    from blockspec import Engine
    from blockspec.models.smollm2 import build_messages

    rows = max(args.batch_size, len(questions))
    kwargs = engine_kwargs(args, device, rows)
    if draft is not None:
        kwargs.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
    engine = Engine(**kwargs)
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    try:
        prompts = [engine.chat_input_ids(build_messages(q)) for q in questions]
        start = time.perf_counter()
        single = [list(cast(list[dict[str, Any]],
                            engine.generate(input_ids=[p], sampling_params=params))[0]["output_ids"])
                  for p in prompts]
        middle = time.perf_counter()
        repeated = [prompts[i % len(prompts)] for i in range(rows)]
        batched = cast(list[dict[str, Any]], engine.generate(input_ids=repeated, sampling_params=params))
        backend = str(engine.runner.attention_backend)
        for size in (args.baseline_batch_sizes if extra is not None else []):
            extra[f"target_bs{size}"] = grouped(engine, prompts, size, params)
        print(f"{'dflash' if draft else 'target'}: bs 1 {middle - start:.1f} s, bs {rows} "
              f"{time.perf_counter() - middle:.1f} s, attention {backend}", flush=True)
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return prompts, single, [list(out["output_ids"]) for out in batched[: len(prompts)]], backend


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first output token that differs (or where one output ended), None if identical."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


class Fp32Margins:
    """fp32 top-1 − top-2 logit margin of the next token after a token sequence, on the HF model (memoised)."""

    def __init__(self, model_path: Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        # NOTE: TF32 would round the fp32 reference to 10 mantissa bits; the margins must be true fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(device).eval()
        self.cache: dict[tuple[int, ...], float] = {}

    @torch.inference_mode()
    def __call__(self, ids: list[int]) -> float:
        key = tuple(ids)
        if key not in self.cache:
            logits = self.model(torch.tensor([ids], device=self.device), logits_to_keep=1).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            self.cache[key] = float(top[0] - top[1])
        return self.cache[key]


def compare(
    runs: dict[str, Outputs], pairs: list[tuple[str, str]], prompts: list[list[int]], margins: Fp32Margins
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for left, right in pairs:
        for index, (a, b) in enumerate(zip(runs[left], runs[right])):
            at = first_divergence(a, b)
            margin = None if at is None else margins(prompts[index] + a[:at])
            rows.append({"pair": f"{left} vs {right}", "prompt": index, "first_divergence": at, "fp32_margin": margin})
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    summary: dict[str, dict[str, Optional[float]]] = {}
    for pair in dict.fromkeys(r["pair"] for r in rows):
        sel = [r for r in rows if r["pair"] == pair]
        found = [r["fp32_margin"] for r in sel if r["fp32_margin"] is not None]
        summary[pair] = {"max_margin": max(found) if found else None,
                         "share_identical": sum(r["first_divergence"] is None for r in sel) / len(sel)}
    return summary


def verdict(rows: list[dict[str, Any]], limit: Optional[float], baselines: list[str]) -> list[str]:
    """Lines naming each DFlash divergence at a margin above the baselines' largest (a defect, not rounding)."""
    lines = []
    for r in rows:
        if r["pair"] not in baselines and r["fp32_margin"] is not None and (limit is None or r["fp32_margin"] > limit):
            bound = "none (no baseline divergence)" if limit is None else f"{limit:.4f}"
            lines.append(f"  {r['pair']} prompt {r['prompt']}: token {r['first_divergence']}, "
                         f"fp32 margin {r['fp32_margin']:.4f} > baseline max {bound}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    from blockspec.models.smollm2 import embedded_draft_dir, ensure_smollm2_dir

    device = resolve_device(args.device)
    questions = load_questions(args.data_path, args.prompts)
    if args.model_path is None:
        args.model_path = ensure_smollm2_dir(args.cache_dir)
    draft = args.draft_path if args.draft_path is not None else embedded_draft_dir()
    if draft is None:
        raise SystemExit("error: no DFlash draft: this build lacks the embedded one; pass --draft-path")
    big = f"bs{max(args.batch_size, len(questions))}"
    print(f"{len(questions)} prompts, {args.max_new_tokens} new tokens, {args.dtype} on {device}, batched call {big} "
          f"(prompts repeated, first copies compared); target {args.model_path}, draft {draft}", flush=True)
    runs: dict[str, Outputs] = {}
    extra: dict[str, Outputs] = {}
    prompts, runs["target_bs1"], runs[f"target_{big}"], backend = run_mode(args, device, questions, None, extra)
    same_prompts, runs["dflash_bs1"], runs[f"dflash_{big}"], _ = run_mode(args, device, questions, draft)
    assert same_prompts == prompts
    runs.update(extra)
    targets = ["target_bs1", f"target_{big}", *(name for name in extra if name != f"target_{big}")]
    baselines = list(itertools.combinations(targets, 2))  # NOTE: target-only against itself, every batch-shape pair
    pairs = [("dflash_bs1", "target_bs1"), (f"dflash_{big}", f"target_{big}"), *baselines]
    rows = compare(runs, pairs, prompts, Fp32Margins(args.model_path, device))
    summary = summarise(rows)
    baseline_names = [f"{left} vs {right}" for left, right in baselines]
    baseline_margins = [m for name in baseline_names if (m := summary[name]["max_margin"]) is not None]
    date = datetime.date.today().isoformat()
    commit = commit_id()
    report = {"rows": rows, "summary": summary, "baseline_pairs": baseline_names,
              "baseline_max_margin": max(baseline_margins) if baseline_margins else None,
              "deterministic": args.deterministic,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "date": date,
              "commit": commit}
    path = write_json(result_path(args.out, "greedy_drift", date, commit, args.tag), report)
    print(f"attention {backend}; wrote {path}")
    for pair, values in summary.items():
        margin = "-" if values["max_margin"] is None else f"{values['max_margin']:.4f}"
        print(f"  {pair:<28} identical {values['share_identical']:.2f}  max fp32 margin {margin}")
    above = verdict(rows, report["baseline_max_margin"], baseline_names)
    print("every DFlash divergence within the baseline's margin (rounding)" if not above else
          "DFlash divergences above the baseline's largest margin (look for a defect):\n" + "\n".join(above))
    print(plot_result(path))
    return path


if __name__ == "__main__":
    main()
