"""Measures a DFlash draft's acceptance histogram on GSM8K test questions (greedy, full blocks) and writes it as an
acceptance profile for `--speculative-simulate-accept-profile PATH` (benchmarks/adaptive_verify.py uses the demo
draft's): {"spec_accept_length_histogram": [count of verifies that committed c tokens, c = 0..B], ...}.

Default: SmolLM2-135M-Instruct with its embedded draft (block 16), CPU fp32, one question at a time.
`--num-draft-tokens N` runs the draft with a block of N instead (a shorter draft block), `--verify-length N` verifies
only the first N tokens of the full block (adaptive verify's way): comparing the two measures what a shorter draft
block costs in acceptance.
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from blockspec import Engine
from blockspec.evals.gsm8k import default_data_path, load_lines
from blockspec.models.smollm2 import build_messages, embedded_draft_dir, ensure_smollm2_dir
from blockspec.tokenizer import chat_to_ids, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-questions", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="draft block size (default: the draft's)")
    parser.add_argument("--verify-length", type=int, default=None, help="verify the first N block tokens every cycle")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "profiles" / "smollm2_demo_draft_gsm8k.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir, draft = ensure_smollm2_dir(None), embedded_draft_dir()
    assert draft is not None, "this build has no embedded demo draft"
    tokenizer = load_tokenizer(model_dir)
    questions = load_lines(default_data_path())[: args.num_questions]
    prompts = [chat_to_ids(tokenizer, build_messages(row["question"])) for row in questions]
    verify = {"speculative_num_draft_tokens_per_bs": f"1:{args.verify_length}"} if args.verify_length else {
        "speculative_adaptive_verify": "off"}
    engine = Engine(model_path=str(model_dir), device=args.device, dtype="float32" if args.device == "cpu" else "auto",
                    speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft), max_running_requests=1,
                    max_total_tokens=8192, speculative_num_draft_tokens=args.num_draft_tokens, **verify)
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens})
    stats = engine.get_server_info()["internal_states"][0]
    profile = {
        "spec_accept_length_histogram": stats["spec_accept_length_histogram"],
        "avg_spec_accept_length": stats["avg_spec_accept_length"],
        "source": f"SmolLM2-135M-Instruct + {draft.name}, {args.num_questions} GSM8K test questions, greedy, "
                  f"max_new_tokens {args.max_new_tokens}, {args.device}, {datetime.date.today().isoformat()}",
        "num_draft_tokens": engine.worker.block_size, "verify_length": args.verify_length,
    }
    engine.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile))


if __name__ == "__main__":
    main()
