"""The command-line face of each EngineConfig field: its help text and what argparse needs beyond the field's type and
default. server/args.py builds the `blockspec serve` engine flags from EngineConfig's fields and this table (a field's
flag is `--` and its name with dashes; a bool field is a switch; a list field takes several values); the field's
default is the flag's default, so `%(default)s` in a help text names it. `log_level` is the server's `--log-level`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from blockspec.config.engine_config import ATTENTION_BACKENDS, DEFAULT_TREE_BUDGET, WAIT_POLICIES


@dataclass(frozen=True)
class Flag:
    help: str
    choices: Optional[tuple[str, ...]] = None
    fold_case: Optional[Callable[[str], str]] = None  # applied to the value before the choices are checked
    required: bool = False
    # NOTE: the flag's default is None instead of the field's: EngineConfig's default applies (a list), or the CLI
    # derives one from other flags (server/args.py)
    unset_by_default: bool = False


ENGINE_FLAGS: dict[str, Flag] = {
    "model_path": Flag("HF checkpoint directory of the target model, or a hub id org/name", required=True),
    "tokenizer_path": Flag("tokenizer directory (default: the model path)"),
    "skip_tokenizer_init": Flag("serve input_ids only, no tokenizer"),
    "trust_remote_code": Flag("accepted for SGLang compatibility"),
    "device": Flag("auto, cpu, cuda or cuda:N"),
    "dtype": Flag("auto: bfloat16 on CUDA, float32 on CPU; half = float16 (default %(default)s)",
                  choices=("auto", "float32", "bfloat16", "float16", "half")),
    "attention_backend": Flag("auto: Triton on CUDA, torch on CPU (default %(default)s)", choices=ATTENTION_BACKENDS),
    "page_size": Flag("tokens per KV page (default %(default)s)"),
    "max_running_requests": Flag("requests decoding at once (default %(default)s)"),
    "max_total_tokens": Flag("KV pool size in tokens (default: from --mem-fraction-static)"),
    "chunked_prefill_size": Flag("-1 disables chunked prefill"),
    "max_prefill_wait_steps": Flag(
        "while requests decode, new arrivals wait up to N decode steps to be prefilled together in one extend step "
        "(default: 1 with --speculative-algorithm, else 0: at once)", unset_by_default=True),
    "prefill_wait_policy": Flag(
        "fixed: held arrivals wait the N steps of --max-prefill-wait-steps; cost: N at most, released once holding "
        "them has cost as much as an extend step (default %(default)s)", choices=WAIT_POLICIES),
    "stream_interval": Flag("a streaming request gets a chunk once this many new tokens are ready, and its last one "
                            "always (default %(default)s: every step's tokens)"),
    "context_length": Flag("prompt + output limit (default: the model's max_position_embeddings)"),
    "mem_fraction_static": Flag("GPU memory share for weights + KV pool (default %(default)s)"),
    "random_seed": Flag("seed for dummy weights and simulated acceptance (default %(default)s)"),
    "host_threads": Flag("torch threads for the engine's host-side tensor work (default: 1 on a GPU, torch's "
                         "default on CPU)"),
    "cuda_graph_bs": Flag("batch sizes captured as CUDA graphs", unset_by_default=True),
    "disable_cuda_graph": Flag("run decode / verify / draft eagerly (default: graphs on CUDA)"),
    "disable_overlap_schedule": Flag("greedy decode: commit each step before launching the next"),
    "disable_radix_cache": Flag("no prefix sharing: every prompt is prefilled in full"),
    "enable_mixed_chunk": Flag("one forward carries prefill chunks with the running decode/verify"),
    "enforce_piecewise_cuda_graph": Flag("piecewise CUDA graphs for prefill/extend also where they are not on by "
                                         "default (on by default on CUDA for Llama and Qwen3 targets)"),
    "disable_piecewise_cuda_graph": Flag("run prefill/extend eagerly: no piecewise CUDA graphs, whatever else asks "
                                         "for them"),
    "piecewise_eager_attention": Flag(
        "run attention eagerly between the piecewise graphs (default with Triton attention: each token bucket's "
        "whole extend forward, attentions included, is one graph)"),
    "piecewise_attention_max_splits": Flag(
        "Triton attention inside the piecewise graphs splits each program's keys up to N ways (a power of two <= 16) "
        "in token buckets too small to fill the GPU (cache-hit extends: few new tokens behind long cached prefixes); "
        "1: never"),
    "piecewise_cuda_graph_max_tokens": Flag("largest piecewise-graph token bucket (default: the "
                                            "--chunked-prefill-size, at most 8192)"),
    "piecewise_cuda_graph_tokens": Flag("explicit token buckets for piecewise graphs"),
    "cuda_graph_backend_prefill": Flag("piecewise = --enforce-piecewise-cuda-graph", choices=("piecewise", "none")),
    "tp_size": Flag("tensor-parallel ranks (one process and GPU each; default %(default)s)"),
    "speculative_algorithm": Flag(
        "DFLASH, or DDTREE: DFLASH verifying a draft tree (--speculative-tree-budget, default "
        f"{DEFAULT_TREE_BUDGET} nodes) (default: none, target only)", choices=("DFLASH", "DDTREE"),
        fold_case=str.upper),
    "speculative_draft_model_path": Flag("z-lab format DFlash draft directory or hub id (default: none)"),
    "speculative_num_draft_tokens": Flag("block size (default: the draft's block_size)"),
    "speculative_simulate_accept_len": Flag("benchmarking only: force the accept length"),
    "speculative_simulate_accept_profile": Flag(
        "benchmarking only: draw each verify's accept length from geometric:MEAN or an accept-length histogram JSON "
        "(the /server_info layout)"),
    "speculative_simulate_tree_accept_len": Flag(
        "benchmarking DDTree only: force a tree cycle's accept length (with the chain's simulated acceptance)"),
    "speculative_simulate_tree_accept_profile": Flag(
        "benchmarking DDTree only: draw a tree cycle's accept length from geometric:MEAN or a histogram JSON"),
    "speculative_adaptive_verify": Flag(
        "verify length per batch size from measured cycle times and live acceptance (default: on when the DFlash "
        "cycle runs in CUDA graphs; on without graphs times eager cycles)", choices=("on", "off"), fold_case=str.lower),
    "speculative_tree_budget": Flag(
        "DDTree: each cycle verifies a tree of B draft nodes, the B most likely prefixes of the draft block's "
        "per-position distributions, in one target forward; 0: the chain (default)"),
    "speculative_num_draft_tokens_per_bs": Flag(
        "fixed verify length per batch size instead, e.g. 1-16:10,17-64:4 (1 = plain target decode)"),
    "load_format": Flag("dummy: random weights (default %(default)s)", choices=("auto", "dummy")),
    "enable_deterministic_inference": Flag(
        "batch-invariant GEMM, attention and norms: a token's logits do not depend on the batch, so greedy DFlash "
        "output equals target-only output at any batch size (Triton attention, tp-size 1; costs step latency)"),
    "triton_attention_split_tile_size": Flag(
        "keys per KV split of the deterministic attention, a multiple of 32 (default 256)"),
    "chat_template": Flag(
        "replace the tokenizer's chat template: a shipped one by name (llama3: Llama-3.x with tools; chatml: ChatML "
        "with Hermes-style tools, for Qwen3, Qwen2.5 and SmolLM2) or a Jinja file (default: the tokenizer's own)"),
}
