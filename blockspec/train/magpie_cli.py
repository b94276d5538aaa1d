"""`blockspec generate-prompts`: user prompts sampled from the target itself (magpie.py) → train / held-out JSONL."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from blockspec.train.magpie import (
    MagpieSettings, engine_generate, generate_prompts, last_user_turns, user_turn, write_prompts,
)
from blockspec.train.prompt_filter import FilterSettings


def build_parser() -> argparse.ArgumentParser:
    defaults, filters = MagpieSettings(1), FilterSettings()
    parser = argparse.ArgumentParser(prog="blockspec generate-prompts", description=__doc__)
    parser.add_argument("--model-path", required=True, help="HF-style target directory with a chat template")
    parser.add_argument(
        "--out",
        required=True,
        help="output directory: prompts.train.jsonl, prompts.heldout.jsonl, generation_info.json",
    )
    parser.add_argument("--num-prompts", type=int, required=True, help="prompts to keep (train + held-out)")
    parser.add_argument("--heldout-fraction", type=float, default=defaults.heldout_fraction,
                        help="share of the prompts written to prompts.heldout.jsonl (never trained on)")
    parser.add_argument("--max-candidates", type=int, default=None, help="user turns sampled at most (default 4 x N)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="user turn length cap")
    parser.add_argument(
        "--system-prompt", default=None, help="system message before the user turn (and in the records)"
    )
    parser.add_argument("--exclude", action="append", default=[], metavar="FILE",
                        help="prompt JSONL whose user turns new prompts must not duplicate, even nearly (repeatable)")
    parser.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="user turns sampled per generate call"
    )
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no new batch after this many minutes (keeps what it has; default: no limit)")
    parser.add_argument("--min-words", type=int, default=filters.min_words)
    parser.add_argument("--max-chars", type=int, default=filters.max_chars)
    parser.add_argument("--min-ascii-share", type=float, default=filters.min_ascii_share)
    parser.add_argument(
        "--near-duplicate-jaccard",
        type=float,
        default=filters.near_duplicate_jaccard,
        help="word-3-gram Jaccard similarity from which a prompt counts as a duplicate of an earlier one",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def settings_from_args(ns: argparse.Namespace) -> MagpieSettings:
    filters = FilterSettings(min_words=ns.min_words, max_chars=ns.max_chars, min_ascii_share=ns.min_ascii_share,
                             near_duplicate_jaccard=ns.near_duplicate_jaccard)
    return MagpieSettings(
        num_prompts=ns.num_prompts,
        seed=ns.seed,
        temperature=ns.temperature,
        top_p=ns.top_p,
        max_new_tokens=ns.max_new_tokens,
        max_candidates=ns.max_candidates,
        batch_size=ns.batch_size,
        heldout_fraction=ns.heldout_fraction,
        system_prompt=ns.system_prompt,
        max_minutes=ns.max_minutes,
        filters=filters,
    )


def build_engine(model_path: str, device: str, dtype: str, settings: MagpieSettings, prefix_len: int) -> Any:
    """As train-draft's response engine: wide batches (small targets want them) and a KV pool sized to hold them all,
    not a share of free memory, so that several generators fit one device."""
    from blockspec.engine.engine import Engine
    from blockspec.train.response_workers import GEN_MAX_RUNNING, generation_engine_flags

    running = min(settings.batch_size, GEN_MAX_RUNNING)
    return Engine(
        model_path=model_path, device=device, dtype=dtype, skip_tokenizer_init=True, random_seed=settings.seed,
        **generation_engine_flags(running), max_total_tokens=running * (prefix_len + settings.max_new_tokens + 1),
    )


def run(ns: argparse.Namespace) -> dict[str, Path]:
    from blockspec.tokenizer import load_tokenizer

    settings = settings_from_args(ns)
    settings.validate()
    if not Path(ns.model_path).is_dir():
        raise FileNotFoundError(f"--model-path {ns.model_path}: no such directory")
    for path in ns.exclude:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--exclude {path}: no such file")
    known = last_user_turns(ns.exclude)
    tokenizer = load_tokenizer(ns.model_path)
    prefix_len = len(user_turn(tokenizer, settings.system_prompt).prefix_ids)
    engine = build_engine(ns.model_path, ns.device, ns.dtype, settings, prefix_len)
    try:
        generated = generate_prompts(engine_generate(engine), tokenizer, settings, ns.progress, known)
    finally:
        engine.shutdown()
    paths = write_prompts(ns.out, generated, settings.system_prompt)
    info = generated.info
    print(f"{info['prompts']} prompts from {info['candidates']} candidates ({info['train']} train, {info['heldout']} "
          f"held out; rejected {info['rejected']}, duplicates {info['exact_duplicates']} exact + "
          f"{info['near_duplicates']} near) in {info['seconds']} s -> {paths['train'].parent}")
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(ns)
    except (FileNotFoundError, ValueError) as error:
        print(f"blockspec generate-prompts: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
