"""The DFlash (or DFlash2) draft as a plain, differentiable module whose parameter names are z-lab's checkpoint names.

`forward` runs many blocks of many sequences at once: queries are the blocks' tokens, keys/values are
[projected context features of the whole sequence ; all block tokens], and the mask decides who sees what. A DFlash2
draft's layers also convolve each block's rows around attention and MLP (models/grouped_conv.py), and it carries the
candidate selector (models/candidate_selector.py) that blocks.py's loss trains with the backbone."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.rotary import RopeConfig, inverse_frequencies
from blockspec.models.candidate_selector import CandidateSelector
from blockspec.models.config import TargetConfig
from blockspec.models.draft_config import DFlash2Fields
from blockspec.models.grouped_conv import GroupedDynamicCausalConv


@dataclass
class DraftArch:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    num_taps: int
    max_position_embeddings: int
    dflash2: Optional[DFlash2Fields] = None  # None: a DFlash draft
    block_size: int = 16  # the rows each DFlash2 convolution runs over

    @classmethod
    def from_target(
        cls, target: TargetConfig, num_layers: int, num_taps: int, intermediate_size: int | None,
        dflash2: Optional[DFlash2Fields] = None, block_size: int = 16,
    ) -> "DraftArch":
        """Qwen3-style layers with the target's widths (what z-lab's drafts do); plain rope at the target's theta."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope.theta,
            num_taps=num_taps,
            max_position_embeddings=target.max_position_embeddings,
            dflash2=dflash2,
            block_size=block_size,
        )


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox (rotate-half) rotary; x [N, heads, T, D], cos/sin [N, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=False)
        self.q_norm = Norm(d, arch.rms_norm_eps)
        self.k_norm = Norm(d, arch.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [N, Q, H] (normed block), context [N, C, H]; keys/values = [context ; block] → [N, Q, H]."""
        n, q_len, d = x.shape[0], x.shape[1], self.head_dim
        both = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(n, -1, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(both).view(n, -1, self.num_kv_heads, d).transpose(1, 2)
        q, k = rotate(q, *rope_q), rotate(k, *rope_k)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = Norm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
    ) -> torch.Tensor:
        # NOTE: the context does not pass input_layernorm (z-lab's reference and blockspec's inference agree).
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ConvLayer(Layer):
    """A DFlash2 layer: attention and MLP each between the two halves of a grouped dynamic causal convolution."""

    def __init__(self, arch: DraftArch, fields: DFlash2Fields) -> None:
        super().__init__(arch)
        self.block_size = arch.block_size
        taps, group = fields.conv_kernel_size, fields.conv_group_size
        self.attention_conv = GroupedDynamicCausalConv(arch.hidden_size, taps, group)
        self.mlp_conv = GroupedDynamicCausalConv(arch.hidden_size, taps, group)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self._around(self.attention_conv, self.input_layernorm(x),
                             lambda h: self.self_attn(h, context, rope_q, rope_k, mask))
        return x + self._around(self.mlp_conv, self.post_attention_layernorm(x), self.mlp)

    def _around(self, conv: GroupedDynamicCausalConv, x: torch.Tensor, sublayer: nn.Module | Callable) -> torch.Tensor:
        """after(sublayer(before(x))) on x [N, n·B, H] (n whole blocks per sequence)."""
        shape, b = x.shape, self.block_size
        convolved, dynamic = conv.before(x.reshape(-1, shape[-1]), b)
        return conv.after(sublayer(convolved.view(shape)).reshape(-1, shape[-1]), dynamic, b).view(shape)


class TrainableDraft(nn.Module):
    """state_dict() names are exactly z-lab's: layers.N.self_attn.*, layers.N.mlp.*, fc, hidden_norm, norm; for
    DFlash2 also layers.N.{attention,mlp}_conv.* and candidate_selector.* (the codebooks bare, as published)."""

    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        self.arch = arch
        fields = arch.dflash2
        self.layers = nn.ModuleList(
            (Layer(arch) if fields is None else ConvLayer(arch, fields)) for _ in range(arch.num_layers)
        )
        self.candidate_selector = None if fields is None else CandidateSelector(arch.hidden_size, fields)
        self.fc = nn.Linear(arch.num_taps * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        inv_freq = inverse_frequencies(arch.head_dim, RopeConfig(theta=arch.rope_theta))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.inv_freq: torch.Tensor
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights and the selector's codebooks ~ N(0, std), norms 1; a convolution starts as the identity
        (tap 0 weighs 1, the others 0: the dynamic weights start small)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, std)
                elif isinstance(module, Norm):
                    module.weight.fill_(1.0)
                elif isinstance(module, GroupedDynamicCausalConv):
                    module.base_kernel.zero_()
                    module.base_kernel[:, 0] = 1.0
                elif isinstance(module, CandidateSelector):
                    module.predecessor_codebook.normal_(0.0, std)
                    module.successor_codebook.normal_(0.0, std)

    @classmethod
    def dflash2_from(cls, draft: "TrainableDraft", fields: DFlash2Fields) -> "TrainableDraft":
        """A DFlash2 draft that proposes exactly what the DFlash draft `draft` proposes, to train on from there: all of
        its weights; convolutions that pass their input through (tap 0 weighs 1, no dynamic weights: kernel
        projections zero); a selector whose bilinear term is zero (hidden projection zero), so it ranks the
        candidates by the target's logits alone and picks the argmax. NOTE: both zeros still get gradients (the
        projections' inputs and the codebooks are not zero), so training moves them from the first step."""
        if draft.arch.dflash2 is not None:
            raise ValueError("dflash2_from takes a DFlash (v1) draft")
        grown = cls(dataclasses.replace(draft.arch, dflash2=fields))
        result = grown.load_state_dict(draft.state_dict(), strict=False)
        new = [name for name in result.missing_keys if "_conv." not in name and "candidate_selector." not in name]
        if new or result.unexpected_keys:
            raise ValueError(f"DFlash weights do not fit the DFlash2 draft (missing {new[:3]}, unexpected "
                             f"{result.unexpected_keys[:3]})")
        with torch.no_grad():
            for module in grown.modules():
                if isinstance(module, GroupedDynamicCausalConv):
                    module.kernel_projection.weight.zero_()
            assert grown.candidate_selector is not None
            grown.candidate_selector.hidden_projection.weight.zero_()
        return grown

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, block_embeds: torch.Tensor, block_positions: torch.Tensor, features: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """block_embeds [N, Q, H] at block_positions [N, Q]; features [N, C, taps*H] of tokens 0..C-1;
        mask [N, Q, C+Q] bool (True = visible). Returns final-normed block hidden states [N, Q, H]."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        context_positions = torch.arange(features.shape[1], device=features.device).expand(features.shape[0], -1)
        hidden = block_embeds.to(self.fc.weight.dtype)
        rope_q = self._rope(block_positions, hidden.dtype)
        rope_k = self._rope(torch.cat([context_positions, block_positions], dim=1), hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, context, rope_q, rope_k, mask)
        return self.norm(hidden)
