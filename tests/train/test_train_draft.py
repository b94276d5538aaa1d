"""`blockspec train-draft` end to end on a tiny target: the trained draft accepts multi-token blocks, stays lossless,
and its z-lab checkpoint behaves identically in the `dflash` reference (CPU, fp32)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from tests.support.draft_training import full_block_cycles
from safetensors import safe_open
from transformers import PreTrainedModel

from blockspec import Engine, cli as blockspec_cli
from blockspec.models.config import load_target_config
from blockspec.train.checkpoint import draft_config_dict, load_trainable_draft, save_draft
from tests.support.tiny_models import save_tiny_draft, save_tiny_model
from tests.support.train_prompts import write_prompts

dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

BLOCK = 8
LAYER_IDS = [0, 2]
NUM_PROMPTS, HELD_OUT = 104, 8
MAX_NEW = 40
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@dataclass
class Trained:
    root: Path
    target_dir: Path
    draft_dir: Path
    target: PreTrainedModel
    held_out: list[list[int]]
    info: dict[str, Any]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    root = tmp_path_factory.mktemp("train_draft")
    target = save_tiny_model("llama", root / "target", residual_scale=0.3)
    prompts = write_prompts(root / "prompts.jsonl", NUM_PROMPTS)
    argv = [
        "train-draft", "--target-model-path", str(root / "target"), "--data", str(root / "prompts.jsonl"),
        "--out", str(root / "draft"), "--cache-dir", str(root / "cache"), "--device", "cpu",
        "--block-size", str(BLOCK), "--num-layers", "2", "--target-layer-ids", *map(str, LAYER_IDS),
        "--max-new-tokens", "58", "--ignore-eos", "--max-seq-len", "128",
        "--steps", "300", "--batch-size", "8", "--blocks-per-seq", "8", "--lr", "3e-3",
        "--num-eval-prompts", str(HELD_OUT), "--eval-max-new-tokens", str(MAX_NEW), "--eval-every", "150",
        "--save-dtype", "float32", "--no-progress",
    ]
    assert blockspec_cli.main(argv) == 0
    with open(root / "draft" / "training_info.json") as f:
        info = json.load(f)
    return Trained(root, root / "target", root / "draft", target, prompts[-HELD_OUT:], info)


def generate(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(outputs, list)
    accept = engine.get_server_info()["internal_states"][0].get("avg_spec_accept_length", 0.0)
    return [o["output_ids"] for o in outputs], accept


def test_trained_draft_accepts_blocks_and_stays_lossless(trained: Trained, make_engine: Callable[..., Engine]) -> None:
    plain, _ = generate(make_engine(trained.target_dir), trained.held_out)
    random_dir = trained.root / "random_draft"
    save_tiny_draft(random_dir, trained.target, LAYER_IDS, BLOCK, num_layers=2)
    engines = {
        name: make_engine(trained.target_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=str(path))
        for name, path in (("trained", trained.draft_dir), ("random", random_dir))
    }
    trained_out, trained_accept = generate(engines["trained"], trained.held_out)
    random_out, random_accept = generate(engines["random"], trained.held_out)
    assert trained_out == plain and random_out == plain  # DFlash is lossless whatever the draft
    assert random_accept < 1.2
    assert trained_accept >= 1.5, f"trained draft accepts {trained_accept:.2f} tokens per verify on held-out prompts"
    evals = trained.info["result"]["evals"]
    assert [e["step"] for e in evals] == [150, 300]
    assert evals[-1]["accept_length"] == pytest.approx(trained_accept, abs=0.2)  # the trainer's own eval agrees
    print(f"held-out avg accept length: trained {trained_accept:.2f}, random {random_accept:.2f}")


def test_checkpoint_is_zlab_format(trained: Trained) -> None:
    with open(trained.draft_dir / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["target_layer_ids"] == LAYER_IDS
    assert 0 <= config["dflash_config"]["mask_token_id"] < 96
    assert config["block_size"] == BLOCK and config["num_target_layers"] == 4 and config["hidden_size"] == 32
    with safe_open(str(trained.draft_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    per_layer = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    expected = {f"layers.{i}.{p}.weight" for i in range(2) for p in per_layer} | {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    }
    assert names == expected
    assert trained.info["command"][:2] == ["blockspec", "train-draft"]
    assert trained.info["responses_generated"] == NUM_PROMPTS - HELD_OUT


def blockspec_cycles(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    reqs, _ = engine.make_requests(input_ids=prompts, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    return [r.output_ids for r in reqs], [r.spec_accept_lengths for r in reqs]


def test_reference_gives_same_acceptance(trained: Trained, make_engine: Callable[..., Engine]) -> None:
    reference = dflash_model.DFlashDraftModel.from_pretrained(str(trained.draft_dir), dtype=torch.float32).eval()
    prompts = trained.held_out[:3]
    engine = make_engine(
        trained.target_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=str(trained.draft_dir)
    )
    outputs, lengths = blockspec_cycles(engine, prompts)
    for prompt, output, cycle_lengths in zip(prompts, outputs, lengths):
        stats = dflash_model.dflash_generate(
            reference, trained.target, torch.tensor([prompt]), MAX_NEW, None, temperature=0.0, return_stats=True
        )
        assert output == stats.output_ids[0, len(prompt):].tolist()
        expected = full_block_cycles(list(stats.acceptance_lengths), MAX_NEW, BLOCK)
        assert cycle_lengths[:len(expected)] == expected
    assert max(n for cycle in lengths for n in cycle) >= 3  # the comparison covers multi-token acceptance


def test_sharded_checkpoint_loads_in_both(trained: Trained, make_engine: Callable[..., Engine]) -> None:
    target_config = load_target_config(trained.target_dir)
    model, layer_ids, block = load_trainable_draft(trained.draft_dir, target_config)
    with open(trained.draft_dir / "config.json") as f:
        mask = json.load(f)["dflash_config"]["mask_token_id"]
    sharded = trained.root / "sharded"
    config = draft_config_dict(model.arch, target_config, layer_ids, block, mask, "float32")
    save_draft(model, sharded, config, "float32", max_shard_mb=8 / 1024)  # 8 KiB shards
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 3 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    reference = dflash_model.DFlashDraftModel.from_pretrained(str(sharded), dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reference.state_dict()[name], tensor), name
    prompts = trained.held_out[:2]
    engines = [
        make_engine(trained.target_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=str(path))
        for path in (trained.draft_dir, sharded)
    ]
    assert blockspec_cycles(engines[0], prompts) == blockspec_cycles(engines[1], prompts)


def test_a_dflash2_draft_grown_from_it_proposes_what_it_did(trained: Trained, make_engine: Callable[..., Engine],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """TrainableDraft.dflash2_from: the DFlash draft's weights, pass-through convolutions and a selector without its
    bilinear term. z-lab's DFlash2 reference (and blockspec) serve it with the DFlash draft's tokens and per-cycle
    acceptance, so a DFlash2 draft trained from it starts where the DFlash draft is; `train-draft --draft-arch dflash2
    --init-from` a DFlash draft trains from there."""
    from blockspec.models.draft_config import parse_dflash2_fields
    from blockspec.train.model import TrainableDraft

    target_config = load_target_config(trained.target_dir)
    model, layer_ids, block = load_trainable_draft(trained.draft_dir, target_config)
    with open(trained.draft_dir / "config.json") as f:
        mask = json.load(f)["dflash_config"]["mask_token_id"]
    fields = parse_dflash2_fields({"architectures": ["DFlash2DraftModel"], "conv_kernel_size": 3,
                                   "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4},
                                  target_config, target_config.hidden_size)
    assert fields is not None
    grown = TrainableDraft.dflash2_from(model, fields)
    grown_dir = trained.root / "grown_dflash2"
    save_draft(grown, grown_dir, draft_config_dict(grown.arch, target_config, layer_ids, block, mask, "float32"),
               "float32")
    dflash = dflash_model.DFlashDraftModel.from_pretrained(str(trained.draft_dir), dtype=torch.float32).eval()
    dflash2 = dflash_model.DFlash2DraftModel.from_pretrained(str(grown_dir), dtype=torch.float32).eval()
    prompts = trained.held_out[:3]
    for prompt in prompts:
        runs = [dflash_model.dflash_generate(draft, trained.target, torch.tensor([prompt]), MAX_NEW, None,
                                             temperature=0.0, return_stats=True) for draft in (dflash, dflash2)]
        assert torch.equal(runs[0].output_ids, runs[1].output_ids)
        assert list(runs[0].acceptance_lengths) == list(runs[1].acceptance_lengths)
    engines = [
        make_engine(trained.target_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=str(path))
        for path in (trained.draft_dir, grown_dir)
    ]
    outputs, lengths = blockspec_cycles(engines[0], prompts)
    assert blockspec_cycles(engines[1], prompts) == (outputs, lengths)
    assert max(n for cycle in lengths for n in cycle) >= 3  # multi-token acceptance compared

    argv = [
        "train-draft", "--target-model-path", str(trained.target_dir), "--data", str(trained.root / "prompts.jsonl"),
        "--out", str(trained.root / "trained_dflash2"), "--cache-dir", str(trained.root / "cache"), "--device",
        "cpu", "--block-size", str(BLOCK), "--num-layers", "2", "--max-new-tokens", "58", "--ignore-eos",
        "--max-seq-len", "128", "--steps", "2", "--batch-size", "8", "--blocks-per-seq", "8", "--lr", "3e-3",
        "--num-eval-prompts", "2", "--eval-max-new-tokens", "8", "--save-dtype", "float32", "--no-progress",
        "--draft-arch", "dflash2", "--conv-kernel-size", "3", "--conv-group-size", "8", "--selector-rank", "8",
        "--selector-top-k", "4", "--init-from", str(trained.draft_dir),
    ]
    assert blockspec_cli.main(argv) == 0
    continued, continued_ids, _ = load_trainable_draft(trained.root / "trained_dflash2", target_config)
    assert continued.arch.dflash2 == fields and continued_ids == layer_ids
    start, after = model.state_dict(), continued.state_dict()
    moved = [name for name in start if not torch.allclose(start[name], after[name], atol=0.05)]
    assert not moved, f"two steps moved the DFlash weights far: {moved[:3]}"
    assert any(not torch.equal(start[name], after[name]) for name in start)  # but they trained
    argv[argv.index("--block-size") + 1] = str(BLOCK * 2)
    capsys.readouterr()
    assert blockspec_cli.main(argv) != 0
    assert f"drafts blocks of {BLOCK}, not --block-size {BLOCK * 2}" in capsys.readouterr().err
