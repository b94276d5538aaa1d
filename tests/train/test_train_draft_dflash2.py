"""`blockspec train-draft --draft-arch dflash2` on a tiny target (CPU, fp32): the convolutions and the selector are
trained with the backbone, the checkpoint is z-lab's DFlash2 format (bare codebooks), the engine serving it accepts
multi-token blocks and stays lossless, and the `dflash` reference loads it and gives the same tokens and per-cycle
acceptance; --init-from continues a DFlash2 draft."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from blockspec import Engine, cli as blockspec_cli
from blockspec.models.config import load_target_config
from blockspec.train.checkpoint import load_trainable_draft
from tests.support.draft_training import full_block_cycles
from tests.support.train_prompts import write_prompts
from tests.support.tiny_models import save_tiny_model

dflash_model = pytest.importorskip("dflash.model")
dflash_model._cuda_time = time.perf_counter  # NOTE: the reference times with cuda.synchronize; CPU needs a clock

BLOCK, HELD_OUT, MAX_NEW = 8, 6, 40
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
DFLASH2_FLAGS = ["--draft-arch", "dflash2", "--conv-kernel-size", "3", "--conv-group-size", "8", "--selector-rank", "8",
                 "--selector-top-k", "4"]


def train_argv(root: Path, out: str, steps: int, *extra: str) -> list[str]:
    return [
        "train-draft", "--target-model-path", str(root / "target"), "--data", str(root / "prompts.jsonl"),
        "--out", str(root / out), "--cache-dir", str(root / "cache"), "--device", "cpu", "--block-size", str(BLOCK),
        "--num-layers", "2", "--target-layer-ids", "0", "2", "--max-new-tokens", "58", "--ignore-eos",
        "--max-seq-len", "128", "--steps", str(steps), "--batch-size", "8", "--blocks-per-seq", "8", "--lr", "3e-3",
        "--num-eval-prompts", str(HELD_OUT), "--eval-max-new-tokens", str(MAX_NEW), "--save-dtype", "float32",
        "--no-progress", *DFLASH2_FLAGS, *extra,
    ]


def test_train_draft_dflash2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = save_tiny_model("llama", tmp_path / "target", residual_scale=0.3)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 64)
    assert blockspec_cli.main(train_argv(tmp_path, "draft", 250)) == 0
    draft_dir = tmp_path / "draft"
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k")} == {
        "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        base_kernel = f.get_tensor("layers.0.attention_conv.base_kernel")
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.kernel_projection.weight"} <= names
    assert not torch.equal(base_kernel[:, 1:], torch.zeros_like(base_kernel[:, 1:]))  # the taps were trained

    held_out = prompts[-HELD_OUT:]
    plain = Engine(model_path=str(tmp_path / "target"), device="cpu", dtype="float32", skip_tokenizer_init=True)
    expected = [o["output_ids"] for o in plain.generate(input_ids=held_out, sampling_params=GREEDY)]
    engine = Engine(model_path=str(tmp_path / "target"), device="cpu", dtype="float32", skip_tokenizer_init=True,
                    speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir))
    reqs, _ = engine.make_requests(input_ids=held_out, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == expected
    accept = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    assert accept >= 1.5, f"trained DFlash2 draft accepts {accept:.2f} tokens per verify on held-out prompts"

    reference = dflash_model.DFlash2DraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    for prompt, req in zip(held_out[:3], reqs):
        stats = dflash_model.dflash_generate(reference, target, torch.tensor([prompt]), MAX_NEW, None,
                                             temperature=0.0, return_stats=True)
        assert req.output_ids == stats.output_ids[0, len(prompt):].tolist()
        wanted = full_block_cycles(list(stats.acceptance_lengths), MAX_NEW, BLOCK)
        assert req.spec_accept_lengths[:len(wanted)] == wanted

    assert blockspec_cli.main(train_argv(tmp_path, "continued", 2, "--init-from", str(draft_dir))) == 0
    continued, _, _ = load_trainable_draft(tmp_path / "continued", load_target_config(tmp_path / "target"))
    assert continued.candidate_selector is not None
    argv = train_argv(tmp_path, "wrong", 2, "--init-from", str(draft_dir))
    argv[argv.index("--draft-arch") + 1] = "dflash"
    assert blockspec_cli.main(argv) != 0
    assert "is not a --draft-arch dflash draft" in capsys.readouterr().err


def test_the_training_convolution_divides_no_row_count_under_dynamic_shapes() -> None:
    """`--compile-draft` traces the DFlash2 training forward with symbolic shapes. A row count divided by the block
    size (the blocked view 8c3d65f replaced) made sympy most of a compile: about 6x DFlash's on CPU, and a DFlash2
    demo draft saw half an epoch in a 6-minute budget (docs/performance.md). The traced convolution keeps its rows
    flat: no floor division of a symbolic size."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from blockspec.models.grouped_conv import GroupedDynamicCausalConv

    conv = GroupedDynamicCausalConv(32, 4, 8)

    def convolve(hidden: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return conv.reference_convolve(hidden, dynamic, 0, 4)

    traced = make_fx(convolve, tracing_mode="symbolic", _allow_non_fake_inputs=True)(torch.randn(12, 32),
                                                                                     torch.randn(12, 4, 4))
    divisions = [line.strip() for line in traced.code.splitlines() if "//" in line or "floordiv" in line]
    assert divisions == []
