"""`blockspec train-draft ...` / `python -m blockspec.train.cli ...`: train a DFlash draft for a target."""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from blockspec.train.options import parse_options


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse_options(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from blockspec.train.pipeline import run

    try:
        result = run(options, args)
    except (FileNotFoundError, ValueError) as error:
        print(f"blockspec train-draft: error: {error}", file=sys.stderr)
        return 2
    accept = [e["accept_length"] for e in result.evals if "accept_length" in e]
    summary = f"saved {options.out} after {result.steps} steps, loss {result.final_loss:.3f}"
    print(summary + (f", held-out accept length {accept[-1]:.2f}" if accept else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
