"""Programmatic dependent launch: off where it cannot work; every engine kernel (the fused MoE layer's too) compiled
for sm90 with PDL waits for the previous grid before its first global memory access (checked in the PTX, no GPU
needed), but for the MoE down projection's L2 prefetch, which reads one expert id and asks L2 for weights before it
waits; and on the GPU graphs of PDL-launched kernels give bit-identical results to plain launches on fresh inputs
every replay."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.layers import triton_ops  # noqa: E402
from blockspec.pdl import pdl_enabled, pdl_launch  # noqa: E402

MEMORY_OPS = ("ld.global", "st.global", "atom.global", "red.global", "cp.async")
BF16, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
PAGED_ATTENTION_TYPES = {
    "q_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16, "out_ptr": BF16, "part_acc_ptr": F32,
    "part_max_ptr": F32, "part_sum_ptr": F32, "req_to_token_ptr": I32, "req_rows_ptr": I64, "q_starts_ptr": I32,
    "q_lens_ptr": I32, "seq_lens_ptr": I32, "tree_mask_ptr": "*u8", "qk_scale_log2": "fp32",
}
PAGED_ATTENTION_CONSTEXPRS = {
    "NUM_KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 64, "BLOCK_N": 64, "NUM_SPLITS": 2,
    "CAUSAL": True, "USE_WINDOW": False, "DOT_PRECISION": "tf32", "MASK_EDGES_ONLY": True,
}
# NOTE: per kernel: (module, name, pointer and float argument types (others are i32), constexpr values). Every
# constexpr parameter must be given (one left out would compile as an i32 argument).
KERNEL_SPECS = {
    "rmsnorm": ("blockspec.layers.triton_ops", "_rmsnorm_kernel",
                {"x_ptr": BF16, "residual_ptr": BF16, "weight_ptr": BF16, "out_ptr": BF16, "eps": "fp32"},
                {"HAS_RESIDUAL": True, "BLOCK": 4096}),
    "rope_store": ("blockspec.layers.triton_ops", "_rope_store_kernel",
                   {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "positions_ptr": I64, "cos_ptr": F32,
                    "sin_ptr": F32, "q_norm_ptr": BF16, "k_norm_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16,
                    "slots_ptr": I64, "eps": "fp32"},
                   {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "HAS_Q": True, "QK_NORM": True, "STORE": True}),
    "silu_mul": ("blockspec.layers.triton_ops", "_silu_mul_kernel", {"gate_up_ptr": BF16, "out_ptr": BF16},
                 {"BLOCK": 1024}),
    "chunk_argmax": ("blockspec.layers.triton_ops", "_chunk_argmax_kernel",
                     {"x_ptr": BF16, "best_val_ptr": F32, "best_idx_ptr": I32}, {"BLOCK": 4096}),
    "pick_argmax": ("blockspec.layers.triton_ops", "_pick_argmax_kernel",
                    {"best_val_ptr": F32, "best_idx_ptr": I32, "out_ptr": I64}, {"BLOCK_CHUNKS": 32}),
    "paged_attention": ("blockspec.attention.triton_kernels", "paged_attention_kernel", PAGED_ATTENTION_TYPES,
                        {**PAGED_ATTENTION_CONSTEXPRS, "TREE": False}),
    "paged_attention_tree": ("blockspec.attention.triton_kernels", "paged_attention_kernel", PAGED_ATTENTION_TYPES,
                             {**PAGED_ATTENTION_CONSTEXPRS, "TREE": True}),  # DDTree's tree-masked verify
    "merge_splits": ("blockspec.attention.triton_kernels", "merge_splits_kernel",
                     {"out_ptr": BF16, "part_acc_ptr": F32, "part_max_ptr": F32, "part_sum_ptr": F32},
                     {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 4, "BLOCK_H": 8}),
    "tiled_extend_split": ("blockspec.attention.triton_kernels", "tiled_extend_attention_kernel",
                           {"q_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16, "out_ptr": BF16,
                            "part_acc_ptr": F32, "part_max_ptr": F32, "part_sum_ptr": F32, "req_to_token_ptr": I64,
                            "req_rows_ptr": I64, "q_starts_ptr": I64, "q_lens_ptr": I64, "seq_lens_ptr": I64,
                            "tile_req_ptr": I64, "tile_m_ptr": I64, "tile_count_ptr": I64, "qk_scale_log2": "fp32"},
                           {"GROUP": 3, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_M": 64, "BLOCK_N": 32, "NUM_SPLITS": 8,
                            "MIN_SPLIT_KEYS": 256, "CAUSAL": True, "USE_WINDOW": False, "DOT_PRECISION": "tf32",
                            "MASK_EDGES_ONLY": True}),
    "merge_real_rows": ("blockspec.attention.triton_kernels", "merge_real_rows_kernel",
                        {"out_ptr": BF16, "part_acc_ptr": F32, "part_max_ptr": F32, "part_sum_ptr": F32,
                         "token_count_ptr": I64},
                        {"HEAD_DIM": 64, "BLOCK_D": 64, "NUM_SPLITS": 8, "BLOCK_H": 8}),
    # NOTE: the fused MoE layer (Qwen3-30B-A3B's routing: 128 experts, top 8)
    "moe_route": ("blockspec.layers.fused_moe", "_route_kernel", {"logits_ptr": BF16, "weights_ptr": F32,
                                                                  "ids_ptr": I64},
                  {"TOP_K": 8, "BLOCK_E": 128, "BLOCK_K": 8, "RENORMALIZE": True}),
    # NOTE: the fused router (Qwen3-30B-A3B's: hidden 2048, 128 experts, top 8; bf16 logits, so the bf16 rounding
    # compiles too): logits, the arrival atomic (acquire/release) and the last program's routing
    "moe_router": ("blockspec.layers.fused_router", "_router_kernel",
                   {"x_ptr": BF16, "w_ptr": BF16, "logits_ptr": BF16, "counters_ptr": I32, "weights_ptr": F32,
                    "ids_ptr": I64},
                   {"TOP_K": 8, "EXPERTS_PER_PROGRAM": 4, "BLOCK_H": 2048, "BLOCK_E": 128, "BLOCK_K": 8,
                    "RENORMALIZE": True}),
    "moe_count": ("blockspec.layers.fused_moe", "_count_experts_kernel",
                  {"ids_ptr": I64, "next_row_ptr": I32, "block_experts_ptr": I32, "pair_rows_ptr": I32},
                  {"NUM_EXPERTS": 128, "BLOCK_E": 128, "BLOCK_M": 16, "CHUNK": 128, "FILL_CHUNK": 4096}),
    "moe_place": ("blockspec.layers.fused_moe", "_place_pairs_kernel",
                  {"ids_ptr": I64, "next_row_ptr": I32, "pair_rows_ptr": I32}, {"CHUNK": 128}),
    "moe_gate_up": ("blockspec.layers.fused_moe", "_gate_up_kernel",
                    {"x_ptr": BF16, "w_ptr": BF16, "pair_rows_ptr": I32, "block_experts_ptr": I32, "out_ptr": BF16},
                    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_PRECISION": "tf32", "DIRECT": False,
                     "WEIGHT_EVICTION": ""}),
    "moe_gate_up_direct": ("blockspec.layers.fused_moe", "_gate_up_kernel",
                           {"x_ptr": BF16, "w_ptr": BF16, "pair_rows_ptr": I64, "block_experts_ptr": I64,
                            "out_ptr": BF16},
                           {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_PRECISION": "tf32", "DIRECT": True,
                            "WEIGHT_EVICTION": "evict_first"}),  # NOTE: as beside the down weights' prefetch
    "moe_down": ("blockspec.layers.fused_moe", "_down_kernel",
                 {"h_ptr": BF16, "w_ptr": BF16, "routing_ptr": F32, "pair_rows_ptr": I32, "block_experts_ptr": I32,
                  "out_ptr": F32},
                 {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_PRECISION": "tf32", "DIRECT": False,
                  "PREFETCH": False, "LINE_ELEMENTS": 64, "LANES": 256}),
    # NOTE: direct tiles' down projection with the L2 prefetch of its weight slab before the wait (prefetch_down)
    "moe_down_prefetch": ("blockspec.layers.fused_moe", "_down_kernel",
                          {"h_ptr": BF16, "w_ptr": BF16, "routing_ptr": F32, "pair_rows_ptr": I64,
                           "block_experts_ptr": I64, "out_ptr": BF16},
                          {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_PRECISION": "tf32", "DIRECT": True,
                           "PREFETCH": True, "LINE_ELEMENTS": 64, "LANES": 256}),
    "moe_down_direct": ("blockspec.layers.fused_moe", "_down_direct_kernel",
                        {"h_ptr": BF16, "w_ptr": BF16, "routing_ptr": F32, "ids_ptr": I64, "out_ptr": BF16},
                        {"BLOCK_S": 8, "BLOCK_N": 16, "BLOCK_K": 64}),
    "moe_combine": ("blockspec.layers.fused_moe", "_combine_kernel", {"pair_out_ptr": F32, "out_ptr": BF16},
                    {"BLOCK_H": 1024}),
    # NOTE: DDTree's tree build at a budget of 64 over 15 depths (the demo draft's block of 16)
    "tree_build": ("blockspec.speculative.tree_build_kernel", "_tree_build_kernel",
                   {"scores_ptr": F32, "tokens_ptr": I64, "pairs_ptr": I32, "cand_scores_ptr": F32,
                    "cand_slots_ptr": I32, "cand_parents_ptr": I32, "rank_ptr": I32, "out_tokens_ptr": I64,
                    "out_parents_ptr": I64, "out_depths_ptr": I64, "out_ancestors_ptr": "*i8"},
                   {"BLOCK_B": 64, "BLOCK_L": 16, "BLOCK_P": 512, "BLOCK_C": 1024, "BLOCK_R": 128,
                    "ROWS": 16}),
    # NOTE: DDTree's vocabulary top-B at a budget of 128 (K 128) over bf16 logits: chunks' groups, then the merge
    "top_candidates_groups": ("blockspec.speculative.top_candidates_kernel", "_chunk_groups_kernel",
                              {"logits_ptr": BF16, "group_keys_ptr": I64, "chunk_max_ptr": F32, "chunk_sum_ptr": F32,
                               "multiplier": "fp32", "softcap": "fp32"},
                              {"CHUNK": 4096, "GROUP": 16, "K": 128, "SPAN": 2 ** 31, "SCALED": True, "SOFTCAP": True}),
    "top_candidates_merge": ("blockspec.speculative.top_candidates_kernel", "_merge_top_kernel",
                             {"logits_ptr": BF16, "group_keys_ptr": I64, "chunk_max_ptr": F32, "chunk_sum_ptr": F32,
                              "scores_ptr": F32, "tokens_ptr": I64, "multiplier": "fp32", "softcap": "fp32"},
                             {"BLOCK_CHUNKS": 32, "GROUP": 16, "K": 128, "SPAN": 2 ** 31, "SCALED": True,
                              "SOFTCAP": True}),
    # NOTE: DDTree's compaction over every layer's K and V (a request's 16 moves, rows of 8 heads x 128)
    "kv_move": ("blockspec.kv.move_kernel", "_move_groups_kernel",
                {"k_ptr": BF16, "v_ptr": BF16, "sources_ptr": I64, "destinations_ptr": I64, "layer_stride": "i64"},
                {"BLOCK_P": 16, "BLOCK_C": 256}),
    "tree_walk": ("blockspec.speculative.tree_walk_kernel", "_tree_walk_kernel",
                  {"target_ptr": I64, "tokens_ptr": I64, "parents_ptr": I64, "depths_ptr": I64,
                   "ancestors_ptr": "*i8", "accepted_ptr": I64, "path_ptr": I64, "row_tokens_ptr": I64,
                   "slots_ptr": I64, "rows_ptr": I64, "walked_ptr": I64, "sources_ptr": I64},
                  {"BLOCK_R": 128, "BLOCK_D": 16, "ROWS": 16, "OUTPUTS": True}),
}
# NOTE: the memory instructions a kernel may run before its wait (every other kernel: none): the prefetch reads its
# expert id, written by the grid before the previous one, and asks L2 for the weights (a hint)
BEFORE_WAIT = {"moe_down_prefetch": ["ld.global.b64", "prefetch.global.L2::evict_last"]}


def ptx_positions(name: str) -> dict[str, Any]:
    """Compiles one engine kernel for sm90 with PDL on (CPU only; Triton must not be in interpreter mode) and returns
    where in its PTX the wait, the trigger and the first global memory access after the wait are, and the memory
    instructions before the wait (sorted, each once)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, attr, types, constexprs = KERNEL_SPECS[name]
    kernel = getattr(importlib.import_module(module), attr)
    constexprs = {**constexprs, "PDL": True}
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"launch_pdl": True})
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first_memory_op = min((ptx.find(op, wait) for op in MEMORY_OPS if op in ptx[wait:]), default=-1)
    before_wait = sorted({token for line in ptx[:max(wait, 0)].splitlines() for token in line.split()
                          if token.startswith(MEMORY_OPS + ("prefetch",))})
    return {"wait": wait, "trigger": ptx.find("griddepcontrol.launch_dependents"), "first_memory_op": first_memory_op,
            "before_wait": before_wait, "launch_pdl": int(compiled.metadata.launch_pdl)}


