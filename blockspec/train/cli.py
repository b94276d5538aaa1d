"""`blockspec train-draft ...` / `python -m blockspec.train.cli ...`: train a DFlash draft for a target."""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional, Sequence

from blockspec.train.options import TrainOptions, parse_options


def describe_sets(sets: dict[str, dict[str, Any]]) -> str:
    return "; ".join(
        f"{name} accept length {r['accept_length']:.2f} ({r['prompts']} prompts)" for name, r in sets.items()
    )


def _run(options: TrainOptions, args: list[str]) -> str:
    if options.eval_only:
        from blockspec.train.eval_sets import run_eval_only

        return f"{options.out}: " + describe_sets(run_eval_only(options, args))
    if options.responses_only:
        from blockspec.train.pipeline import cache_responses

        total, generated = cache_responses(options)
        return f"{total} responses cached in {options.cache_path} ({generated} generated now)"
    import json
    from pathlib import Path

    from blockspec.train.pipeline import run

    result = run(options, args)
    if result.interrupted:
        return (f"interrupted: saved {options.out} after {result.steps} steps, loss {result.final_loss:.3f} "
                "(not evaluated; training_info.json records the run)")
    accept = [e["accept_length"] for e in result.evals if "accept_length" in e]
    summary = f"saved {options.out} after {result.steps} steps, loss {result.final_loss:.3f}"
    summary += f", held-out accept length {accept[-1]:.2f}" if accept else ""
    info_path = Path(options.out) / "training_info.json"
    runs = json.loads(info_path.read_text()).get("eval_runs", []) if info_path.is_file() else []
    return summary + (f"\n{describe_sets(runs[-1]['sets'])}" if runs else "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options, cpu_defaults = parse_options(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cpu_defaults:
        flags = [f"--{name.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
                 for name, value in cpu_defaults.items()]
        print(f"blockspec train-draft: a CPU run: {' '.join(flags)} (CPU defaults; pass any of them to change it)",
              file=sys.stderr, flush=True)
    try:
        summary = _run(options, args)
    except (FileNotFoundError, ValueError) as error:
        print(f"blockspec train-draft: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("blockspec train-draft: interrupted outside the training steps: the responses generated so far stay in "
              "the response cache (a rerun generates only the rest), a draft saved before stays in --out",
              file=sys.stderr)
        return 130
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
