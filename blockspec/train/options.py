"""`blockspec train-draft` options: one dataclass, its argparse flags, and validation with clear messages."""
from __future__ import annotations

import argparse
import hashlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

from blockspec.config.cache_root import default_cache_root
from blockspec.config.cli_help import DefaultsHelpFormatter

if TYPE_CHECKING:
    from blockspec.models.config import TargetConfig

# DFlash paper: loss decay γ per block size (w_k = exp(-(k-1)/γ)); other sizes interpolate.
PAPER_LOSS_DECAY = {8: 4.0, 10: 5.0, 16: 7.0}


def prompt_set_names(paths: Sequence[str]) -> list[str]:
    """--eval-prompts results are keyed by file name (its stem), so the names must differ."""
    names = [Path(p).stem for p in paths]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"--eval-prompts: several files are named {', '.join(repeated)}; results are keyed by file name"
        )
    return names


@dataclass
class TrainOptions:
    target_model_path: str
    data: str
    out: str
    # draft architecture (unset sizes copy the target's)
    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: Optional[list[int]] = None
    intermediate_size: Optional[int] = None
    mask_token_id: Optional[int] = None
    init_from: Optional[str] = None
    draft_arch: str = "dflash"  # dflash2: grouped dynamic causal convolutions + a candidate selector
    conv_kernel_size: int = 4
    conv_group_size: int = 64
    selector_rank: int = 256
    selector_top_k: int = 16
    # data generation (the target's own greedy responses)
    max_new_tokens: int = 512
    num_prompts: Optional[int] = None
    ignore_eos: bool = False
    system_prompt: Optional[str] = None
    user_suffix: str = ""
    cache_dir: Optional[str] = None
    gen_batch_size: int = 512
    gen_workers: int = 1
    mix_data: Optional[str] = None
    mix_ratio: float = 0.5
    responses_only: bool = False
    # training
    steps: int = 2000
    batch_size: int = 16
    blocks_per_seq: int = 32
    max_seq_len: int = 2048
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    lr_schedule: str = "steps"
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_decay: Optional[float] = None
    cache_features: bool = False
    feature_cache_device_gib: Optional[float] = None  # None: the GPU's free memory less a reserve (feature_cache.py)
    feature_cache_host_gib: Optional[float] = None  # None: half the host memory available at the start
    compile_draft: bool = False
    max_train_minutes: Optional[float] = None
    seed: int = 0
    # evaluation with the real engine on held-out prompts
    eval_every: int = 0
    num_eval_prompts: int = 16
    eval_max_new_tokens: int = 256
    eval_data: Optional[str] = None
    eval_prompts: Optional[list[str]] = None
    eval_prompts_max: int = 64
    eval_only: bool = False
    # devices and output
    device: str = "auto"
    dtype: str = "auto"
    save_dtype: str = "bfloat16"
    max_shard_mb: float = 16.0
    progress: bool = True

    @property
    def decay(self) -> float:
        if self.loss_decay is not None:
            return self.loss_decay
        return PAPER_LOSS_DECAY.get(self.block_size, max(1.0, (self.block_size - 2) / 2))

    @property
    def cache_path(self) -> Path:
        """--cache-dir, else one folder per (target, data file) under blockspec's cache root (not in --out,
        which is the checkpoint that gets shipped)."""
        if self.cache_dir:
            return Path(self.cache_dir)
        key = f"{Path(self.target_model_path).resolve()}\n{Path(self.data).resolve()}"
        if self.mix_data is not None:  # NOTE: mixing changes which prompt sits at which cache index
            key += f"\n{Path(self.mix_data).resolve()}\n{self.mix_ratio}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        return default_cache_root() / "train_responses" / f"{Path(self.data).stem}-{digest}"

    def validate(self) -> None:
        """Checks everything that needs no model; `resolve_layer_ids` checks the rest against the target."""
        for path in self.eval_prompts or []:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--eval-prompts {path}: no such file")
        prompt_set_names(self.eval_prompts or [])
        if self.eval_prompts_max < 1:
            raise ValueError(f"--eval-prompts-max must be >= 1, got {self.eval_prompts_max}")
        if self.eval_only:
            self._validate_eval_only()
            return
        if not self.data:
            raise ValueError("--data is required (unless --eval-only)")
        if not self.out and not self.responses_only:
            raise ValueError("--out is required (unless --responses-only)")
        if self.mix_data is not None and not Path(self.mix_data).is_file():
            raise FileNotFoundError(f"--mix-data {self.mix_data}: no such file")
        if not 0.0 < self.mix_ratio < 1.0:
            raise ValueError(f"--mix-ratio must be in (0, 1), got {self.mix_ratio}")
        if not Path(self.data).is_file():
            raise FileNotFoundError(
                f"--data {self.data}: no such file (expected JSON lines with messages/text/question)"
            )
        if self.eval_data is not None and not Path(self.eval_data).is_file():
            raise FileNotFoundError(f"--eval-data {self.eval_data}: no such file")
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            raise FileNotFoundError(f"--init-from {self.init_from}: no draft checkpoint (config.json) there")
        if not Path(self.target_model_path).is_dir():
            raise FileNotFoundError(f"--target-model-path {self.target_model_path}: no such directory")
        if self.block_size < 2:
            raise ValueError(
                f"--block-size must be >= 2 (the anchor token plus at least one prediction), got {self.block_size}"
            )
        if self.draft_arch not in ("dflash", "dflash2"):
            raise ValueError(f"--draft-arch must be dflash or dflash2, got {self.draft_arch!r}")
        for name in ("num_layers", "steps", "batch_size", "blocks_per_seq", "max_new_tokens", "gen_batch_size",
                     "gen_workers", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < self.block_size + 2:
            raise ValueError(f"--max-seq-len must be at least --block-size + 2, got {self.max_seq_len}")
        if self.num_eval_prompts < 0 or self.eval_every < 0:
            raise ValueError("--num-eval-prompts and --eval-every must be >= 0")
        if self.lr <= 0 or not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("--lr must be > 0, --warmup-ratio in [0, 1), --min-lr-ratio in [0, 1]")
        if self.loss_decay is not None and self.loss_decay <= 0:
            raise ValueError(f"--loss-decay must be > 0, got {self.loss_decay}")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--save-dtype must be float32, bfloat16 or float16, got {self.save_dtype!r}")
        if self.max_train_minutes is not None and self.max_train_minutes <= 0:
            raise ValueError(f"--max-train-minutes must be > 0, got {self.max_train_minutes}")
        if self.lr_schedule not in ("steps", "time"):
            raise ValueError(f"--lr-schedule must be steps or time, got {self.lr_schedule!r}")
        if self.lr_schedule == "time" and self.max_train_minutes is None:
            raise ValueError("--lr-schedule time spans --max-train-minutes: pass it")
        if self.max_shard_mb <= 0:
            raise ValueError(f"--max-shard-mb must be > 0, got {self.max_shard_mb}")
        for name in ("feature_cache_device_gib", "feature_cache_host_gib"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
            if getattr(self, name) is not None and not self.cache_features:
                raise ValueError(f"--{name.replace('_', '-')} limits --cache-features: pass that too")

    def _validate_eval_only(self) -> None:
        if not self.eval_prompts:
            raise ValueError("--eval-only needs --eval-prompts FILE [FILE ...]")
        if not (Path(self.out) / "config.json").is_file():
            raise FileNotFoundError(f"--eval-only: no draft checkpoint (config.json) in --out {self.out}")
        if not Path(self.target_model_path).is_dir():
            raise FileNotFoundError(f"--target-model-path {self.target_model_path}: no such directory")


def resolve_layer_ids(options: TrainOptions, target: TargetConfig) -> list[int]:
    """The taps: given ids checked against the target's layers, else z-lab's default spread."""
    # NOTE: here, not at the top: `train-draft --help` parses flags without torch (the models import it)
    from blockspec.models.draft_config import default_target_layer_ids

    if options.target_layer_ids is None:
        return default_target_layer_ids(target.num_layers, options.num_layers)
    ids = list(options.target_layer_ids)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if not ids or bad:
        raise ValueError(
            f"--target-layer-ids {ids}: layer id(s) {bad} out of range; the target has {target.num_layers} layers "
            f"(valid ids 0..{target.num_layers - 1})"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"--target-layer-ids {ids} has duplicates")
    return ids


# NOTE: what a run without these flags uses on a CPU instead of TrainOptions' GPU-sized defaults, whose 2000 steps of
# 16 sequences of 512-token responses take hours there: a short run on short responses, its target features computed
# once (the target's forward was most of a CPU step), so that a first try on the demo pair (SmolLM2-135M) ends in a
# saved, evaluated checkpoint within minutes; a higher learning rate over fewer steps than a GPU run's (docs/training.md
# has the runs that chose steps and lr)
CPU_DEFAULTS: dict[str, Union[int, float, bool]] = {
    "steps": 300, "lr": 1e-3, "batch_size": 4, "blocks_per_seq": 8, "max_seq_len": 512, "max_new_tokens": 128,
    "num_eval_prompts": 4, "eval_max_new_tokens": 32, "gen_batch_size": 16, "cache_features": True,
}


def _machine_default(name: str) -> str:
    """Help text naming both defaults of a CPU_DEFAULTS flag."""
    return f"default: {getattr(TrainOptions('', '', ''), name)} on a GPU, {CPU_DEFAULTS[name]} on a CPU"


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainOptions("", "", "")
    req = parser.add_argument_group("target, data and output")
    req.add_argument("--target-model-path", required=True, help="HF-style target directory (Llama-3.x / Qwen3); "
                     "required")
    req.add_argument("--data", default="", help="JSON lines: chat `messages`, `text`, `question` or `input_ids` "
                     "(required unless --eval-only)")
    req.add_argument("--out", default="", help="output directory for the z-lab format draft checkpoint "
                     "(with --eval-only: the draft to evaluate; not needed with --responses-only)")
    arch = parser.add_argument_group("draft")
    arch.add_argument("--block-size", type=int, default=defaults.block_size)
    arch.add_argument("--num-layers", type=int, default=defaults.num_layers, help="draft decoder layers")
    arch.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                      help="target layers whose outputs feed the draft (default: z-lab's spread)")
    arch.add_argument("--intermediate-size", type=int, default=None, help="draft MLP size (default: the target's)")
    arch.add_argument("--mask-token-id", type=int, default=None,
                      help="mask token (default: an id inside the vocab the target never emits)")
    arch.add_argument("--draft-arch", choices=["dflash", "dflash2"], default=defaults.draft_arch,
                      help="dflash2: grouped dynamic causal convolutions around attention and MLP and a candidate "
                      "selector, trained with the backbone (z-lab's DFlash2DraftModel format)")
    arch.add_argument("--conv-kernel-size", type=int, default=defaults.conv_kernel_size,
                      help="dflash2: convolution taps (rows of the block before and at each row)")
    arch.add_argument("--conv-group-size", type=int, default=defaults.conv_group_size,
                      help="dflash2: channels sharing one dynamic convolution weight (must divide the hidden size)")
    arch.add_argument("--selector-rank", type=int, default=defaults.selector_rank, help="dflash2: codebook width")
    arch.add_argument("--selector-top-k", type=int, default=defaults.selector_top_k,
                      help="dflash2: candidates per draft row (the target lm_head's top k)")
    arch.add_argument("--init-from", default=None,
                      help="start from this draft checkpoint's weights (same taps): continue training; a DFlash draft "
                      "with --draft-arch dflash2 starts a DFlash2 draft that proposes what it did")
    gen = parser.add_argument_group("data generation")
    gen.add_argument("--max-new-tokens", type=int, help=f"response length cap ({_machine_default('max_new_tokens')})")
    gen.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts of --data")
    gen.add_argument("--ignore-eos", action="store_true", help="generate until --max-new-tokens (base models)")
    gen.add_argument("--system-prompt", default=None, help="system message added to `question` prompts")
    gen.add_argument("--user-suffix", default="", help="text appended to `question` prompts")
    gen.add_argument(
        "--cache-dir",
        default=None,
        help="response cache (default: under $BLOCKSPEC_CACHE or ~/.cache/blockspec); resumable",
    )
    gen.add_argument("--gen-batch-size", type=int,
                     help="finished responses per cache append; the engine runs up to min(this, 256) at once "
                     f"({_machine_default('gen_batch_size')})")
    gen.add_argument("--gen-workers", type=int, default=defaults.gen_workers,
                     help="engine processes generating the missing responses side by side on each device (a small "
                     "target decodes host-bound: several processes keep its GPU busy); each writes its own cache file")
    gen.add_argument("--mix-data", default=None, help="a second prompt file mixed into the training prompts "
                     "(e.g. `blockspec generate-prompts`' prompts.train.jsonl); `question` records get the same "
                     "--system-prompt / --user-suffix")
    gen.add_argument("--mix-ratio", type=float, default=defaults.mix_ratio,
                     help="share of the training prompts taken from --mix-data (the larger side is cut to fit)")
    gen.add_argument("--responses-only", action="store_true",
                     help="generate (and cache) the target's responses, then stop: a later run trains on the cache")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, help=f"optimizer steps ({_machine_default('steps')})")
    train.add_argument("--batch-size", type=int,
                       help=f"sequences per step (per GPU) ({_machine_default('batch_size')})")
    train.add_argument("--blocks-per-seq", type=int,
                       help=f"anchors per sequence ({_machine_default('blocks_per_seq')})")
    train.add_argument("--max-seq-len", type=int,
                       help=f"prompt + response tokens trained on ({_machine_default('max_seq_len')})")
    train.add_argument("--lr", type=float, help=f"peak learning rate ({_machine_default('lr')})")
    train.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio, help="cosine floor / lr")
    train.add_argument("--lr-schedule", choices=("steps", "time"), default=defaults.lr_schedule,
                       help="warmup + cosine over --steps, or over --max-train-minutes of wall time (then --steps is "
                       "only an upper bound: a fixed device budget ends with the rate at its floor)")
    train.add_argument("--warmup-ratio", type=float, default=defaults.warmup_ratio)
    train.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    train.add_argument("--grad-clip", type=float, default=defaults.grad_clip)
    train.add_argument("--loss-decay", type=float, default=None,
                       help="γ of the position weights exp(-(k-1)/γ) (default 7 for block 16, as DFlash)")
    train.add_argument("--cache-features", action="store_true", default=None,
                       help="keep each sequence's target features after its first use, on the device and then in "
                            "host memory within the two limits below (tokens x taps x hidden values each; skips the "
                            "target forward in later epochs; default: off on a GPU, on on a CPU)")
    train.add_argument("--feature-cache-device-gib", type=float, default=None,
                       help="--cache-features: device memory the cache may fill, in 512 MiB slabs (default: the "
                            "GPU's free memory less 24 GiB for the training step, the KV pool and evaluations; 0 on a "
                            "CPU); past it features are kept in host memory")
    train.add_argument("--feature-cache-host-gib", type=float, default=None,
                       help="--cache-features: host memory the cache may fill after the device's (default: half of "
                            "what is available at the start); past both limits features are recomputed when drawn")
    train.add_argument("--compile-draft", action="store_true",
                       help="torch.compile the draft's training forward (dynamic shapes: the context length varies "
                       "by batch); the first steps compile, inside --max-train-minutes")
    train.add_argument("--max-train-minutes", type=float, default=None,
                       help="stop training at the first step past this wall time (then save and evaluate as usual); "
                       "the learning-rate schedule spans --steps unless --lr-schedule time")
    train.add_argument("--seed", type=int, default=defaults.seed)
    ev = parser.add_argument_group("evaluation")
    ev.add_argument("--eval-every", type=int, default=0, help="steps between acceptance evals (0: only at the end)")
    ev.add_argument("--num-eval-prompts", type=int,
                    help="held-out prompts (the last N of --data unless --eval-data; half of --data when it has no "
                    f"more than N); 0 disables evals ({_machine_default('num_eval_prompts')})")
    ev.add_argument("--eval-max-new-tokens", type=int,
                    help=f"response length in evals ({_machine_default('eval_max_new_tokens')})")
    ev.add_argument("--eval-data", default=None, help="prompts for evals (default: held out from --data)")
    ev.add_argument("--eval-prompts", nargs="+", default=None, metavar="FILE",
                    help="prompt sets whose accept length is measured after training, each reported under its file "
                    "name and recorded in training_info.json (eval_runs)")
    ev.add_argument("--eval-prompts-max", type=int, default=defaults.eval_prompts_max,
                    help="prompts used from each --eval-prompts file (its first N)")
    ev.add_argument(
        "--eval-only",
        action="store_true",
        help="train nothing: measure the draft in --out on --eval-prompts and append to its training_info.json",
    )
    dev = parser.add_argument_group("device and output")
    dev.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (torchrun: cuda:LOCAL_RANK)")
    dev.add_argument("--dtype", default="auto", help="target dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    dev.add_argument("--save-dtype", default=defaults.save_dtype, help="dtype of the saved draft weights")
    dev.add_argument("--max-shard-mb", type=float, default=defaults.max_shard_mb, help="safetensors shard size cap")
    dev.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def runs_on_cpu(device: str) -> bool:
    """Whether `--device` means the CPU (auto: no CUDA device here)."""
    if device == "auto":
        import torch  # NOTE: here: --help parses no device

        return not torch.cuda.is_available()
    return device == "cpu"


def options_from_namespace(ns: argparse.Namespace) -> tuple[TrainOptions, dict[str, Union[int, float, bool]]]:
    """(the options, the CPU_DEFAULTS it took: flags left out of a CPU run); a flag left out of a GPU run keeps
    TrainOptions' default."""
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    given = {name: getattr(ns, name) for name in names if hasattr(ns, name) and getattr(ns, name) is not None}
    machine = {name: value for name, value in CPU_DEFAULTS.items() if name not in given}
    if machine and runs_on_cpu(ns.device):
        return TrainOptions(**given, **machine), machine
    return TrainOptions(**given), {}


def parse_options(argv: Optional[Sequence[str]],
                  prog: str = "blockspec train-draft") -> tuple[TrainOptions, dict[str, Union[int, float, bool]]]:
    """(options, the CPU defaults they took: options_from_namespace)."""
    parser = argparse.ArgumentParser(prog=prog, description="Train a DFlash draft for a target model.",
                                     formatter_class=DefaultsHelpFormatter)
    add_train_arguments(parser)
    return options_from_namespace(parser.parse_args(argv))
