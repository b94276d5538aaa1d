"""Target model configuration parsed from an HF `config.json` (transformers 4.x and 5.x spellings)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from blockspec.layers.moe import ExpertRouting
from blockspec.layers.rotary import RopeConfig

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts part of a target: how its sparse layers route, the experts' intermediate size, and which
    layers are sparse (the others have a dense MLP of the config's intermediate_size)."""

    routing: ExpertRouting
    expert_intermediate_size: int
    sparse_layers: tuple[int, ...]


@dataclass
class TargetConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    moe: Optional[MoeConfig] = None  # None: every layer has a dense MLP
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s MLP is a mixture of experts."""
        return self.moe is not None and layer_id in self.moe.sparse_layers

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_sparse(layer_id) for layer_id in range(self.num_layers))


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, llama3, linear)")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict[str, Any]) -> list[int]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def parse_qwen3_moe(raw: dict[str, Any], num_layers: int) -> MoeConfig:
    """Qwen3-MoE's fields: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    (HF's rule); `num_experts` (transformers 5 writes `num_local_experts`), `num_experts_per_tok`, `norm_topk_prob`,
    `moe_intermediate_size`. No shared expert."""
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0)
    top_k = int(raw["num_experts_per_tok"])
    if num_experts and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense_only = {int(i) for i in raw.get("mlp_only_layers") or []}
    sparse = tuple(i for i in range(num_layers) if num_experts > 0 and (i + 1) % step == 0 and i not in dense_only)
    return MoeConfig(ExpertRouting(num_experts, top_k, bool(raw.get("norm_topk_prob", False))),
                     int(raw["moe_intermediate_size"]), sparse)


def parse_target_config(raw: dict[str, Any]) -> TargetConfig:
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else _MODEL_TYPE_TO_ARCH.get(raw.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        name = arch or raw.get("model_type") or "<none>"
        raise ValueError(
            f"unsupported model architecture {name!r}; blockspec serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        num_layers = int(raw["num_hidden_layers"])
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        return TargetConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=parse_rope(raw),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            eos_token_ids=_eos_ids(raw),
            moe=parse_qwen3_moe(raw, num_layers) if arch == "Qwen3MoeForCausalLM" else None,
            raw=raw,
        )
    except KeyError as missing:
        raise ValueError(f"config.json lacks required field {missing.args[0]!r}") from None


def load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in {path.parent}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None


def load_target_config(model_dir: str | Path, overrides: Optional[dict[str, Any]] = None) -> TargetConfig:
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    raw = load_json(Path(model_dir) / "config.json")
    raw.update(overrides or {})
    return parse_target_config(raw)
