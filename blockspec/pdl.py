"""Programmatic dependent launch (PDL) for the engine's Triton kernels on Hopper and newer GPUs.

A kernel launched with PDL may start while the kernel before it in the stream is still finishing, so its launch
latency hides behind that kernel's tail (inside CUDA graphs too). Its programs then wait, before reading anything,
until the previous grid has completed and its writes are visible (`griddepcontrol.wait`), and at once allow the next
PDL kernel to launch (`griddepcontrol.launch_dependents`). Set BLOCKSPEC_PDL=0 to launch every kernel plainly.

A PDL kernel whose inputs were final before the previous grid started may ask L2 for them before it waits
(`prefetch_to_l2`): its reads then stream while the previous kernel still runs."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache(maxsize=None)
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: an NVIDIA device of compute capability >= 9.0, unless
    BLOCKSPEC_PDL=0. Never under the Triton CPU interpreter, nor on ROCm (griddepcontrol is PTX)."""
    if device.type != "cuda" or torch.version.hip is not None or triton.knobs.runtime.interpret:
        return False
    if os.environ.get("BLOCKSPEC_PDL", "1") == "0":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(tensor: torch.Tensor, kernel: Optional[triton.JITFunction] = None) -> dict[str, bool]:
    """Launch keywords for a kernel whose tensors live where `tensor` does: PDL on where enabled and the kernel takes
    the PDL constexpr (a `kernel` without one, e.g. a benchmark's candidate, launches plainly)."""
    if kernel is not None and "PDL" not in kernel.arg_names:
        return {}
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(tensor.device) else {}


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """First statement of every PDL kernel, before any load and any early return: a program that returned without
    waiting could let the whole grid complete before the grid it depends on, and break the chain of waits. Only a
    `prefetch_to_l2` of inputs final before the previous grid started may come before it."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# NOTE: an L2 line is 128 bytes on every NVIDIA GPU that PDL runs on
L2_LINE_BYTES = 128


@triton.jit
def prefetch_to_l2(base, num_elements, LINE_ELEMENTS: tl.constexpr, LANES: tl.constexpr):
    """Asks L2 for the `num_elements` contiguous values from `base`, one line per lane and trip, kept ahead of other
    lines when L2 must evict (evict_last). A hint: nothing waits for it and no value changes. CUDA only (PTX):
    callers guard it with a constexpr that is False under the interpreter (`pdl_enabled`)."""
    for start in range(0, num_elements, LINE_ELEMENTS * LANES):
        offsets = tl.minimum(start + tl.arange(0, LANES) * LINE_ELEMENTS, num_elements - 1)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [base + offsets],
                                  dtype=tl.int32, is_pure=False, pack=1)
