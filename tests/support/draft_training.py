"""Trains a tiny DFlash draft on a tiny target's own greedy continuations (test helper, CPU, seconds)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from blockspec import Engine


@torch.no_grad()
def target_continuations(
    target: PreTrainedModel, num_seqs: int, prompt_len: int, new_tokens: int, seed: int
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(3, vocab - 1, (num_seqs, prompt_len), generator=generator)
    out = target.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out


def train_tiny_draft(
    draft: torch.nn.Module,
    target: PreTrainedModel,
    steps: int = 300,
    anchors_per_step: int = 8,
    seed: int = 0,
    lr: float = 3e-3,
    extra_loss: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    num_sequences: int = 24,
) -> torch.nn.Module:
    """DFlash recipe in miniature: random anchors in `num_sequences` greedy continuations of the target, block =
    [anchor token, mask...], loss on the next B-1 tokens through the frozen target lm_head, exponentially decaying
    weights by block position; plus, per block, `extra_loss(draft rows 1..B-1 [B-1, H], the anchor token, the labels
    [B-1])` when given."""
    torch.manual_seed(seed)
    seqs = target_continuations(target, num_sequences, 6, 58, seed)
    with torch.no_grad():
        hidden = target(seqs, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in draft.target_layer_ids], dim=-1)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.lm_head.weight.detach()
    block = draft.block_size
    weights = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / 4.0)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr)
    draft.train()
    length = seqs.shape[1]
    for _ in range(steps):
        loss = torch.zeros(())
        for _ in range(anchors_per_step):
            row = int(torch.randint(0, seqs.shape[0], (1,)))
            anchor = int(torch.randint(4, length - block, (1,)))
            tokens = seqs[row, anchor:anchor + block].clone()
            labels = tokens[1:].clone()
            tokens[1:] = draft.mask_token_id
            out = draft(
                position_ids=torch.arange(anchor + block)[None],
                noise_embedding=F.embedding(tokens[None], embed),
                target_hidden=features[row:row + 1, :anchor],
            )
            logits = out[0, 1:] @ lm_head.T
            loss = loss + (F.cross_entropy(logits, labels, reduction="none") * weights).sum() / weights.sum()
            if extra_loss is not None:
                loss = loss + extra_loss(out[0, 1:], tokens[0], labels)
        optimizer.zero_grad()
        (loss / anchors_per_step).backward()
        optimizer.step()
    return draft.eval()


def full_block_cycles(lengths: list[int], max_new_tokens: int, block: int) -> list[int]:
    """Cycles `dflash_generate` ran with a whole block (near max_new_tokens it shrinks the block)."""
    kept, produced = [], 1
    for n in lengths:
        if produced > max_new_tokens + 1 - block:
            break
        kept.append(n)
        produced += n
    return kept


@dataclass(frozen=True)
class DraftRecipe:
    """How long save_trained_target trains a target kind's draft: optimizer steps, target continuations sampled."""

    steps: int
    num_sequences: int


DENSE_RECIPE = DraftRecipe(steps=200, num_sequences=24)
# NOTE: the tiny MoE target's greedy continuations are harder to predict than the dense targets' (its experts, scaled
# up in tiny_models.build_tiny_model, move the residual stream more): on the dense recipe its draft accepts too few
# tokens per cycle for the tests' multi-token checks, so it trains longer on more continuations (seconds per fixture).
DRAFT_RECIPES = {"qwen3_moe": DraftRecipe(steps=1200, num_sequences=96)}


def save_trained_pair(root: Path) -> Path:
    """root/target (tiny Llama) and root/draft (2-layer, block 8, taps [0, 2], trained on DENSE_RECIPE); returns
    root."""
    save_trained_target(root)
    return root


def save_trained_target(root: Path, kind: str = "llama") -> PreTrainedModel:
    """save_trained_pair (the target a tiny model of `kind`, tests/support/tiny_models.py, its draft trained on the
    kind's DRAFT_RECIPES entry), returning the target model (the HF oracle)."""
    from tests.support.tiny_models import save_tiny_draft, save_tiny_model

    target = save_tiny_model(kind, root / "target", residual_scale=0.3)
    draft = save_tiny_draft(root / "draft", target, [0, 2], 8, num_layers=2, seed=4)
    recipe = DRAFT_RECIPES.get(kind, DENSE_RECIPE)
    train_tiny_draft(draft, target, steps=recipe.steps, num_sequences=recipe.num_sequences)
    draft.save_pretrained(root / "draft")
    return target


def cpu_engine(root: Path, spec: bool, **extra: object) -> Engine:
    """An fp32 CPU engine on root/target (+ root/draft under DFlash), page size 4, 8-token prefill chunks."""
    args: dict[str, object] = dict(model_path=str(root / "target"), device="cpu", dtype="float32", page_size=4,
                                   max_total_tokens=4096, chunked_prefill_size=8, skip_tokenizer_init=True)
    if spec:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    return Engine(**{**args, **extra})
