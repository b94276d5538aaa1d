"""Runs one attention case of tune_attention.py a few times with the default launch policy, for Nsight Compute:
`ncu --kernel-name paged_attention_kernel --launch-skip 2 --launch-count 1 python attention_once.py "verify bs32 ctx512"`.
"""
from __future__ import annotations

import sys

import torch

from blockspec.attention.triton_backend import TritonAttentionBackend
from tune_attention import CASES, HEAD_DIM, HEADS, KV_HEADS, make_batch


def main() -> None:
    wanted = sys.argv[1] if len(sys.argv) > 1 else "verify bs32 ctx512"
    name, mode, bs, context, new = next(case for case in CASES if case[0] == wanted)
    batch, pool, q = make_batch(mode, bs, context, new)
    backend = TritonAttentionBackend(pool, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM)
    batch.attn_meta = backend.plan(batch)
    print(name, batch.attn_meta.tiles, "splits", batch.attn_meta.num_splits, flush=True)
    for _ in range(4):
        backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 0, batch, kv_stored=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
