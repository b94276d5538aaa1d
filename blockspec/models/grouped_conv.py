"""DFlash2's grouped dynamic causal convolution: mixes each draft block row with the rows before it in the same block.

Each layer of a DFlash2 draft has two (around its attention and around its MLP). The weight of tap `o` (row
t-o) on channel c is a static per-channel `base_kernel` plus a dynamic weight shared by every channel of c's group,
projected from the layer's normed input at row t (`kernel_projection`). One projection yields the dynamic weights of
both convolutions of a pair: `before` convolves the sublayer's input, `after` its output with the second half.

NOTE: taps never cross the block start (row 0 of a block sees only itself): the draft block is the unit the
reference convolves, and the context (committed tokens, as draft K/V) never passes a convolution."""
from __future__ import annotations

import torch
from torch import nn

from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import Linear


class GroupedDynamicCausalConv(nn.Module):
    """`base_kernel` [2, taps, H] (before | after), `kernel_projection` H → 2·taps·(H / group_size) (the
    checkpoint's names and shapes). Rows come flattened [T, H], T a whole number of blocks of `block_size` rows."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.groups, False, kernels)

    def before(self, hidden: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the dynamic weights [T, taps, groups] that `after` applies."""
        dynamic = self.kernel_projection(hidden).view(hidden.shape[0], 2, self.kernel_size, self.groups)
        return self._convolve(hidden, dynamic[:, 0], 0, block_size), dynamic[:, 1]

    def after(self, output: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return self._convolve(output, dynamic, 1, block_size)

    def _convolve(self, hidden: torch.Tensor, dynamic: torch.Tensor, which: int, block_size: int) -> torch.Tensor:
        """out[t] = Σ_o (base[o] + dynamic[t, o]) · hidden[t - o] over the taps o that stay inside t's block.

        NOTE: static shapes and no host reads (it runs inside the draft's and the greedy cycle's CUDA graphs). On
        CUDA one fused launch (layers/dflash2_kernels.py; the taps summed in fp32) where fused_conv_applies; this
        torch form is the reference and the training form."""
        if fused_conv_applies(hidden, dynamic, self.base_kernel):
            from blockspec.layers.dflash2_kernels import block_causal_conv  # NOTE: needs Triton

            return block_causal_conv(hidden, dynamic, self.base_kernel[which], block_size, self.group_size)
        return self.reference_convolve(hidden, dynamic, which, block_size)

    def reference_convolve(self, hidden: torch.Tensor, dynamic: torch.Tensor, which: int,
                           block_size: int) -> torch.Tensor:
        """_convolve in torch ops (CPU, the training forward, and the fused kernel's oracle in tests).

        NOTE: the rows stay flat ([T, groups, group_size], tap o = the rows shifted down by o, zeroed where the
        shift crosses a block start) rather than viewed as [T / block_size, block_size, ...]: under
        `train-draft --compile-draft`'s dynamic shapes that division made sympy's shape reasoning most of the
        compile (docs/performance.md, the DFlash2 training step). The sums and their order are the blocked form's."""
        rows, width = hidden.shape
        grouped = hidden.view(rows, self.groups, self.group_size)
        base = self.base_kernel[which].view(self.kernel_size, 1, self.groups, self.group_size).to(hidden.dtype)
        weights = base + dynamic.view(rows, self.kernel_size, self.groups, 1).transpose(0, 1)  # [taps, T, groups, g]
        row_in_block = torch.arange(rows, device=hidden.device) % block_size
        out = weights[0] * grouped
        for offset in range(1, min(self.kernel_size, block_size)):
            shifted = torch.cat([grouped.new_zeros(offset, self.groups, self.group_size), grouped[:-offset]])
            shifted = torch.where((row_in_block >= offset)[:, None, None], shifted, torch.zeros_like(shifted))
            out = out + weights[offset] * shifted
        return out.view(rows, width)


def fused_conv_applies(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether the convolution takes the fused launch: on CUDA, where autograd records nothing.

    NOTE: the launch has no backward (its output carries no gradient history), so a forward that trains (grad enabled
    and an input or the base kernel needing a gradient: `train-draft --draft-arch dflash2` on a GPU) runs the torch
    form, which autograd differentiates and --compile-draft fuses. Serving runs under inference mode."""
    if not hidden.is_cuda:
        return False
    return not (torch.is_grad_enabled() and (hidden.requires_grad or dynamic.requires_grad or base.requires_grad))
