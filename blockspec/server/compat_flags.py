"""SGLang flags a DFlash user passes that blockspec has no setting of its own for: each maps onto a blockspec setting,
is a documented no-op, or is refused with a clear error when its value means something DFlash does not do."""
from __future__ import annotations

import argparse
from typing import Any

from blockspec.config.engine_config import DEFAULT_CUDA_GRAPH_BS

COMPAT_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--cuda-graph-max-bs", dict(type=int, help="capture CUDA graphs for the default batch sizes up to this one "
                                                "(ignored when --cuda-graph-bs lists them); default: all of them")),
    ("--enable-metrics", dict(action="store_true", help="accepted: Prometheus /metrics is always on")),
    ("--speculative-num-steps", dict(type=int, help="DFlash drafts a whole block in one forward: only 1 is valid "
                                                    "(default: unset)")),
    ("--speculative-eagle-topk", dict(type=int, help="DFlash verifies one chain, not a tree: only 1 is valid "
                                                     "(default: unset)")),
    ("--kv-cache-dtype", dict(default="auto", choices=("auto",), help="auto only: the KV cache is in the model dtype "
                                                                      "(default auto)")),
    ("--max-prefill-tokens", dict(type=int, help="prefill tokens per step; one budget here with "
                                                 "--chunked-prefill-size, the smaller wins (default: unset)")),
    ("--enable-piecewise-cuda-graph", dict(action="store_true",
                                           help="= --enforce-piecewise-cuda-graph (deprecated in SGLang, where "
                                                "piecewise graphs are the default)")),
    ("--log-requests", dict(action="store_true", help="one access log line per request: raises --log-level to info")),
    ("--dp-size", dict(type=int, help="data-parallel replicas: only 1 (default: unset)")),
    ("--schedule-policy", dict(help="fcfs only: waiting requests are admitted in arrival order (default: unset)")),
    ("--reasoning-parser", dict(help="refused: replies are not split into reasoning_content (default: unset)")),
    ("--quantization", dict(help="refused: weights load in --dtype from 16/32-bit safetensors (default: unset)")),
    ("--revision", dict(help="refused: a hub id loads its default branch; download a revision, pass its directory "
                             "(default: unset)")),
    ("--download-dir", dict(help="refused: hub ids go to the Hugging Face cache; set HF_HUB_CACHE (default: unset)")),
    ("--enable-torch-compile", dict(action="store_true", help="refused: decode, verify and draft run in CUDA graphs, "
                                                              "without torch.compile")),
    ("--watchdog-timeout", dict(type=float, help="refused: there is no forward watchdog (default: unset)")),
]
# NOTE: SGLang flags for things blockspec does another way: passing one is an error that says that way
REFUSED = {
    "reasoning_parser": "blockspec does not split a reply into reasoning_content: a reasoning model's thinking "
                        "(Qwen3's <think>...</think>) stays in message.content; drop the flag",
    "quantization": "blockspec loads 16/32-bit safetensors weights in --dtype (bfloat16 on CUDA) and has no quantized "
                    "kernels; pass an unquantized checkpoint and drop the flag",
    "revision": "blockspec loads a hub id's default branch; download the revision first (`hf download ORG/NAME "
                "--revision REV`) and pass its directory to --model-path",
    "download_dir": "blockspec fetches hub ids into the Hugging Face cache; set HF_HUB_CACHE=DIR for another folder, "
                    "or pass a local directory to --model-path",
    "enable_torch_compile": "blockspec runs decode, verify and the draft in full CUDA graphs (and prefill in piecewise "
                            "graphs with --enforce-piecewise-cuda-graph), not torch.compile; drop the flag",
    "watchdog_timeout": "blockspec has no forward watchdog: if the engine process dies the server exits with status 1; "
                        "drop the flag",
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang compatibility")
    for flag, kwargs in COMPAT_FLAGS:
        group.add_argument(flag, **kwargs)


def apply_compat_flags(values: dict[str, Any], engine: dict[str, Any], parser: argparse.ArgumentParser) -> list[str]:
    """Folds the compatibility flags in `values` into the EngineConfig keywords `engine` and the server's `values`
    (parser.error when invalid); returns notes for the console on what the accepted ones do here."""
    notes: list[str] = []
    for name, reason in REFUSED.items():
        if values[name] not in (None, False):
            parser.error(f"{_flag(name)}: {reason}")
    if values["dp_size"] is not None and values["dp_size"] != 1:
        parser.error(f"--dp-size {values['dp_size']}: blockspec runs one engine per server; for replicas run one "
                     "server per GPU behind a load balancer (--tp-size splits one model over GPUs, --api-server-count "
                     "adds HTTP processes)")
    policy = values["schedule_policy"]
    if policy is not None and policy.lower() != "fcfs":
        parser.error(f"--schedule-policy {policy}: blockspec admits waiting requests first come, first served (the "
                     "radix cache still reuses shared prefixes); only fcfs is valid")
    if values["enable_piecewise_cuda_graph"]:
        engine["enforce_piecewise_cuda_graph"] = True
        notes.append("--enable-piecewise-cuda-graph: prefill/extend run in piecewise CUDA graphs on a GPU, as they do "
                     "by default for Llama and Qwen3 targets (here the same as --enforce-piecewise-cuda-graph; SGLang "
                     "deprecated the flag because it captures them by default)")
    if values["log_requests"] and values["log_level"] not in ("debug", "info"):
        values["log_level"] = "info"
        notes.append("--log-requests: one access log line per request (the server logs at info)")
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk"):
        value = values[_dest(flag)]
        if value is not None and value != 1:
            parser.error(f"{flag} {value}: DFlash proposes one block of --speculative-num-draft-tokens tokens in one "
                         f"draft forward and verifies it as one chain; {flag} can only be 1 (or left out)")
    max_bs = values["cuda_graph_max_bs"]
    if max_bs is not None:
        if max_bs < 1:
            parser.error(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
        if "cuda_graph_bs" not in engine:
            engine["cuda_graph_bs"] = [b for b in DEFAULT_CUDA_GRAPH_BS if b <= max_bs] or [max_bs]
    max_prefill = values["max_prefill_tokens"]
    if max_prefill is not None:
        if max_prefill < 1:
            parser.error(f"--max-prefill-tokens must be >= 1, got {max_prefill}")
        chunk = engine.get("chunked_prefill_size")
        engine["chunked_prefill_size"] = max_prefill if chunk is None or chunk < 0 else min(chunk, max_prefill)
    return notes
