"""Qwen3-MoE targets (CPU, fp32): the config's sparse layers, per-expert checkpoints stacked into the experts, dummy
weights, the MoE layer against HF's block, the experts' TP cuts. (Greedy output == HF generate: test_engine_oracle.py;
the engine's other paths: test_qwen3_moe_engine.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockspec.distributed.group import TensorParallel
from blockspec.distributed.shards import ShardLayout, cut_for
from blockspec.layers.moe import ExpertRouting, SparseMoe, experts_reference, route
from blockspec.models.config import load_target_config, parse_target_config
from blockspec.models.loader import load_target_model
from blockspec.models.qwen3_moe import Qwen3MoeCausalLM
from tests.support.engine_testing import random_prompts

MOE_KINDS = ["qwen3_moe", "qwen3_moe_step2"]
PROMPTS = random_prompts([1, 40], seed=3)


def test_sparse_layers_follow_hf_rules(tiny) -> None:
    """mlp_only_layers keeps layer 2 dense; decoder_sparse_step 2 makes layers 1 and 3 sparse; transformers 5 writes
    num_local_experts."""
    config = load_target_config(tiny("qwen3_moe").path)
    assert config.family == "qwen3_moe" and config.qk_norm
    assert json.loads((tiny("qwen3_moe").path / "config.json").read_text()).get("num_local_experts") == 8
    assert config.moe is not None and config.moe.sparse_layers == (0, 1, 3)
    assert config.moe.routing == ExpertRouting(num_experts=8, top_k=2, renormalize=False)
    assert config.moe.expert_intermediate_size == 32 and config.has_dense_layers
    step2 = load_target_config(tiny("qwen3_moe_step2").path)
    assert step2.moe is not None and step2.moe.sparse_layers == (1, 3)
    assert step2.moe.routing == ExpertRouting(num_experts=8, top_k=3, renormalize=True)
    raw = json.loads((tiny("qwen3_moe").path / "config.json").read_text())
    every_layer = parse_target_config({**raw, "mlp_only_layers": []})
    assert every_layer.moe is not None and every_layer.moe.sparse_layers == (0, 1, 2, 3)
    assert not every_layer.has_dense_layers
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        parse_target_config({**raw, "num_experts_per_tok": 9})


def test_experts_stacked_from_per_expert_weights(tiny) -> None:
    """Every expert matrix of the checkpoint lands in its slice of the stacked parameters; the router as is."""
    ckpt = tiny("qwen3_moe")
    model, config = load_target_model(ckpt.path, torch.float32, torch.device("cpu"), 64)
    assert isinstance(model, Qwen3MoeCausalLM)
    hf_layers = ckpt.model.model.layers
    for layer_id, layer in enumerate(model.model.layers):
        if not config.is_sparse(layer_id):
            assert not isinstance(layer.mlp, SparseMoe)
            torch.testing.assert_close(layer.mlp.down_proj.weight, hf_layers[layer_id].mlp.down_proj.weight)
            continue
        assert isinstance(layer.mlp, SparseMoe)
        hf_moe = hf_layers[layer_id].mlp
        torch.testing.assert_close(layer.mlp.gate.weight, hf_moe.gate.weight, rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.experts.gate_up_proj, hf_moe.experts.gate_up_proj, rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.experts.down_proj, hf_moe.experts.down_proj, rtol=0, atol=0)


def test_missing_expert_is_reported(tiny, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text((tiny("qwen3_moe").path / "config.json").read_text())
    weights = load_file(str(tiny("qwen3_moe").path / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 weight.*experts.5.up_proj"):
        load_target_model(target, torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_layer_equals_hf_block(tiny, kind: str) -> None:
    """SparseMoe (torch reference) == HF's Qwen3MoeSparseMoeBlock on the same weights and inputs; route == HF's
    router."""
    ckpt = tiny(kind)
    model, config = load_target_model(ckpt.path, torch.float32, torch.device("cpu"), 64)
    assert config.moe is not None
    layer_id = config.moe.sparse_layers[0]
    ours, theirs = model.model.layers[layer_id].mlp, ckpt.model.model.layers[layer_id].mlp
    x = torch.randn(13, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_ids = theirs.gate(x)
        weights, ids = route(ours.gate(x), config.moe.routing)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights)
        torch.testing.assert_close(ours(x), theirs(x[None])[0])
        out = torch.empty_like(x)
        assert ours(x, out) is out  # the piecewise graphs' static buffer
        torch.testing.assert_close(out, theirs(x[None])[0])


def test_reference_experts_sum_the_routed_experts() -> None:
    """experts_reference against the definition, token by token (weights of a token's k experts, summed)."""
    generator = torch.Generator().manual_seed(1)
    tokens, hidden, intermediate, experts, top_k = 6, 8, 4, 5, 2
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=generator)
    down = torch.randn(experts, hidden, intermediate, generator=generator)
    weights, ids = route(torch.randn(tokens, experts, generator=generator), ExpertRouting(experts, top_k, False))
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).split(intermediate)
            expected[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_reference(x, gate_up, down, weights, ids), expected)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown MoE backend 'cutlass'"):
        SparseMoe(8, 4, ExpertRouting(4, 2, False), backend="cutlass")


