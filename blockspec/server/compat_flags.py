"""SGLang flags a DFlash user passes that blockspec has no setting of its own for: each maps onto a blockspec setting,
is a documented no-op, or is refused with a clear error when its value means something DFlash does not do."""
from __future__ import annotations

import argparse
from typing import Any

from blockspec.config.engine_config import DEFAULT_CUDA_GRAPH_BS

COMPAT_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--cuda-graph-max-bs", dict(type=int, help="capture CUDA graphs for the default batch sizes up to this one "
                                                "(ignored when --cuda-graph-bs lists them); default: all of them")),
    ("--enable-metrics", dict(action="store_true", help="accepted: Prometheus /metrics is always on")),
    ("--speculative-num-steps", dict(type=int, help="DFlash drafts a whole block in one forward: only 1 is valid "
                                                    "(default: unset)")),
    ("--speculative-eagle-topk", dict(type=int, help="DFlash verifies one chain, not a tree: only 1 is valid "
                                                     "(default: unset)")),
    ("--kv-cache-dtype", dict(default="auto", choices=("auto",), help="auto only: the KV cache is in the model dtype "
                                                                      "(default auto)")),
    ("--max-prefill-tokens", dict(type=int, help="prefill tokens per step; one budget here with "
                                                 "--chunked-prefill-size, the smaller wins (default: unset)")),
]


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang compatibility")
    for flag, kwargs in COMPAT_FLAGS:
        group.add_argument(flag, **kwargs)


def apply_compat_flags(values: dict[str, Any], engine: dict[str, Any], parser: argparse.ArgumentParser) -> None:
    """Folds the compatibility flags in `values` into the EngineConfig keywords `engine` (parser.error when invalid)."""
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk"):
        value = values[_dest(flag)]
        if value is not None and value != 1:
            parser.error(f"{flag} {value}: DFlash proposes one block of --speculative-num-draft-tokens tokens in one "
                         f"draft forward and verifies it as one chain; {flag} can only be 1 (or left out)")
    max_bs = values["cuda_graph_max_bs"]
    if max_bs is not None:
        if max_bs < 1:
            parser.error(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
        if "cuda_graph_bs" not in engine:
            engine["cuda_graph_bs"] = [b for b in DEFAULT_CUDA_GRAPH_BS if b <= max_bs] or [max_bs]
    max_prefill = values["max_prefill_tokens"]
    if max_prefill is not None:
        if max_prefill < 1:
            parser.error(f"--max-prefill-tokens must be >= 1, got {max_prefill}")
        chunk = engine.get("chunked_prefill_size")
        engine["chunked_prefill_size"] = max_prefill if chunk is None or chunk < 0 else min(chunk, max_prefill)
