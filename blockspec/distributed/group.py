"""TensorParallel: one rank's place in the tensor-parallel group, its shards of heads and vocab, its collectives.

Held explicitly by the runner and the model modules that communicate; `None` everywhere means one GPU (TP=1), and
then no collective and no shard arithmetic runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: Optional[dist.ProcessGroup] = None  # None: the default (world) group

    # ---- shards ------------------------------------------------------------------------------
    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, intermediate size): total must divide evenly."""
        if total % self.size:
            raise ValueError(f"tensor parallelism: {what} ({total}) is not divisible by tp_size {self.size}")
        return total // self.size

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads per rank: a slice of them, or one replicated head when there are fewer KV heads than ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor parallelism: tp_size {self.size} must be a multiple of num_key_value_heads ({num_kv_heads}) "
                "when there are fewer KV heads than ranks"
            )
        return 1

    def kv_head_start(self, num_kv_heads: int) -> int:
        """The first (global) KV head this rank holds. NOTE: with replication, ranks r with the same
        r // (size / num_kv_heads) hold the same head, the one their query heads are grouped with."""
        if num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads(num_kv_heads)
        return self.rank // (self.size // num_kv_heads)

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of this rank's vocabulary shard: ceil(V / size) rows each (the last one padded)."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (`x` is returned: static buffers of a graph stay where they are)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank → [..., size * n], rank-major (the vocabulary shards side by side)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        dist.broadcast(x, src=self.global_rank(0), group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest `value` over ranks (e.g. the KV pool size every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
