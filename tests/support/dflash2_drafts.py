"""Tiny z-lab format DFlash2 drafts (built with the `dflash` reference itself), briefly trained on a tiny target's
own greedy continuations, saved as the reference saves them or in the published layout (bare codebook tensors)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, Qwen3Config

from tests.support.draft_training import train_tiny_draft

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def build_dflash2_draft(
    target: PreTrainedModel, target_layer_ids: list[int], block_size: int, num_layers: int = 2, seed: int = 1,
    top_k: int = 4, rank: int = 8, kernel_size: int = 3, group_size: int = 8, sliding_window: int | None = None,
    **dflash_fields: Any,
) -> torch.nn.Module:
    """A random DFlash2 draft for `target`; with `sliding_window` its first layer is a sliding one. The reference
    leaves `base_kernel` uninitialised: here tap 0 starts near identity, the other taps small. The codebooks are
    drawn wide enough that the selector's bilinear term changes choices (not only the unary argmax)."""
    from dflash.model import DFlash2DraftModel

    torch.manual_seed(seed)
    tc = target.config
    extra: dict[str, Any] = {}
    if sliding_window is not None:
        extra = dict(use_sliding_window=True, layer_types=["sliding_attention"] + ["full_attention"] * (num_layers - 1),
                     sliding_window=sliding_window)
    config = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=1e-6, **extra,
    )
    config.architectures = ["DFlash2DraftModel"]
    config.num_target_layers = tc.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {
        "mask_token_id": tc.vocab_size - 1, "target_layer_ids": list(target_layer_ids), "block_size": block_size,
        "conv_kernel_size": kernel_size, "conv_group_size": group_size, "selector_rank": rank,
        "selector_top_k": top_k, **dflash_fields,
    }
    draft = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(0.0, 0.2)
                conv.base_kernel[:, 0] += 1.0
        for name in ("predecessor_codebook", "successor_codebook"):
            getattr(draft.candidate_selector, name).weight.normal_(0.0, 1.0)
    return draft


def train_dflash2_draft(draft: torch.nn.Module, target: PreTrainedModel, steps: int = 200) -> torch.nn.Module:
    """draft_training.train_tiny_draft for the backbone and convolutions, plus the selector: cross-entropy over
    each row's candidates given the true previous token, where the label is one of them."""
    selector = draft.candidate_selector

    def selector_loss(rows: torch.Tensor, anchor: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = draft.compute_logits(rows, target.lm_head)
        unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
        previous = torch.cat([anchor[None], labels[:-1]])
        scores = unary + torch.einsum(
            "pr,pkr->pk", selector.predecessor_codebook(previous) * selector.hidden_projection(rows),
            selector.successor_codebook(candidates),
        )
        hit = candidates == labels[:, None]
        present = hit.any(-1)
        if not present.any():
            return logits.new_zeros(())
        return F.cross_entropy(scores[present], hit[present].float().argmax(-1))

    return train_tiny_draft(draft, target, steps=steps, extra_loss=selector_loss)


def save_published(draft: torch.nn.Module, directory: Path) -> None:
    """save_pretrained, then the codebooks renamed to bare tensors as z-lab publishes them."""
    draft.save_pretrained(directory)
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(str(files[0]))
    for name in CODEBOOKS:
        tensors[name] = tensors.pop(f"{name}.weight")
    save_file(tensors, str(files[0]), metadata={"format": "pt"})


def save_trained_dflash2_pair(root: Path) -> PreTrainedModel:
    """root/target (tiny Llama) and root/draft (DFlash2, block 8, taps [0, 2], trained 150 steps, then codebooks
    ×4 so the selector's chain changes some proposals; published layout); returns the HF target."""
    from tests.support.tiny_models import save_tiny_model

    target = save_tiny_model("llama", root / "target", residual_scale=0.3)
    draft = train_dflash2_draft(build_dflash2_draft(target, [0, 2], 8, seed=4), target, steps=150)
    with torch.no_grad():
        for codebook in (draft.candidate_selector.predecessor_codebook, draft.candidate_selector.successor_codebook):
            codebook.weight.mul_(4.0)
    save_published(draft, root / "draft")
    return target
