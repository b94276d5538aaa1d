"""Greedy output is token-identical to HF transformers `generate` (CPU, fp32) on tiny Llama-3 / Qwen3 / Qwen3-MoE
models."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.support.engine_testing import VOCAB, hf_greedy, random_prompts

KINDS = ["llama", "llama_tied", "qwen3", "qwen3_moe", "qwen3_moe_step2"]
# NOTE: 1..40 tokens; 40 > every chunked_prefill_size below, and prompt + output crosses the llama3 rope's
# original_max_position_embeddings (64) and several 16-token pages.
PROMPT_LENS = [1, 40, 3, 17, 8, 33, 2, 25]
PROMPTS = random_prompts(PROMPT_LENS, seed=1)
MAX_NEW = 32
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.mark.parametrize("chunked_prefill_size", [7, 16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf(tiny, make_engine, kind: str, page_size: int, chunked_prefill_size: int) -> None:
    ckpt = tiny(kind)
    engine = make_engine(ckpt.path, page_size=page_size, chunked_prefill_size=chunked_prefill_size)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        assert out["output_ids"] == hf_greedy(ckpt.model, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["meta_info"]["completion_tokens"] == MAX_NEW


def test_single_prompt_and_no_chunking(tiny, make_engine) -> None:
    ckpt = tiny("llama")
    engine = make_engine(ckpt.path, page_size=4, chunked_prefill_size=-1)
    out = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    assert isinstance(out, dict)
    assert out["output_ids"] == hf_greedy(ckpt.model, PROMPTS[1], MAX_NEW)


def _checkpoint_with_eos(src: Path, dst: Path, eos: int) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["eos_token_id"] = eos
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_eos_honoured_matches_hf(tiny, make_engine, tmp_path: Path, kind: str) -> None:
    ckpt = tiny(kind)
    refs = [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]
    # An eos the model actually emits (not as its first token), so some requests stop early and some may not.
    counts = Counter(t for ref in refs for t in set(ref[1:]))
    eos = counts.most_common(1)[0][0]
    engine = make_engine(_checkpoint_with_eos(ckpt.path, tmp_path / "eos", eos), page_size=16, chunked_prefill_size=16)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    stopped = 0
    for prompt, out in zip(PROMPTS, outputs):
        ref = hf_greedy(ckpt.model, prompt, MAX_NEW, eos=eos)
        assert out["output_ids"] == ref
        if len(ref) < MAX_NEW:
            expected = {"type": "stop", "matched": eos}
            stopped += 1
        else:  # NOTE: as in SGLang, reaching max_new_tokens wins over an eos on the last token
            expected = {"type": "length", "length": MAX_NEW}
        assert out["meta_info"]["finish_reason"] == expected
    assert stopped >= 2


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_sharded_checkpoint(tiny, make_engine, kind: str) -> None:
    ckpt = tiny(kind, "sharded")
    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (ckpt.path / "model.safetensors").exists()
    engine = make_engine(ckpt.path, page_size=16, chunked_prefill_size=16)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == [hf_greedy(ckpt.model, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_runs(tiny, make_engine, kind: str) -> None:
    ckpt = tiny(kind)
    engine = make_engine(ckpt.path, dtype="bfloat16", page_size=16, chunked_prefill_size=16)
    assert engine.get_server_info()["dtype"] == "bfloat16"
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for out in outputs:
        assert len(out["output_ids"]) == MAX_NEW
        assert all(0 <= t < VOCAB for t in out["output_ids"])
    # Sanity, not equality: the lm_head is sharp, so bf16 rounding rarely flips the first argmax.
    first_equal = sum(o["output_ids"][0] == hf_greedy(ckpt.model, p, MAX_NEW)[0] for o, p in zip(outputs, PROMPTS))
    assert first_equal >= len(PROMPTS) // 2


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fused_rope_kv_store_matches_hf(tiny, make_engine, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The CUDA path's one-launch [q/k norm +] rope + K/V store (Triton interpreter on CPU) stays HF-exact."""
    pytest.importorskip("triton")
    import blockspec.layers.rotary as rotary

    monkeypatch.setattr(rotary, "use_triton", lambda x: True)
    ckpt = tiny(kind)
    engine = make_engine(ckpt.path, page_size=16, chunked_prefill_size=16)
    prompts, max_new = PROMPTS[:4], 12
    outputs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
    for prompt, out in zip(prompts, outputs):
        assert out["output_ids"] == hf_greedy(ckpt.model, prompt, max_new), f"prompt of {len(prompt)} tokens"
