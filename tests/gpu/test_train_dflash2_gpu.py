"""`train-draft --draft-arch dflash2` on the GPU: one training step's gradients equal the CPU's for every parameter of
a DFlash2 draft (its convolutions, the sublayers between them, the selector). The inference kernels have no backward:
a training forward on CUDA must not take them (models/grouped_conv.py's fused_conv_applies). Then the draft-training
chain's train stage in small on CUDA: a compiled DFlash2 draft over cached features that fill the device tier, then
the host tier, then are recomputed (train/feature_cache.py)."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import cli as blockspec_cli  # noqa: E402
from blockspec.models.draft_config import DFlash2Fields  # noqa: E402
from blockspec.train.blocks import BlockBatch, block_loss, loss_weights  # noqa: E402
from blockspec.train.feature_cache import FeatureCache, default_device_limit  # noqa: E402
from blockspec.train.model import DraftArch, TrainableDraft  # noqa: E402
from tests.support.tiny_models import save_tiny_model  # noqa: E402
from tests.support.train_prompts import write_prompts  # noqa: E402

VOCAB, HIDDEN, BLOCK, BLOCKS, CONTEXT = 32, 32, 4, 3, 10


def one_step_gradients(draft: TrainableDraft, lm_head: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows = BLOCKS * BLOCK
    block_ids = torch.randint(0, VOCAB, (1, BLOCKS, BLOCK), generator=generator)
    labels = torch.randint(0, VOCAB, (1, BLOCKS, BLOCK - 1), generator=generator)
    mask = torch.ones(1, rows, CONTEXT + rows, dtype=torch.bool)
    batch = BlockBatch(
        features=torch.randn(1, CONTEXT, 2 * HIDDEN, generator=generator).to(device),
        block_ids=block_ids.to(device), positions=(CONTEXT + torch.arange(rows))[None].to(device),
        mask=mask.to(device), labels=labels.to(device), block_valid=torch.ones(1, BLOCKS, dtype=torch.bool).to(device),
    )
    embeds = torch.randn(1, rows, HIDDEN, generator=generator).to(device)
    draft = draft.to(device)
    hidden = draft(embeds, batch.positions, batch.features, batch.mask)
    result = block_loss(hidden, batch, lm_head.to(device), loss_weights(BLOCK, 7.0).to(device),
                        draft.candidate_selector)
    result.loss.backward()
    return {name: p.grad.cpu() if p.grad is not None else None for name, p in draft.named_parameters()}


def test_a_dflash2_draft_trains_on_cuda_as_on_cpu() -> None:
    torch.manual_seed(0)
    fields = DFlash2Fields(conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=VOCAB,
                           selector_vocab_size=VOCAB, logits_width=VOCAB)
    arch = DraftArch(hidden_size=HIDDEN, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     rms_norm_eps=1e-6, rope_theta=10000.0, num_taps=2, max_position_embeddings=128,
                     dflash2=fields, block_size=BLOCK)
    draft = TrainableDraft(arch)  # NOTE: top-k of the whole vocabulary: every label a candidate, so the selector trains
    with torch.no_grad():  # NOTE: the dynamic weights and the bilinear term away from their zero start
        for module in draft.modules():
            if hasattr(module, "base_kernel"):
                module.base_kernel.normal_(0.0, 0.5)
        draft.candidate_selector.hidden_projection.weight.normal_(0.0, 0.1)
    lm_head = torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5
    on_cpu = one_step_gradients(copy.deepcopy(draft), lm_head, torch.device("cpu"))
    on_cuda = one_step_gradients(copy.deepcopy(draft), lm_head, torch.device("cuda"))
    assert on_cuda.keys() == on_cpu.keys()
    for name, want in on_cpu.items():
        got = on_cuda[name]
        assert want is not None and got is not None, name
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3, msg=name)


def test_cuda_features_fill_device_slabs_then_host_memory() -> None:
    device = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(device)
    assert 0 <= default_device_limit(device) <= free + torch.cuda.memory_reserved(device)
    per_sequence = 10 * 8 * 2  # NOTE: [10, 8] bf16: 160 bytes, so a 512-byte slab holds two (256-byte aligned)
    cache = FeatureCache(device, device_limit_bytes=1024, host_limit_bytes=per_sequence, slab_bytes=512)
    features = [torch.randn(10, 8, device=device).to(torch.bfloat16) for _ in range(6)]
    for index, value in enumerate(features):
        cache.put(index, value)
    assert [index in cache for index in range(6)] == [True] * 5 + [False]
    for index in range(5):
        got = cache.get(index)
        assert got.device.type == "cuda" and got.dtype == torch.bfloat16 and torch.equal(got, features[index])
    assert cache.stats.as_dict() == {"device_sequences": 4, "device_bytes": 4 * per_sequence, "host_sequences": 1,
                                     "host_bytes": per_sequence, "not_kept": 1}


def test_the_chain_train_stage_in_small_on_cuda(tmp_path: Path) -> None:
    """`train-draft --draft-arch dflash2 --compile-draft --cache-features` with limits that send features to every
    tier: the run ends, its loss is finite, the compiled step was kept and the cache says where the features went."""
    save_tiny_model("llama", tmp_path / "target", residual_scale=0.3)
    write_prompts(tmp_path / "prompts.jsonl", 12)
    kib = 1 / (1 << 20)  # NOTE: in GiB; a sequence's features here are about 6 KiB (5,806 bytes on average on the H100)
    argv = [
        "train-draft", "--target-model-path", str(tmp_path / "target"), "--data", str(tmp_path / "prompts.jsonl"),
        "--out", str(tmp_path / "draft"), "--cache-dir", str(tmp_path / "cache"), "--device", "cuda",
        "--block-size", str(BLOCK), "--num-layers", "2", "--max-new-tokens", "40", "--ignore-eos",
        "--max-seq-len", "128", "--steps", "6", "--batch-size", "4", "--blocks-per-seq", "4", "--lr", "3e-3",
        "--num-eval-prompts", "0", "--no-progress", "--draft-arch", "dflash2", "--conv-kernel-size", "3",
        "--conv-group-size", "8", "--selector-rank", "8", "--selector-top-k", "4", "--compile-draft",
        "--cache-features", "--feature-cache-device-gib", str(24 * kib), "--feature-cache-host-gib", str(8 * kib),
    ]
    assert blockspec_cli.main(argv) == 0
    result = json.loads((tmp_path / "draft" / "training_info.json").read_text())["result"]
    assert result["steps"] == 6 and math.isfinite(result["final_loss"])
    assert result["compile_fallback"] is None
    cache = result["feature_cache"]
    assert cache["device_sequences"] > 0 and cache["host_sequences"] > 0 and cache["not_kept"] > 0, cache