def test_pdl_is_off_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert not pdl_enabled(cpu)
    assert pdl_launch(torch.zeros(1)) == {}


def test_pdl_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The env switch alone decides on a capable GPU (faked here, so the test also runs on CPU)."""
    import triton

    from blockspec import pdl

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(pdl, "_device_supports_pdl", lambda index: True)
    monkeypatch.delenv("BLOCKSPEC_PDL", raising=False)
    assert pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("BLOCKSPEC_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))


def test_every_engine_kernel_waits_before_touching_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, *KERNEL_SPECS], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    positions = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(positions) == set(KERNEL_SPECS)
    for name, where in positions.items():
        assert where["launch_pdl"] == 1, name
        assert 0 <= where["wait"] < where["trigger"] < where["first_memory_op"], (name, where)
        assert where["before_wait"] == BEFORE_WAIT.get(name, []), (name, where)


def _layer_chain(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    for _ in range(layers):
        h = triton_ops.rmsnorm(x, norm_w, 1e-5, residual=residual)
        gate_up = h @ up.t()
        x = triton_ops.silu_mul(gate_up) @ down.t()
    logits = triton_ops.rmsnorm(x, norm_w, 1e-5, residual=residual) @ up.t()
    return triton_ops.argmax_rows(logits), residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with PDL (sm90+)")
@pytest.mark.parametrize("rows", [1, 10, 320])
def test_graph_of_pdl_kernels_matches_plain_launches(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inter, replays = 1024, 2048, 4

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) / shape[-1] ** 0.5

    w, up, down = 1 + randn(hidden), randn(2 * inter, hidden), randn(hidden, inter)
    # NOTE: fresh inputs every replay, so a kernel that read its predecessor's buffer early would see last replay's.
    inputs = [(randn(rows, hidden), randn(rows, hidden)) for _ in range(replays)]

    def run_graph() -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, residual = inputs[0][0].clone(), inputs[0][1].clone()
        _layer_chain(x, residual.clone(), w, up, down, 1)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens, out_residual = _layer_chain(x, residual, w, up, down, 24)
        results = []
        for x_i, residual_i in inputs:
            x.copy_(x_i)
            residual.copy_(residual_i)
            graph.replay()
            results.append((tokens.clone(), out_residual.clone()))
        torch.cuda.synchronize()
        return results

    monkeypatch.setenv("BLOCKSPEC_PDL", "1")
    assert pdl_launch(inputs[0][0]) == {"PDL": True, "launch_pdl": True}
    with_pdl = run_graph()
    monkeypatch.setenv("BLOCKSPEC_PDL", "0")
    plain = run_graph()
    for (tokens_pdl, residual_pdl), (tokens_plain, residual_plain) in zip(with_pdl, plain):
        assert torch.equal(tokens_pdl, tokens_plain)
        assert torch.equal(residual_pdl, residual_plain)
    assert not torch.equal(with_pdl[0][1], with_pdl[1][1])  # the inputs did change between replays


if __name__ == "__main__":  # NOTE: run by the PTX test above in a process without the Triton interpreter
    print(json.dumps({name: ptx_positions(name) for name in sys.argv[1:]}))
