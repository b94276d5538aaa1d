"""The DFlash2 draft's fused kernels (layers/dflash2_kernels.py) equal their torch references: the block-causal
grouped dynamic convolution (models/grouped_conv.py, itself checked against z-lab's DFlash2DraftModel) and the
selector's greedy walk (models/candidate_selector.py: the same picks, ties included). Under Triton's interpreter on
CPU (root conftest), natively on CUDA."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.layers.dflash2_kernels import block_causal_conv, candidate_walk  # noqa: E402
from blockspec.models.candidate_selector import CandidateSelector  # noqa: E402
from blockspec.models.grouped_conv import GroupedDynamicCausalConv, fused_conv_applies  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden,taps,group,block,blocks", [
    (32, 4, 8, 8, 3),  # the usual: 4 taps inside 8-row blocks
    (48, 3, 16, 2, 5),  # blocks shorter than the taps: taps stop at the block start
    (40, 4, 8, 16, 1),  # a width that is not a power of two (masked columns)
])
def test_block_causal_conv_equals_the_torch_convolution(dtype: torch.dtype, hidden: int, taps: int, group: int,
                                                        block: int, blocks: int) -> None:
    torch.manual_seed(hidden + block)
    conv = GroupedDynamicCausalConv(hidden, taps, group)
    with torch.no_grad():
        torch.nn.init.normal_(conv.base_kernel, std=0.5)
        torch.nn.init.normal_(conv.kernel_projection.weight, std=0.2)
    conv = conv.to(device=DEVICE, dtype=dtype)
    x = torch.randn(blocks * block, hidden, device=DEVICE, dtype=dtype)
    reference = copy.deepcopy(conv).float()  # NOTE: the torch form in fp32 on the same (rounded) weights
    with torch.no_grad():
        dynamic = conv.kernel_projection(x).view(x.shape[0], 2, taps, hidden // group)
        for which in (0, 1):
            want = reference.reference_convolve(x.float(), dynamic[:, which].float(), which, block)
            got = block_causal_conv(x, dynamic[:, which], conv.base_kernel[which].contiguous(), block, group)
            assert got.dtype == dtype
            tolerance = 1e-5 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("n,rows,top_k", [(1, 7, 16), (5, 15, 16), (3, 4, 12)])
def test_candidate_walk_picks_what_the_torch_walk_picks(n: int, rows: int, top_k: int) -> None:
    generator = torch.Generator().manual_seed(rows * top_k)
    unary = torch.randn(n, rows, top_k, generator=generator)
    transitions = torch.randn(n, rows, top_k, top_k, generator=generator)
    # NOTE: ties on purpose (coarse values): both walks must take the first best candidate
    unary, transitions = (unary * 2).round() / 2, (transitions * 2).round() / 2
    ids = torch.stack([torch.randperm(1000, generator=generator)[:top_k] for _ in range(n * rows)]).view(n, rows, top_k)
    want = CandidateSelector.reference_walk(unary, ids, transitions)
    got = candidate_walk(unary.to(DEVICE), ids.to(DEVICE), transitions.to(DEVICE))
    assert got.cpu().tolist() == want.tolist()


class _LooksLikeCuda(torch.Tensor):
    """A CPU tensor that reports CUDA: fused_conv_applies's rule, checked without a GPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_the_fused_convolution_serves_only_where_autograd_records_nothing() -> None:
    """The fused launch has no backward: a training forward on the GPU must take the torch form, or every weight
    inside a DFlash2 layer's convolutions (and the sublayers between them) gets no gradient."""
    hidden = torch.zeros(16, 8).as_subclass(_LooksLikeCuda)
    dynamic, base = torch.zeros(16, 3, 2), torch.zeros(3, 8, requires_grad=True)
    assert fused_conv_applies(hidden, dynamic, base.detach())  # NOTE: nothing needs a gradient
    assert not fused_conv_applies(hidden, dynamic, base)  # NOTE: a weight does: training
    assert not fused_conv_applies(hidden, dynamic.requires_grad_(), base.detach())
    with torch.inference_mode():
        assert fused_conv_applies(hidden, dynamic, base)  # NOTE: serving
    with torch.no_grad():
        assert fused_conv_applies(hidden, dynamic, base)
    assert not fused_conv_applies(torch.zeros(16, 8), dynamic, base.detach())  # NOTE: the CPU has no fused launch


def test_the_convolution_trains_where_it_runs() -> None:
    """Gradients through `before` and `after` on DEVICE equal the CPU's torch form's: on CUDA a training forward
    takes no fused launch (whose output would carry no gradient history)."""
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(32, 4, 8)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0.0, 0.1)
    hidden, weights = torch.randn(24, 32), torch.randn(24, 32)

    def gradients(module: GroupedDynamicCausalConv, device: torch.device) -> list[torch.Tensor]:
        # NOTE: a copy on every device: hidden.to(cpu) is hidden itself, and a second call would then copy a tensor
        # that already requires grad (a non-leaf, whose .grad stays None) or accumulate into the first's .grad
        x = hidden.to(device, copy=True).requires_grad_()
        convolved, dynamic = module.before(x, 8)
        (module.after(torch.tanh(convolved), dynamic, 8) * weights.to(device)).sum().backward()
        found = [x.grad, *(p.grad for p in module.parameters())]
        assert all(g is not None for g in found)
        return [g.cpu() for g in found if g is not None]

    expected = gradients(conv, torch.device("cpu"))
    for got, want in zip(gradients(copy.deepcopy(conv).to(DEVICE), DEVICE), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
