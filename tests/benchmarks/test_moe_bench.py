"""benchmarks/moe.py runs end to end at its tiny shape on the CPU (plumbing: the rows #51 asks for; timings
meaningless there): layer rows per mode and batch size, engine step rows of target-only decode and the DFlash
cycle (whole block, adaptive), touched experts no more than the tokens' picks allow; and, without running it, the
serving part's command and summary."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import moe


def test_tiny_shape_writes_the_rows(tmp_path: Path) -> None:
    assert moe.main(["--shape", "tiny", "--dtype", "float32", "--batch-sizes", "1", "3", "--context", "12",
                     "--repeat", "2", "--tag", "unfused", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe_*.json")
    assert path.name.endswith("_unfused.json")  # NOTE: a second run of the commit that day keeps its own file
    # NOTE: the plot beside it; the shapes' config files lived in a temporary directory
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.with_suffix(".png").name]
    report = json.loads(path.read_text())
    rows = report["rows"]
    modes = ["layer_decode", "layer_verify", "target_decode", "dflash_cycle", "dflash_adaptive"]
    assert [(r["mode"], r["bs"]) for r in rows] == [(m, bs) for m in modes for bs in (1, 3)]
    top_k, experts = moe.TINY["num_experts_per_tok"], moe.TINY["num_experts"]
    for row in rows:
        assert {"mode", "bs", "step_ms", "touched_experts_per_layer", "floor_ms"} <= set(row)
        tokens = row.get("tokens", row["bs"] * row.get("verify_tokens", 1))
        assert top_k <= row["touched_experts_per_layer"] <= min(experts, tokens * top_k)
        assert row["step_ms"] > 0 and row["floor_ms"] > 0
    steps = {(r["mode"], r["bs"]): r for r in rows}
    for mode in modes[2:]:  # NOTE: the step rows count the engine's own routing beside the random-input count
        for bs in (1, 3):
            row = steps[(mode, bs)]
            assert top_k <= row["touched_experts_per_layer"] <= experts
            assert top_k <= row["touched_experts_random"] <= experts
            assert row["counted_tokens"] == bs * row["verify_tokens"]
    assert steps[("target_decode", 3)]["tokens_per_step"] == 3
    assert steps[("dflash_cycle", 3)]["tokens_per_step"] > 3  # simulated acceptance: several tokens per request


def test_kernel_breakdown_names_each_layer_rows_launches(tmp_path: Path) -> None:
    """`--parts kernels`: per layer mode and batch size, the profiled replays reduced per layer: launches counted
    (on the CPU the leaf ops), their time and the heaviest of them, which sum to no more than the total."""
    assert moe.main(["--shape", "tiny", "--dtype", "float32", "--batch-sizes", "1", "3", "--repeat", "1",
                     "--parts", "kernels", "--profile-replays", "2", "--top-kernels", "3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe_*.json")
    rows = json.loads(path.read_text())["kernel_breakdown"]
    assert [(r["mode"], r["bs"]) for r in rows] == [(m, bs) for m in ("layer_decode", "layer_verify") for bs in (1, 3)]
    for row in rows:
        assert row["device"] == "cpu" and not row["in_graph"]
        assert row["wall_us_per_layer"] > 0 and row["launches_per_layer"] >= 3
        assert 0 < len(row["kernels"]) <= 3
        assert sum(k["us_per_cycle"] for k in row["kernels"]) <= row["kernel_us_per_layer"] + 0.01  # NOTE: rounded
        assert all(k["calls_per_cycle"] > 0 and k["name"] for k in row["kernels"])


def test_router_sweep_times_each_launch_shape(tmp_path: Path) -> None:
    """`--parts router`: per token count of the layer rows that the fused router takes, one row per launch shape of
    the grid that fits (the default marked chosen) and one for the GEMM + fused_route path (the Triton kernels under
    the interpreter here)."""
    assert moe.main(["--shape", "tiny", "--dtype", "float32", "--batch-sizes", "1", "3", "--repeat", "1",
                     "--parts", "router", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe_*.json")
    rows = json.loads(path.read_text())["router_sweep"]
    block = moe.TINY_DRAFT["block_size"]
    assert sorted({r["tokens"] for r in rows}) == sorted({1, 3, block, 3 * block} & set(range(1, 17)))
    for tokens in {r["tokens"] for r in rows}:
        fused = [r for r in rows if r["tokens"] == tokens and r["path"] == "fused"]
        shapes = {(r["experts_per_program"], r["num_warps"]) for r in fused}
        assert len(shapes) == len(fused) and (4, 4) in shapes and (1, 1) in shapes
        assert [r["chosen"] for r in fused].count(True) == 1
        assert [r["path"] for r in rows if r["tokens"] == tokens].count("gemm_route") == 1
        assert all(r["us"] > 0 for r in rows)


def test_tile_sweep_times_every_set_of_the_grid(tmp_path: Path) -> None:
    """`--parts tiles`: one row per tile set of the grid, per layer mode and batch size, exactly one of them marked as
    the set choose_tiles picks when that set is in the grid (the Triton kernels under the interpreter here)."""
    assert moe.main(["--shape", "tiny", "--dtype", "float32", "--batch-sizes", "1", "3", "--repeat", "1",
                     "--parts", "layer", "tiles", "--tile-grid", "small", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe_*.json")
    sweep = json.loads(path.read_text())["tile_sweep"]
    grid = moe.TILE_GRIDS["small"]
    per_block_m = len(grid["block_n"]) * len(grid["block_k"]) * len(grid["num_warps"])
    for mode, per_request in (("layer_decode", 1), ("layer_verify", moe.TINY_DRAFT["block_size"])):
        for bs in (1, 3):
            rows = [r for r in sweep if r["mode"] == mode and r["bs"] == bs]
            direct = per_block_m if bs * per_request <= moe.DIRECT_MAX_TOKENS else 0
            assert sorted(r["block_m"] for r in rows if not r["direct"]) == sorted(grid["block_m"] * per_block_m)
            # NOTE: each direct set with the down and combine kernels (with and without the L2 prefetch of the down
            # weights), and folded at each down_columns
            assert sorted(((r["down_columns"] or 0), r["prefetch_down"]) for r in rows if r["direct"]) == sorted(
                [(columns or 0, prefetch) for columns in grid["down_columns"]
                 for prefetch in ((False, True) if columns is None else (False,))] * direct)
            assert all(r["step_ms"] > 0 and r["over_floor"] > 0 for r in rows)
            chosen = [r for r in rows if r["chosen"]]  # NOTE: the tiny batches' pick is in the small grid
            assert len(chosen) == 1 and chosen[0]["direct"] == (bs * per_request == 1)


def test_serving_flags_reach_serving_vs_engine(tmp_path: Path) -> None:
    """`--parts serving`'s command (not run here): the shape's workload by default, each --serving-* flag passed
    through, 1 and 64 clients, no Poisson run, the accept length and the budget."""
    def flags(command: list[str]) -> dict[str, str]:
        start = command.index("benchmarks.serving_vs_engine") + 1
        return dict(zip(command[start::2], command[start + 1::2]))

    for shape, workload in moe.SERVING_DEFAULTS.items():
        args = moe.parse_args(["--shape", shape, "--parts", "serving", "--out", str(tmp_path)])
        got = flags(moe.serving_command(tmp_path / "t", tmp_path / "d", tmp_path / "o", args))
        assert (got["--num-prompts"], got["--max-rounds"], got["--prompt-len"], got["--max-new-tokens"]) == (
            str(workload.prompts), str(workload.rounds), str(workload.prompt_len), str(workload.new_tokens))
        assert float(got["--budget-s"]) == workload.budget_s < workload.timeout_s == args.serving_timeout_s
        assert (got["--concurrency"], got["--modes"], got["--clients"], got["--poisson-rate"], got["--engine-reads"]) \
            == ("1,64", "dflash,target", "generate", "0", "1")
        assert (got["--model-dir"], got["--draft-dir"], got["--accept-len"]) == (
            str(tmp_path / "t"), str(tmp_path / "d"), "6.0")
    # NOTE: one device call (600 s) holds the run, its stop after the timeout and this process's start
    assert moe.SERVING_DEFAULTS["30b-a3b"].timeout_s + moe.SERVING_STOP_GRACE_S <= 570
    args = moe.parse_args(["--shape", "tiny", "--serving-prompts", "8", "--serving-rounds", "1",
                           "--serving-prompt-len", "16", "--serving-new-tokens", "4", "--serving-budget-s", "9",
                           "--serving-modes", "target", "--serving-clients", "generate", "chat_stream",
                           "--out", str(tmp_path)])
    got = flags(moe.serving_command(tmp_path, tmp_path, tmp_path, args))
    assert [got[f] for f in ("--num-prompts", "--max-rounds", "--prompt-len", "--max-new-tokens", "--budget-s",
                             "--modes", "--clients")] == ["8", "1", "16", "4", "9.0", "target", "generate,chat_stream"]


def test_serving_summary_divides_dflash_by_target_per_level() -> None:
    """serving_summary: DFlash ÷ target-only per client and closed-loop level, served and offline; None where a mode
    has no row (left out by the budget or cut), Poisson runs left out."""
    def row(mode: str, concurrency: object, served: float, engine: float,
            client: str = "generate") -> dict[str, object]:
        return {"mode": mode, "concurrency": concurrency, "client": client, "server_tok_s": served,
                "engine_tok_s": engine, "server_accept_length": 5.9 if mode == "dflash" else None, "failed": 0}

    rows = [row("dflash", 1, 600.0, 640.0), row("dflash", 64, 8000.0, 8400.0), row("dflash", "poisson", 1.0, 1.0),
            row("target", 1, 200.0, 320.0), row("target", 64, 4000.0, 4200.0),
            row("dflash", 1, 50.0, 50.0, "chat_stream")]
    summary = {(level["client"], level["concurrency"]): level for level in moe.serving_summary(rows)}
    assert list(summary) == [("generate", 1), ("generate", 64), ("chat_stream", 1)]
    assert summary[("generate", 1)]["dflash_over_target"] == 3.0
    assert summary[("generate", 1)]["engine_dflash_over_target"] == 2.0
    assert summary[("generate", 64)]["dflash_over_target"] == 2.0
    assert summary[("generate", 64)]["dflash_accept_length"] == 5.9
    assert summary[("chat_stream", 1)]["dflash_over_target"] is None
    assert summary[("chat_stream", 1)]["target_tok_s"] is None
