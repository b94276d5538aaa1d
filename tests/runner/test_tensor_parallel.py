"""Tensor parallelism on CPU: 2 ranks over gloo, fp32, against the same engine at TP=1 (greedy tokens identical,
log-probabilities close), target-only and DFlash, paged KV and chunked prefill; failures raise, never hang."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from blockspec import Engine
from blockspec.distributed.group import TensorParallel
from blockspec.distributed.shards import ShardLayout, cut_for
from tests.support.tiny_models import save_tiny_draft, save_tiny_model
from tests.support.tp_testing import (
    GREEDY, PROMPTS, check_tp2_matches_tp1, cpu_flags, deadline, generate, tp_engine,
)
from blockspec.engine.rank_processes import TensorParallelError

@pytest.mark.parametrize("variant", ["llama", "qwen3", "llama-kv1-vocab95"])
def test_target_only_tp2_matches_tp1(tmp_path: Path, variant: str) -> None:
    """Llama, Qwen3 (q/k norms), and one KV head (replicated on both ranks) with an odd vocabulary (the last
    vocabulary shard padded); the Qwen3 engine also mixes prefill chunks into decode steps."""
    kind, overrides = (
        ("llama", dict(num_key_value_heads=1, vocab_size=95)) if variant.startswith("llama-") else (variant, {})
    )
    save_tiny_model(kind, tmp_path / "target", **overrides)
    extra = dict(enable_mixed_chunk=True) if kind == "qwen3" else {}
    engine = check_tp2_matches_tp1(cpu_flags(tmp_path / "target", **extra))
    assert engine.ranks is not None and all(p.poll() is not None for p in engine.ranks.processes)


def test_dflash_tp2_matches_tp1_trained_llama(trained_pair: dict[str, Any]) -> None:
    """A trained draft (multi-token acceptance): the same tokens and the same accept lengths at TP=2."""
    root = trained_pair["root"]
    flags = cpu_flags(root / "target", speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"),
                      max_total_tokens=4096)
    with Engine(**flags) as engine:
        accept_lengths = [o["meta_info"]["spec_accept_length"] for o in generate(engine, GREEDY, logprobs=False)]
    assert max(accept_lengths) > 1.5  # NOTE: the draft does get accepted
    check_tp2_matches_tp1(flags)


def test_ddtree_tp2_matches_tp1(trained_pair: dict[str, Any]) -> None:
    """DDTree at TP=2: the tree cycle from device rows (all greedy) and the host step (penalties, logprobs, seeded
    sampling: its TREE_VERIFY and TREE_WALK forwards mirrored) give TP=1's tokens and accept lengths."""
    root = trained_pair["root"]
    flags = cpu_flags(root / "target", speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"),
                      max_total_tokens=4096, speculative_tree_budget=8)
    check_tp2_matches_tp1(flags)


def test_dflash_tp2_matches_tp1_qwen3_mixed_chunk(tmp_path: Path) -> None:
    """Qwen3 target with an odd vocabulary (the draft's sharded argmax skips the padding), random draft, prefill
    chunks mixed into verify steps."""
    target = save_tiny_model("qwen3", tmp_path / "target", vocab_size=95)
    save_tiny_draft(tmp_path / "draft", target, [0, 2], 4, num_layers=2, seed=3)
    flags = cpu_flags(tmp_path / "target", speculative_algorithm="DFLASH",
                      speculative_draft_model_path=str(tmp_path / "draft"), enable_mixed_chunk=True)
    check_tp2_matches_tp1(flags)


def test_killed_rank_raises_instead_of_hanging(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path / "target")
    with tp_engine(cpu_flags(tmp_path / "target"), seconds=60.0) as engine:
        assert engine.ranks is not None
        generate(engine, GREEDY, logprobs=False)
        os.kill(engine.ranks.processes[0].pid, 9)
        with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
            generate(engine, GREEDY, logprobs=False)


