"""--enable-deterministic-inference on the GPU, bf16 (the interpreter cannot check bf16 nor the compiled kernels):
the batch-invariant GEMM and attention at Llama-8B head shapes, then whole engines with full CUDA graphs and piecewise
graphs: the target's logits of the same tokens bit-identical as target-only decode steps, an extend chunk and DFlash
verify rows at batch sizes 3 and 1, greedy DFlash output equal to target-only output at batch sizes 3, 2 and 1, no
Triton compile after start-up. Shapes: the trained tiny pair, and Llama-3.1-8B layer shapes (2 layers, dummy weights,
a 1-layer dummy draft) with contexts spanning several KV lanes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from blockspec import Engine  # noqa: E402
from blockspec.attention.batch_invariant_backend import BatchInvariantAttention  # noqa: E402
from blockspec.batch import ForwardMode  # noqa: E402
from blockspec.layers.batch_invariant_matmul import batch_invariant_linear  # noqa: E402
from tests.support.determinism_checks import logits_by_path, mismatched_rows  # noqa: E402

GRAPHS = dict(dtype="bfloat16", enable_deterministic_inference=True, enforce_piecewise_cuda_graph=True,
              piecewise_cuda_graph_max_tokens=2048, cuda_graph_bs=[1, 2, 4], max_running_requests=4,
              skip_tokenizer_init=True)
LLAMA_8B_LAYERS = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=128009,
    rope_theta=500000.0,
)
DRAFT_8B = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-6, max_position_embeddings=8192, rope_theta=500000.0, block_size=10, num_target_layers=2,
    dflash_config={"mask_token_id": 128002, "target_layer_ids": [0, 1]},
)


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 128256), (14336, 4096)])
def test_matmul_rows_do_not_depend_on_m(k: int, n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(300, k, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    full = batch_invariant_linear(x, weight)
    for m in (1, 3, 16, 37, 64, 129):
        assert torch.equal(batch_invariant_linear(x[:m], weight), full[:m]), m
    torch.testing.assert_close(full.float(), (x.float() @ weight.float().T), atol=0.05, rtol=0.02)


def test_attention_rows_at_8b_head_shapes() -> None:
    from tests.support.batch_invariant_rows import (
        Sequences,
        backend_for,
        mismatches,
        paths_of_one_position,
    )

    seqs = Sequences([1300, 60, 50], torch.bfloat16, page_size=16, heads=(32, 8, 128))
    backend = backend_for(seqs, settings=BatchInvariantAttention())
    reference, others = paths_of_one_position(seqs, backend, position=1100, block=10)
    assert mismatches(reference, *others) == 0
    parts = [(0, 1090, 10), (1, 30, 10), (2, 25, 10)]
    split = seqs.attend(backend, ForwardMode.VERIFY, parts, split_lanes=True)
    assert mismatches(split, seqs.attend(backend, ForwardMode.VERIFY, parts, split_lanes=False)) == 0


def engines(target: Path, draft: Path, **flags: Any) -> tuple[Engine, Engine]:
    return (Engine(model_path=str(target), **{**GRAPHS, **flags}),
            # NOTE: the full block every cycle: adaptive verify may pick plain decode steps for a host-bound tiny
            # model on the GPU, and the acceptance check below is of the draft (test_gpu_adaptive.py: the default)
            Engine(model_path=str(target), speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                   speculative_adaptive_verify="off", **{**GRAPHS, **flags}))


def check_engines(target_only: Engine, dflash: Engine, prompts: list[list[int]], block: int, vocab: int,
                  new_tokens: int) -> None:
    paths = logits_by_path(target_only, dflash, prompts, block, vocab)
    assert mismatched_rows(paths) == {"extend": 0, "verify": 0, "verify_bs1": 0}
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    expected = [o["output_ids"] for o in target_only.generate(input_ids=prompts, sampling_params=greedy)]
    assert [o["output_ids"] for o in dflash.generate(input_ids=prompts, sampling_params=greedy)] == expected
    pair = [o["output_ids"] for o in dflash.generate(input_ids=prompts[:2], sampling_params=greedy)]
    alone = dflash.generate(input_ids=prompts[2], sampling_params=greedy)["output_ids"]
    assert pair + [alone] == expected
    for engine in (target_only, dflash):
        counts = engine.get_server_info()["internal_states"][0]["forward_counts"]
        assert counts["graph"] > 0 and counts["piecewise"] > 0, counts
        assert engine.kernel_compiles_after_startup == 0, engine.kernel_compiles_after_startup_by_kernel


def test_trained_pair_bf16(trained_pair: dict) -> None:
    # NOTE: two engines live at once: each sizes its KV pool by max_total_tokens, not by mem_fraction_static (the
    # first would take that fraction of the whole device and leave the second none)
    target_only, dflash = engines(trained_pair["root"] / "target", trained_pair["root"] / "draft",
                                  triton_attention_split_tile_size=32, page_size=4, max_total_tokens=16384)
    prompts = [[5 + i for i in range(n)] for n in (3, 14, 37)]
    check_engines(target_only, dflash, prompts, 8, 96, 32)
    assert dflash.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1.5


def test_llama_8b_layer_shapes_bf16(tmp_path: Path) -> None:
    for name, config in (("target", LLAMA_8B_LAYERS), ("draft", DRAFT_8B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    target_only, dflash = engines(tmp_path / "target", tmp_path / "draft", load_format="dummy", page_size=16,
                                  max_total_tokens=16384)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 120000, (n,), generator=generator).tolist() for n in (700, 90, 1500)]
    check_engines(target_only, dflash, prompts, 10, 128256, 24)
