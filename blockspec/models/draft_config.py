"""DFlash and DFlash2 draft configuration (z-lab checkpoint format), validated against the target."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from blockspec.layers.rotary import RopeConfig
from blockspec.models.config import TargetConfig, load_json, parse_rope

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang's / z-lab's spread: one tap per draft layer, from layer 1 to layer L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"cannot spread {num_draft_layers} taps over a {num_target_layers}-layer target")
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlash2Fields:
    """What a DFlash2 draft adds to a DFlash one: a grouped dynamic causal convolution around each layer's attention
    and MLP (`conv_kernel_size` taps, one dynamic weight per `conv_group_size` channels), and a candidate selector
    over the target lm_head's top `selector_top_k` tokens per draft row (codebooks of `selector_rank` columns, one row
    per token of `selector_vocab_size`). `logits_width`: the target's vocabulary, the width of the logits the
    candidates come from."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    selector_vocab_size: int
    logits_width: int


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    layer_windows: list[Optional[int]]  # sliding window per layer, None for full attention
    layer_causal: list[bool]  # sliding layers are causal by default, full layers see the whole block
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: Optional[float]
    dflash2: Optional[DFlash2Fields] = None  # None: a DFlash (v1) draft


def _get(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    nested = raw.get("dflash_config") or {}
    return nested[name] if name in nested else raw.get(name, default)


def _positive_int(raw: dict[str, Any], name: str) -> int:
    value = _get(raw, name)
    if value is None:
        raise ValueError(f"DFlash2 draft config lacks {name!r} (top level or under dflash_config)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DFlash2 draft {name} must be a positive integer, got {value!r}")
    return value


def parse_dflash2_fields(raw: dict[str, Any], target: TargetConfig, hidden: int) -> Optional[DFlash2Fields]:
    """The DFlash2 fields of a draft config (architectures ["DFlash2DraftModel"] or any of DFLASH2_KEYS present),
    None for a DFlash (v1) draft."""
    archs = raw.get("architectures") or []
    if not any("DFlash2" in a for a in archs) and all(_get(raw, k) is None for k in DFLASH2_KEYS):
        return None
    kernel_size, group_size, rank, top_k = (_positive_int(raw, name) for name in DFLASH2_KEYS)
    if hidden % group_size:
        raise ValueError(f"DFlash2 draft conv_group_size {group_size} does not divide hidden_size {hidden}")
    vocab = int(raw.get("vocab_size") or target.vocab_size)
    if vocab < target.vocab_size:
        raise ValueError(f"DFlash2 draft vocab_size {vocab} is smaller than the target's {target.vocab_size}: the "
                         "selector's codebooks need a row for every token of the target's lm_head")
    if top_k > target.vocab_size:
        raise ValueError(f"DFlash2 draft selector_top_k {top_k} exceeds the target vocabulary ({target.vocab_size})")
    return DFlash2Fields(kernel_size, group_size, rank, top_k, vocab, target.vocab_size)


def parse_draft_config(raw: dict[str, Any], target: TargetConfig) -> DraftConfig:
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        intermediate = int(raw["intermediate_size"])
    except KeyError as missing:
        raise ValueError(f"draft config.json lacks required field {missing.args[0]!r}") from None
    if hidden != target.hidden_size:
        raise ValueError(f"draft hidden_size {hidden} does not match the target's {target.hidden_size}")
    layer_ids = _get(raw, "target_layer_ids")
    if layer_ids is None:
        num_target_layers = int(_get(raw, "num_target_layers", target.num_layers))
        layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids or any(not 0 <= i < target.num_layers for i in layer_ids):
        raise ValueError(
            f"draft target_layer_ids {layer_ids} must lie in [0, {target.num_layers}) (the target's layers)"
        )
    mask_token_id = _get(raw, "mask_token_id")
    if mask_token_id is None:
        raise ValueError("draft config has no mask_token_id (top level or under dflash_config)")
    if not 0 <= int(mask_token_id) < target.vocab_size:
        raise ValueError(
            f"draft mask_token_id {mask_token_id} is outside the target vocabulary [0, {target.vocab_size})"
        )
    layer_types = _get(raw, "layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"draft layer_types has {len(layer_types)} entries for {num_layers} layers")
    window = _get(raw, "sliding_window")
    is_causal = _get(raw, "is_causal")
    windows: list[Optional[int]] = []
    causal: list[bool] = []
    for kind in layer_types:
        sliding = kind == "sliding_attention"
        if sliding and not window:
            raise ValueError("draft has sliding_attention layers but no sliding_window")
        windows.append(int(window) if sliding else None)
        causal.append(sliding if is_causal is None else bool(is_causal))
    block_size = _get(raw, "block_size", 16)
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"draft block_size must be an integer >= 2, got {block_size!r}")
    softcap = _get(raw, "final_logit_softcapping")
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw),
        attention_bias=bool(raw.get("attention_bias", False)),
        target_layer_ids=layer_ids,
        block_size=block_size,
        mask_token_id=int(mask_token_id),
        layer_windows=windows,
        layer_causal=causal,
        input_embedding_scale=float(_get(raw, "input_embedding_scale", 1.0) or 1.0),
        output_multiplier=float(_get(raw, "output_multiplier", 1.0) or 1.0),
        final_logit_softcapping=float(softcap) if softcap else None,
        dflash2=parse_dflash2_fields(raw, target, hidden),
    )


def load_draft_config(draft_dir: str | Path, target: TargetConfig) -> DraftConfig:
    return parse_draft_config(load_json(Path(draft_dir) / "config.json"), target)