def test_rank_failing_at_startup_reports_its_error(tmp_path: Path) -> None:
    """A checkpoint whose embedding lacks rows: only rank 1's vocabulary shard is short, so rank 1 fails while
    rank 0 waits for it in a collective; the engine raises rank 1's error."""
    save_tiny_model("llama", tmp_path / "target")
    weights_path = tmp_path / "target" / "model.safetensors"
    weights = load_file(str(weights_path))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:60].clone()
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    with deadline(None, 90.0), pytest.raises(TensorParallelError, match="(?s)rank 1 failed.*embed_tokens"):
        Engine(tp_size=2, **cpu_flags(tmp_path / "target"))


def test_unshardable_shapes_fail_before_any_rank_starts(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path / "target")
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by tp_size 3"):
        Engine(tp_size=3, **cpu_flags(tmp_path / "target"))
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        Engine(tp_size=0, **cpu_flags(tmp_path / "target"))


def test_shard_cuts() -> None:
    """Column cuts for q|k|v / gate|up and vocabulary rows, row cuts for o / down, KV heads replicated when fewer
    than ranks (ranks 0, 1 share KV head 0; ranks 2, 3 head 1), row-parallel biases on rank 0 only."""
    layout = ShardLayout(num_heads=8, num_kv_heads=2, head_dim=4, intermediate_size=64, vocab_size=10)
    cuts = {r: TensorParallel(r, 4) for r in range(4)}
    q = [cut_for("model.layers.0.self_attn.q_proj.weight", layout, tp) for tp in cuts.values()]
    assert [(c.dim, c.start, c.length) for c in q if c] == [(0, 0, 8), (0, 8, 8), (0, 16, 8), (0, 24, 8)]
    k = [cut_for("model.layers.0.self_attn.k_proj.weight", layout, tp) for tp in cuts.values()]
    assert [(c.start, c.length) for c in k if c] == [(0, 4), (0, 4), (4, 4), (4, 4)]
    down = cut_for("model.layers.1.mlp.down_proj.weight", layout, cuts[2])
    assert down is not None and (down.dim, down.start, down.length) == (1, 32, 16)
    vocab = [cut_for("lm_head.weight", layout, tp) for tp in cuts.values()]
    assert [(c.start, c.length, c.padded_length) for c in vocab if c] == [(0, 3, 3), (3, 3, 3), (6, 3, 3), (9, 1, 3)]
    assert cut_for("model.layers.0.self_attn.o_proj.bias", layout, cuts[0]) is None
    bias = cut_for("model.layers.0.self_attn.o_proj.bias", layout, cuts[1])
    assert bias is not None and bias.zeros
    assert cut_for("model.norm.weight", layout, cuts[3]) is None
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        TensorParallel(0, 4).local_kv_heads(3)



def test_server_engine_process_runs_tp2(tmp_path: Path) -> None:
    """`blockspec serve --tp-size 2`: the engine process (daemonic) starts its ranks and serves through them."""
    import asyncio

    from blockspec.request import Req, SamplingParams
    from blockspec.server.engine_loop import EngineLoop
    from blockspec.engine.process import EngineProcess

    save_tiny_model("llama", tmp_path / "target")
    flags = cpu_flags(tmp_path / "target")
    with Engine(**flags) as engine:
        expected = generate(engine, GREEDY, logprobs=False)[0]["output_ids"]
    loop = EngineLoop(EngineProcess({**flags, "tp_size": 2}, "warning"))

    async def scenario() -> None:
        loop.start()
        try:  # NOTE: the engine process ignores SIGTERM: without Stop, the test process would wait for it forever
            assert (await loop.call("get_server_info"))["tp_size"] == 2
            submission = loop.submit([Req(PROMPTS[0], SamplingParams.from_dict(GREEDY), "r")], stream=False)
            delta = await asyncio.wait_for(submission.next(), 60.0)
        finally:
            await loop.stop()
        assert delta.error is None and delta.ids == expected

    with deadline(None, 120.0):
        loop.launch()
        asyncio.run(scenario())
