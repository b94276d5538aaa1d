"""`blockspec train-draft --gen-workers N`: N engine processes generate the target's responses side by side, each its
own share into its own cache file, and the cache then holds exactly what one engine generates (CPU, fp32)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from blockspec import Engine, cli as blockspec_cli
from blockspec.train.data import ResponseCache, cached_samples
from blockspec.train.options import TrainOptions
from blockspec.train.pipeline import cache_responses
from tests.support.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("response_workers") / "target"
    save_tiny_model("llama", path, residual_scale=0.3)
    return path


def test_workers_split_the_prompts_and_match_one_engine(target: Path, tmp_path: Path) -> None:
    prompts = [[3 + i, 4 + i, 5 + (i * 7) % 11] for i in range(9)] + [[3, 4, 5]]  # NOTE: the last repeats the first
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    cache_dir = tmp_path / "cache"
    options = TrainOptions(target_model_path=str(target), data=str(data), out="", cache_dir=str(cache_dir),
                           max_new_tokens=10, ignore_eos=True, num_eval_prompts=0, device="cpu", progress=False,
                           responses_only=True, gen_workers=2, gen_batch_size=4)
    total, generated = cache_responses(options)
    assert (total, generated) == (len(prompts), len(prompts) - 1)  # NOTE: the repeated prompt is generated once
    files = sorted(p.name for p in cache_dir.glob("responses.rank*.jsonl"))
    assert files == ["responses.rank0-0.jsonl", "responses.rank0-1.jsonl"]
    shares = [
        sorted(json.loads(line)["index"] for line in (cache_dir / name).read_text().splitlines()) for name in files
    ]
    assert shares == [[0, 2, 4, 6, 8], [1, 3, 5, 7]]  # NOTE: index ≡ worker (mod 2); the repeated prompt once
    meta = json.loads((cache_dir / "meta.json").read_text())
    samples = cached_samples(prompts, ResponseCache(cache_dir, meta))
    with Engine(model_path=str(target), device="cpu", dtype="float32", skip_tokenizer_init=True,
                max_total_tokens=512) as oracle:
        reference: Any = oracle.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                                             "ignore_eos": True})
    assert [s.output_ids for s in samples] == [r["output_ids"] for r in reference]
    assert cache_responses(options) == (len(prompts), 0)  # all cached: no worker generates anything


def test_bad_worker_count_fails_clearly(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input_ids": [3, 4]}) + "\n")
    argv = ["train-draft", "--target-model-path", str(target), "--data", str(data), "--responses-only",
            "--gen-workers", "0", "--device", "cpu"]
    assert blockspec_cli.main(argv) == 2
    assert "--gen-workers must be >= 1" in capsys.readouterr().err
