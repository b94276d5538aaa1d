"""EngineConfig: every engine flag, named as in SGLang, validated once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from blockspec.config.chat_templates import chat_template_text
from blockspec.config.deterministic import resolve_deterministic_backend
from blockspec.config.speculative_flags import accept_distribution, check_schedule_covers, parse_verify_schedule

if TYPE_CHECKING:
    import torch

# NOTE: the target families whose piecewise graphs (extend, DFlash's aux capture inside them) the GPU suite has run
# (Qwen3-MoE since e7c3ed1 on the H100: the DFlash cycle lossless with them); a family added later captures them
# with --enforce-piecewise-cuda-graph until its GPU tests pass with them
PIECEWISE_BY_DEFAULT = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
SPECULATIVE_ALGORITHMS = (None, "DFLASH", "DDTREE")
# NOTE: SGLang's `--speculative-algorithm DDTREE` is DFLASH with a draft tree of this many nodes unless
# --speculative-tree-budget says otherwise (speculative/tree_build.py)
DEFAULT_TREE_BUDGET = 32
WAIT_POLICIES = ("fixed", "cost")  # --prefill-wait-policy (scheduler/admission.py)
DEFAULT_CUDA_GRAPH_BS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]


@dataclass
class EngineConfig:
    model_path: str
    tokenizer_path: Optional[str] = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    page_size: int = 1
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.85
    max_running_requests: int = 64
    chunked_prefill_size: int = 8192
    # NOTE: arrivals may wait up to this many decode steps to be prefilled together in one extend step
    # (scheduler/admission.py)
    max_prefill_wait_steps: int = 0
    # fixed: held arrivals go after N steps; cost: sooner, once holding cost an extend
    prefill_wait_policy: str = "fixed"
    # NOTE: a streaming request gets a chunk once at least this many new tokens are ready (and always its last one)
    stream_interval: int = 1
    context_length: Optional[int] = None
    random_seed: int = 0
    # NOTE: torch's intra-op threads for the engine's host-side tensor work (index arrays of a few thousand entries).
    # None: 1 on a GPU (an OpenMP pool spinning beside the HTTP servers and clients costs more than it saves), torch's
    # default on CPU, where the model itself runs on those threads.
    host_threads: Optional[int] = None
    log_level: str = "warning"
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_draft_tokens: Optional[int] = None
    cuda_graph_bs: list[int] = field(default_factory=lambda: list(DEFAULT_CUDA_GRAPH_BS))
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False  # greedy decode: launch step N+1 before committing step N on the host
    # one forward: prefill chunks + the running requests' decode tokens / verify blocks
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False  # the radix prefix cache (target + draft KV of shared prefixes) is on by default
    # NOTE: piecewise graphs are on by default on CUDA for the architectures in PIECEWISE_BY_DEFAULT (as SGLang
    # captures them by default where supported); this skips that condition. `piecewise_graphs_on` decides.
    enforce_piecewise_cuda_graph: bool = False
    # NOTE: wins over every reason to capture piecewise graphs (the flag that asks for them and the default on CUDA)
    disable_piecewise_cuda_graph: bool = False
    # NOTE: None: the chunked-prefill budget up to 8192 (`piecewise_max_tokens`), so the default's extend steps fit a
    # bucket: an extend the graphs cannot take runs eagerly, paying every kernel's host launch
    piecewise_cuda_graph_max_tokens: Optional[int] = None
    piecewise_cuda_graph_tokens: Optional[list[int]] = None  # explicit token buckets for piecewise graphs
    # NOTE: Triton attention: each bucket's whole extend forward, attentions included, is one graph (one replay,
    # not one per piece + an eager attention launch per layer); True keeps the attentions eager between the pieces
    piecewise_eager_attention: bool = False
    # NOTE: Triton attention inside the piecewise graphs splits each program's keys up to this many ways in buckets too
    # small to fill two waves of programs (GraphExtendAttention.splits_for: cache-hit extends, few new tokens behind
    # long prefixes); 1 never splits. The default is measured (docs/performance.md); buckets that fill two waves
    # stay unsplit, so it costs large prefills nothing
    piecewise_attention_max_splits: int = 4
    cuda_graph_backend_prefill: Optional[str] = None  # "piecewise" is an alias of enforce_piecewise_cuda_graph
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    speculative_simulate_accept_len: Optional[float] = None  # benchmarking only: forces the accept length
    speculative_simulate_accept_profile: Optional[str] = None  # benchmarking only: "geometric:M" or a histogram JSON
    # NOTE: benchmarking DDTree: a tree cycle's simulated acceptance (the chain's flags set the chain cycles')
    speculative_simulate_tree_accept_len: Optional[float] = None
    speculative_simulate_tree_accept_profile: Optional[str] = None
    speculative_adaptive_verify: Optional[str] = None  # on | off; unset: on when the DFlash cycle runs in CUDA graphs
    speculative_num_draft_tokens_per_bs: Optional[str] = None  # fixed verify lengths by batch size: "1-16:10,17-64:4"
    # NOTE: DDTree: verify a tree of this many draft nodes (the most likely prefixes of the draft's per-position
    # marginals) instead of the chain; 0 or None: the chain. Set to DEFAULT_TREE_BUDGET by speculative_algorithm DDTREE
    speculative_tree_budget: Optional[int] = None
    tp_size: int = 1  # tensor-parallel ranks, one process (and GPU) each; rank 0 schedules
    enable_deterministic_inference: bool = False  # batch-invariant kernels: a row's result never depends on the batch
    triton_attention_split_tile_size: Optional[int] = None  # keys per KV lane of the deterministic attention (256)
    # a shipped template's name (chat_templates.py) or a Jinja file replacing the tokenizer's own chat template
    chat_template: Optional[str] = None

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        if "model_path" not in kwargs:
            raise ValueError("model_path is required")
        return cls(**kwargs)

    def _validate(self) -> None:
        def positive(name: str, value: Optional[int]) -> None:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "skip_tokenizer_init",
            "trust_remote_code",
            "disable_cuda_graph",
            "disable_overlap_schedule",
            "enforce_piecewise_cuda_graph",
            "disable_piecewise_cuda_graph",
            "piecewise_eager_attention",
            "enable_mixed_chunk",
            "disable_radix_cache",
            "enable_deterministic_inference",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("device", "dtype", "attention_backend", "log_level", "load_format"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("speculative_simulate_accept_profile", "speculative_simulate_tree_accept_profile",
                     "speculative_adaptive_verify", "speculative_num_draft_tokens_per_bs"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("mem_fraction_static", "speculative_simulate_accept_len", "speculative_simulate_tree_accept_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in ("cuda_graph_bs", "piecewise_cuda_graph_tokens"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise ValueError(f"{name} must be a list of positive integers, got {value!r}")
        positive("host_threads", self.host_threads)
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}")

        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError("model_path must be a non-empty path")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        positive("page_size", self.page_size)
        positive("max_total_tokens", self.max_total_tokens)
        positive("max_running_requests", self.max_running_requests)
        positive("context_length", self.context_length)
        positive("speculative_num_draft_tokens", self.speculative_num_draft_tokens)
        positive("piecewise_cuda_graph_max_tokens", self.piecewise_cuda_graph_max_tokens)
        positive("piecewise_attention_max_splits", self.piecewise_attention_max_splits)
        splits = self.piecewise_attention_max_splits
        if splits & (splits - 1) or splits > 16:
            raise ValueError(f"piecewise_attention_max_splits must be a power of two up to 16, got {splits}")
        positive("tp_size", self.tp_size)
        if (
            not isinstance(self.stream_interval, int)
            or isinstance(self.stream_interval, bool)
            or self.stream_interval < 1
        ):
            raise ValueError(f"stream_interval must be a positive integer, got {self.stream_interval!r}")
        positive("triton_attention_split_tile_size", self.triton_attention_split_tile_size)
        if not isinstance(self.chunked_prefill_size, int) or (
            self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1
        ):
            raise ValueError(
                f"chunked_prefill_size must be -1 (off) or a positive integer, got {self.chunked_prefill_size!r}"
            )
        if not isinstance(self.max_prefill_wait_steps, int) or isinstance(self.max_prefill_wait_steps, bool) \
                or self.max_prefill_wait_steps < 0:
            raise ValueError(
                f"max_prefill_wait_steps must be a non-negative integer, got {self.max_prefill_wait_steps!r}"
            )
        if self.prefill_wait_policy not in WAIT_POLICIES:
            raise ValueError(f"prefill_wait_policy must be one of {WAIT_POLICIES}, got {self.prefill_wait_policy!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        if isinstance(self.speculative_algorithm, str):
            self.speculative_algorithm = self.speculative_algorithm.upper()
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be DFLASH, DDTREE or unset, got {self.speculative_algorithm!r}"
            )
        if self.speculative_algorithm and not self.speculative_draft_model_path:
            raise ValueError(
                f"speculative_draft_model_path is required with speculative_algorithm {self.speculative_algorithm}"
            )
        if self.speculative_algorithm == "DDTREE":  # NOTE: an alias, like cuda_graph_backend_prefill's piecewise
            self.speculative_algorithm = "DFLASH"
            if self.speculative_tree_budget is None:
                self.speculative_tree_budget = DEFAULT_TREE_BUDGET
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            raise ValueError("speculative_num_draft_tokens must be >= 2")
        if self.cuda_graph_backend_prefill not in (None, "piecewise", "none"):
            raise ValueError(
                f"cuda_graph_backend_prefill must be piecewise or none, got {self.cuda_graph_backend_prefill!r}"
            )
        if self.cuda_graph_backend_prefill == "piecewise":
            self.enforce_piecewise_cuda_graph = True
        if self.enforce_piecewise_cuda_graph and self.disable_piecewise_cuda_graph:
            raise ValueError("enforce_piecewise_cuda_graph and disable_piecewise_cuda_graph contradict each other: "
                             "pass one")
        if self.chat_template is not None:
            if not isinstance(self.chat_template, str):
                raise ValueError(f"chat_template must be a template name or a file, got {self.chat_template!r}")
            chat_template_text(self.chat_template)  # NOTE: ValueError naming the shipped templates when unknown
        if self.piecewise_cuda_graph_tokens is not None and (
            not self.piecewise_cuda_graph_tokens
            or any(not isinstance(n, int) or n < 1 for n in self.piecewise_cuda_graph_tokens)
        ):
            raise ValueError(
                f"piecewise_cuda_graph_tokens must be positive integers, got {self.piecewise_cuda_graph_tokens!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        for name in ("speculative_simulate_accept_len", "speculative_simulate_tree_accept_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (tokens committed per verify)")
        self._validate_verify_flags()
        self._validate_tree_flags()
        self.attention_backend = resolve_deterministic_backend(
            self.enable_deterministic_inference, self.attention_backend, self.tp_size,
            self.triton_attention_split_tile_size)
        if not self.cuda_graph_bs or any(
            not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in self.cuda_graph_bs
        ):
            raise ValueError(f"cuda_graph_bs must be a list of positive integers, got {self.cuda_graph_bs!r}")

    def _validate_verify_flags(self) -> None:
        spec_only = {"speculative_adaptive_verify": self.speculative_adaptive_verify,
                     "speculative_num_draft_tokens_per_bs": self.speculative_num_draft_tokens_per_bs,
                     "speculative_simulate_accept_profile": self.speculative_simulate_accept_profile}
        for name, value in spec_only.items():
            if value is not None and self.speculative_algorithm != "DFLASH":
                raise ValueError(f"{name} needs speculative_algorithm DFLASH")
        if self.speculative_adaptive_verify is not None:
            self.speculative_adaptive_verify = self.speculative_adaptive_verify.lower()
            if self.speculative_adaptive_verify not in ("on", "off"):
                raise ValueError(
                    f"speculative_adaptive_verify must be on or off, got {self.speculative_adaptive_verify!r}"
                )
        if self.speculative_num_draft_tokens_per_bs is not None:
            if self.speculative_adaptive_verify == "on":
                raise ValueError(
                    "speculative_num_draft_tokens_per_bs is a fixed schedule: it replaces adaptive verify, "
                    "so it cannot go with speculative_adaptive_verify on"
                )
            schedule = parse_verify_schedule(self.speculative_num_draft_tokens_per_bs)
            check_schedule_covers(schedule, self.max_running_requests)
        for kind in ("", "tree_"):
            length, profile = f"speculative_simulate_{kind}accept_len", f"speculative_simulate_{kind}accept_profile"
            if getattr(self, profile) is not None:
                if getattr(self, length) is not None:
                    raise ValueError(f"pass one of {length} and {profile}")
                accept_distribution(getattr(self, profile), 2)

    def _validate_tree_flags(self) -> None:
        budget = self.speculative_tree_budget
        if budget is None or budget == 0:
            if self.simulates_tree_acceptance:
                raise ValueError("speculative_simulate_tree_accept_len / _profile need a draft tree "
                                 "(speculative_tree_budget > 0 or speculative_algorithm DDTREE)")
            return
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"speculative_tree_budget must be a non-negative integer, got {budget!r}")
        if self.speculative_algorithm != "DFLASH":
            raise ValueError("speculative_tree_budget needs a DFlash draft: speculative_algorithm DFLASH (or DDTREE) "
                             "and speculative_draft_model_path")
        refusals = {
            "attention_backend flashinfer": self.attention_backend == "flashinfer",
            "enable_deterministic_inference": self.enable_deterministic_inference,
            "speculative_num_draft_tokens_per_bs": self.speculative_num_draft_tokens_per_bs is not None,
        }
        # NOTE: the tree cycle is one CUDA graph (draft, tree build, tree-masked verify, walk), and FlashInfer plans
        # its wrappers on the host, outside any graph; the batch-invariant kernels take no tree mask; a fixed
        # verify-length schedule describes chains.
        for name, refused in refusals.items():
            if refused:
                raise ValueError(f"speculative_tree_budget (DDTree) cannot be combined with {name}")
        chain_simulated = self.speculative_simulate_accept_len is not None or \
            self.speculative_simulate_accept_profile is not None
        if chain_simulated != self.simulates_tree_acceptance:
            raise ValueError("simulated acceptance with a draft tree needs both the chain's "
                             "(speculative_simulate_accept_len or _profile) and the tree's "
                             "(speculative_simulate_tree_accept_len or _profile): adaptive verify weighs one against "
                             "the other")

    @property
    def simulates_tree_acceptance(self) -> bool:
        return self.speculative_simulate_tree_accept_len is not None or \
            self.speculative_simulate_tree_accept_profile is not None

    @property
    def tree_budget(self) -> int:
        """Draft tree nodes a DFlash cycle verifies (0: the chain)."""
        return self.speculative_tree_budget or 0

    @property
    def resolved_host_threads(self) -> Optional[int]:
        """The thread count the engine sets (None: leave torch's)."""
        if self.host_threads is not None:
            return self.host_threads
        return 1 if self.resolved_device.type == "cuda" else None

    @property
    def resolved_device(self) -> torch.device:
        import torch  # NOTE: here, not at the top: the CLI's --help builds its flags from this module, without torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but CUDA is not available")
        return device

    def piecewise_graphs_on(self, device: torch.device, architecture: str) -> bool:
        """Whether extends of a target of `architecture` run in piecewise CUDA graphs on `device`: by default on CUDA
        for the architectures in PIECEWISE_BY_DEFAULT. disable_piecewise_cuda_graph is checked first (it turns them
        off whatever else asks for them); enforce_piecewise_cuda_graph skips the architecture condition."""
        if self.disable_piecewise_cuda_graph or self.disable_cuda_graph or device.type != "cuda":
            return False
        return self.enforce_piecewise_cuda_graph or architecture in PIECEWISE_BY_DEFAULT

    @property
    def chunk_budget(self) -> Optional[int]:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    @property
    def piecewise_max_tokens(self) -> int:
        """The largest piecewise-graph token bucket: the flag's value, else the chunk budget capped at 8192 (the
        static buffers and the graph pool grow with it; above 8k tokens an extend's compute outweighs eager
        launches)."""
        if self.piecewise_cuda_graph_max_tokens is not None:
            return self.piecewise_cuda_graph_max_tokens
        return min(self.chunk_budget or 8192, 8192)
