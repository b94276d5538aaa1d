"""DDTree's tree build and walk on the GPU: the torch forms (tree_build.tree_from_candidates, about 130 launches;
tree_walk.reference_tree_walk, about 18) against the fused Triton kernels (tree_build_kernel.fused_tree_build and
tree_walk_kernel.fused_tree_walk, one launch each), the build after the same top-B over the vocabulary
(top_candidates), per batch size and budget. Writes tree_build_<date>_<commit>.json into --out with

  rows  {bs, budget, depths, vocab, topk_ms, torch_ms, fused_ms, torch_over_fused, same_tree, walk_torch_ms,
        walk_fused_ms, same_walk}: ms per call, each variant captured in a CUDA graph (as inside the greedy-cycle
        graph) and replayed back to back; topk_ms is top_candidates alone (the part both builds share), torch_ms /
        fused_ms the whole build_tree with that tree step; same_tree whether both gave the same tree on the timed
        inputs (random logits: no ties); the walk's over the torch tree with random target tokens that follow the
        tree's first child at every row (walks to a leaf), same_walk whether both walked alike; fused_ms_by_warps:
        the fused build at each --warps count (fused_ms is the default's); topk_fused_ms the fused top-B alone
        (top_candidates_kernel.fused_top_candidates), topk_torch_over_fused = topk_ms / topk_fused_ms, same_top
        whether it gave the torch form's candidates (the tokens of a stable sort, ties to the smaller token; the
        scores within 1e-5), all_fused_ms the fused top-B then the fused tree (build_tree on CUDA).

The default shapes are the demo draft's (block 16: 15 depths, SmolLM2's 49,152 tokens) and Llama-3's vocabulary
(128,256). `--smoke` runs tiny shapes on the CPU (under Triton's interpreter; timings mean nothing)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.device_timing import replay_ms
from benchmarks.results import add_commit_argument, add_out_argument, interpreter_or_cuda, write_json, write_rows
from blockspec.speculative.tree_build import DraftTree, top_candidates, tree_from_candidates
from blockspec.speculative.tree_walk import reference_tree_walk


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.depths, b.depths),
                                             (a.ancestors, b.ancestors)))


def following_target(tree: DraftTree) -> torch.Tensor:
    """[bs, B + 1]: at every tree row the token of its first child (rows are in score order, so the best one), or an
    id outside the vocabulary at a leaf: the walk goes down the best branch to a leaf."""
    bs, width = tree.parents.shape
    rows = torch.arange(width, device=tree.parents.device)
    is_child = (tree.parents[:, None, :] == rows[None, :, None]) & (rows[None, None, :] != rows[None, :, None])
    first = torch.where(is_child, rows[None, None, :], width).amin(-1)  # [bs, B + 1]: first child row, or width
    tokens = torch.cat([tree.tokens, torch.full((bs, 1), -1, device=tree.tokens.device)], 1)
    return tokens.gather(1, (first - 1).clamp(min=0).masked_fill(first == width, width - 1))


def same_top(logits: torch.Tensor, budget: int, got: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether fused (scores, tokens) are the torch form's: the tokens of a stable descending sort (torch's top-k
    order among ties is unspecified), the scores within 1e-5 (the logsumexp rounds differently)."""
    scores, _ = top_candidates(logits, budget)
    tokens = logits.float().sort(dim=-1, descending=True, stable=True).indices[..., :budget]
    return torch.equal(got[1], tokens) and torch.allclose(got[0], scores, rtol=1e-5, atol=1e-5)


def measure(args: argparse.Namespace, out: Path, result: dict[str, Any]) -> None:
    from blockspec.speculative.top_candidates_kernel import fused_top_candidates
    from blockspec.speculative.tree_build_kernel import fused_tree_build
    from blockspec.speculative.tree_walk_kernel import fused_tree_walk

    device = torch.device("cpu" if args.smoke else "cuda")
    result["settings"] = {"depths": args.depths, "repeat": args.repeat}
    for vocab in args.vocabs:
        for budget in args.budgets:
            for bs in args.batch_sizes:
                torch.manual_seed(bs + budget)
                logits = torch.randn(bs, args.depths, vocab, device=device, dtype=torch.bfloat16)
                fused = DraftTree(*fused_tree_build(*top_candidates(logits, budget)))
                reference = tree_from_candidates(*top_candidates(logits, budget))
                row = {
                    "bs": bs, "budget": budget, "depths": args.depths, "vocab": vocab,
                    "topk_ms": replay_ms(lambda: top_candidates(logits, budget), device, args.repeat),
                    "torch_ms": replay_ms(lambda: tree_from_candidates(*top_candidates(logits, budget)), device,
                                          args.repeat),
                    "fused_ms": replay_ms(lambda: fused_tree_build(*top_candidates(logits, budget)), device,
                                          args.repeat),
                    "same_tree": same_tree(fused, reference),
                }
                row["torch_over_fused"] = row["torch_ms"] / row["fused_ms"]
                row["topk_fused_ms"] = replay_ms(lambda: fused_top_candidates(logits, budget), device, args.repeat)
                row["topk_torch_over_fused"] = row["topk_ms"] / row["topk_fused_ms"]
                row["same_top"] = same_top(logits, budget, fused_top_candidates(logits, budget))
                row["all_fused_ms"] = replay_ms(lambda: fused_tree_build(*fused_top_candidates(logits, budget)),
                                                device, args.repeat)
                row["fused_ms_by_warps"] = {str(warps): replay_ms(
                    lambda warps=warps: fused_tree_build(*top_candidates(logits, budget), num_warps=warps), device,
                    args.repeat) for warps in args.warps}
                target = following_target(reference)
                row["walk_torch_ms"] = replay_ms(lambda: reference_tree_walk(reference, target, args.depths), device,
                                                 args.repeat)
                row["walk_fused_ms"] = replay_ms(lambda: fused_tree_walk(
                    reference.tokens, reference.parents, reference.depths, reference.ancestors, target, args.depths),
                    device, args.repeat)
                walks = (reference_tree_walk(reference, target, args.depths), fused_tree_walk(
                    reference.tokens, reference.parents, reference.depths, reference.ancestors, target, args.depths))
                row["same_walk"] = all(torch.equal(x, y) for x, y in zip(*walks))
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                write_json(out, result)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--depths", type=int, default=15, help="draft positions a tree spans (block size - 1)")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--warps", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="warp counts the fused build is also timed at (fused_ms_by_warps)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    add_out_argument(parser)
    add_commit_argument(parser)
    args = parser.parse_args(argv)
    interpreter_or_cuda(parser, args.smoke)  # NOTE: measure imports the kernels' modules
    if args.smoke:
        args.batch_sizes, args.budgets, args.vocabs, args.depths, args.repeat = [1, 3], [4, 8], [64], 5, 2
        args.warps = [1, 4]
    return write_rows("tree_build", args, measure)


if __name__ == "__main__":
    sys.exit(main())
