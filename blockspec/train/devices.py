"""Where draft training runs: the torchrun process group, the device and the target's dtype."""
from __future__ import annotations

import datetime
import os

import torch

from blockspec.models.loader import resolve_dtype
from blockspec.train.trainer import Dist


def uses_cuda(flag: str) -> bool:
    return flag != "cpu" and torch.cuda.is_available()


def init_distributed(device_flag: str) -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; the process group then carries DDP's gradient all-reduce."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not torch.distributed.is_initialized():
        if uses_cuda(device_flag):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if uses_cuda(device_flag) else "gloo"
        # NOTE: ranks wait at barriers while others generate responses or evaluate; the default timeout is too short.
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(hours=6))
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())


def resolve_device(flag: str, dist: Dist) -> torch.device:
    if dist.world > 1 and uses_cuda(flag):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if flag == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(flag)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return device


def resolve_target_dtype(flag: str, device: torch.device) -> torch.dtype:
    if flag == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(flag)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