def test_dummy_weights_run(tiny, make_engine) -> None:
    """--load-format dummy: random experts and router (norms at 1), no checkpoint read; decoding runs."""
    engine = make_engine(tiny("qwen3_moe").path, load_format="dummy", page_size=4)
    model = engine.runner.model
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.abs().sum() > 0 and experts.down_proj.abs().sum() > 0
    assert torch.all(model.model.layers[0].input_layernorm.weight == 1.0)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert all(len(o["output_ids"]) == 4 for o in outputs)


def test_expert_shard_cuts() -> None:
    """An expert's gate / up are cut by rows and its down by columns of the expert intermediate size (not the dense
    one); the router is replicated; a dense layer's MLP is still cut by the dense intermediate size."""
    layout = ShardLayout(num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=64, vocab_size=10,
                         expert_intermediate_size=32)
    tp = TensorParallel(1, 2)
    gate = cut_for("model.layers.0.mlp.experts.7.gate_proj.weight", layout, tp)
    assert gate is not None and (gate.dim, gate.start, gate.length) == (0, 16, 16)
    down = cut_for("model.layers.0.mlp.experts.0.down_proj.weight", layout, tp)
    assert down is not None and (down.dim, down.start, down.length) == (1, 16, 16)
    assert cut_for("model.layers.0.mlp.gate.weight", layout, tp) is None
    dense = cut_for("model.layers.2.mlp.up_proj.weight", layout, tp)
    assert dense is not None and (dense.start, dense.length) == (32, 32)
    with pytest.raises(ValueError, match="moe_intermediate_size \\(32\\) is not divisible by tp_size 3"):
        cut_for("model.layers.0.mlp.experts.0.up_proj.weight", ShardLayout(6, 3, 4, 64, 10, 32), TensorParallel(0, 3))



def test_shardability_checks_the_expert_intermediate_size(tiny, tmp_path: Path) -> None:
    """Before any rank starts: moe_intermediate_size must divide by tp_size; the dense intermediate_size only matters
    when some layer is dense."""
    from blockspec.config.engine_config import EngineConfig
    from blockspec.engine.rank_processes import check_shardable

    raw = json.loads((tiny("qwen3_moe").path / "config.json").read_text())

    def config_with(**fields: object) -> EngineConfig:
        directory = tmp_path / "-".join(f"{k}{v}" for k, v in fields.items())
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**raw, **fields}))
        return EngineConfig(model_path=str(directory), device="cpu", tp_size=2)

    check_shardable(config_with(mlp_only_layers=[], intermediate_size=63))  # every layer sparse: 63 is unused
    with pytest.raises(ValueError, match="the target's intermediate_size \\(63\\) is not divisible by tp_size 2"):
        check_shardable(config_with(mlp_only_layers=[2], intermediate_size=63))
    with pytest.raises(ValueError, match="the target's moe_intermediate_size \\(31\\) is not divisible by tp_size 2"):
        check_shardable(config_with(moe_intermediate_size=31))
