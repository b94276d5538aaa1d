"""DFlash's synchronous cycle (grammar-constrained and sampled requests: the draft's graph, proposals walked on the
host under the grammar mask, then the verify graph, which also writes the draft KV) replayed from CUDA graphs commits
what it commits eagerly, at the same accept lengths. On the CPU through the graph emulation of
tests/support/replayed_cuda_graphs.py (host values frozen at capture, every output overwritten by the next replay of
any graph), with Triton attention in its CPU interpreter (the backend the graphs run on CUDA) and the full block every
cycle (the accept length is the masked draft's)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.draft_training import cpu_engine
from tests.support.engine_testing import assert_engine_idle
from tests.support.replayed_cuda_graphs import enable_emulated_graphs

pytest.importorskip("triton")

SCHEMA = json.dumps({
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"], "additionalProperties": False,
})
PROMPTS = ["Answer yes or no: is the sky blue?", "Janet has 3 apples.", "Give me JSON"]


def test_synchronous_cycle_replays_as_it_runs_eagerly(qwen_vocab_pair: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = qwen_vocab_pair["tokenizer"]
    prompts = [list(tokenizer.encode(text)) for text in PROMPTS]
    params = [{"temperature": 0, "max_new_tokens": 16, "json_schema": SCHEMA},
              {"temperature": 1.0, "seed": 1, "max_new_tokens": 16, "json_schema": SCHEMA},
              {"temperature": 1.0, "seed": 2, "max_new_tokens": 16}]
    engine = cpu_engine(Path(qwen_vocab_pair["root"]), True, skip_tokenizer_init=False, attention_backend="triton",
                        speculative_adaptive_verify="off", cuda_graph_bs=[4])
    try:
        pool = enable_emulated_graphs(monkeypatch, engine)
        runs: dict[bool, list[tuple[list[int], float]]] = {}
        for graphs_on in (False, True):
            monkeypatch.setattr(engine.runner.graphs, "enabled", graphs_on)
            assert engine.flush_cache()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            runs[graphs_on] = [(o["output_ids"], o["meta_info"]["spec_accept_length"]) for o in outs]
        assert pool.replays["draft"] > 0 and pool.replays["target-verify"] > 0, pool.replays
        assert runs[True] == runs[False]
        assert runs[True][0][1] > 1.5, runs  # NOTE: the masked draft proposes what the grammar forces
        assert_engine_idle(engine)
    finally:
        engine.shutdown()
