"""A DFlash draft's accept length against the prompt's length, the answer's format held (issue #24; #20's long-prompt
workloads read accept 1.1-1.4 on the demo pair).

Each GSM8K test question goes in the demo's wording (`blockspec.models.smollm2.build_messages`), its system prompt led by a
preamble of about N tokens of *other* test questions ("Other students asked: ..."), so the target still answers the
one question in its usual style while the context grows. Greedy, full blocks (adaptive verify off), one question at a
time. Default: SmolLM2-135M-Instruct with its embedded draft, CPU fp32; `--draft DIR` measures another draft.

    python benchmarks/accept_vs_context.py --lengths 0,1000,3000 --num-questions 8 --out benchmarks/results

Writes accept_vs_context_<date>_<commit>.json (gpu, date, commit, draft, rows of preamble_tokens, prompt_tokens_mean,
accept_mean, accept per question) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from blockspec import Engine
from blockspec.bench.provenance import run_identity
from blockspec.evals.gsm8k import default_data_path, load_lines
from blockspec.models.smollm2 import build_messages, embedded_draft_dir, ensure_smollm2_dir
from blockspec.tokenizer import chat_to_ids, load_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="0,1000,3000", help="comma-separated preamble sizes in tokens")
    parser.add_argument("--num-questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft", type=Path, help="DFlash draft directory (default: the embedded demo draft)")
    parser.add_argument("--model-dir", type=Path, help="converted SmolLM2-135M-Instruct (default: make demo's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-plot", action="store_true")
    return parser


def preamble(tokenizer: Any, others: list[str], tokens: int) -> str:
    """Other questions, one paragraph each, until the text holds at least `tokens` tokens ("" for 0)."""
    text = ""
    for question in others:
        if len(tokenizer.encode(text)) >= tokens:
            return text
        text += f"Other students asked: {question}\n\n"
    if len(tokenizer.encode(text)) < tokens:
        raise ValueError(f"{len(others)} questions make fewer than {tokens} tokens of preamble")
    return text


def prompts_for(tokenizer: Any, questions: list[str], others: list[str], tokens: int) -> list[list[int]]:
    lead = preamble(tokenizer, others, tokens)
    prompts = []
    for question in questions:
        messages = build_messages(question)
        messages[0] = dict(messages[0], content=lead + messages[0]["content"])
        prompts.append(chat_to_ids(tokenizer, messages))
    return prompts


def measure(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[float]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    return [float(engine.generate(input_ids=p, sampling_params=params)["meta_info"]["spec_accept_length"])
            for p in prompts]


def plot(path: Path) -> Path:
    from plot_common import plt, save_titled

    report = json.loads(path.read_text())
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["prompt_tokens_mean"] for r in rows], [r["accept_mean"] for r in rows], marker="o",
            label=Path(report["draft"]).name)
    ax.set_xlabel("prompt tokens (mean)")
    ax.set_ylabel("accept length (tokens per verify)")
    ax.set_ylim(bottom=1.0)
    ax.legend(fontsize=7)
    return save_titled(fig, report, path, "accept length vs prompt length · ")


def main() -> int:
    args = build_parser().parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 0:
        raise SystemExit(f"--lengths needs sizes >= 0, got {args.lengths!r}")
    model_dir = args.model_dir or ensure_smollm2_dir(None)
    draft = args.draft or embedded_draft_dir()
    if draft is None:
        raise SystemExit("this build has no embedded demo draft: pass --draft")
    tokenizer = load_tokenizer(model_dir)
    test = [row["question"] for row in load_lines(default_data_path())]
    # NOTE: the preambles come from the end of the split, the measured questions from its start: never the same
    questions, others = test[: args.num_questions], test[::-1][: len(test) - args.num_questions]
    prompt_sets = {tokens: prompts_for(tokenizer, questions, others, tokens) for tokens in lengths}
    longest = max(len(p) for prompts in prompt_sets.values() for p in prompts)
    engine = Engine(model_path=str(model_dir), device=args.device, dtype="float32" if args.device == "cpu" else "auto",
                    speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft), max_running_requests=1,
                    max_total_tokens=longest + 2 * args.max_new_tokens + 256, speculative_adaptive_verify="off")
    report: dict[str, Any] = {**run_identity(), "device": args.device, "draft": str(draft),
                              "num_questions": len(questions), "max_new_tokens": args.max_new_tokens, "rows": []}
    for tokens, prompts in prompt_sets.items():
        start = time.perf_counter()
        accepts = measure(engine, prompts, args.max_new_tokens)
        row = {"preamble_tokens": tokens, "prompt_tokens_mean": round(statistics.fmean(map(len, prompts)), 1),
               "accept_mean": round(statistics.fmean(accepts), 3), "accept": [round(a, 3) for a in accepts],
               "seconds": round(time.perf_counter() - start, 1)}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    engine.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"accept_vs_context_{report['date']}_{report['commit']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    if not args.no_plot:
        print(f"wrote {plot(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
