"""Prompt files for `blockspec train-draft` on the tiny targets: random token-id prompts, one JSON object a line."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def write_prompts(path: Path, count: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of 3-8 token ids (3-94, inside the tiny vocabulary) written to `path` as JSONL
    ({"input_ids": [...]} a line); returns them."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    with open(path, "w") as f:
        for _ in range(count):
            n = int(torch.randint(3, 9, (1,), generator=generator))
            prompts.append(torch.randint(3, 95, (n,), generator=generator).tolist())
            f.write(json.dumps({"input_ids": prompts[-1]}) + "\n")
    return prompts
