"""`blockspec train-draft` for a newcomer (issue 53, finding 4): CPU-sized defaults for flags left out of a CPU run,
--num-eval-prompts clamped to what --data holds, a progress bar for each phase (responses, training, the evaluation
after a timed run), and Ctrl-C during training leaves a loadable checkpoint and its training_info.json."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockspec import cli as blockspec_cli
from blockspec.models.config import load_target_config
from blockspec.train.checkpoint import load_trainable_draft
from blockspec.train.options import CPU_DEFAULTS, TrainOptions, parse_options
from blockspec.train.pipeline import held_out_count
from tests.support.tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, count: int) -> None:
    generator = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"input_ids": torch.randint(3, 95, (6,), generator=generator).tolist()}) + "\n")


def test_a_cpu_run_takes_cpu_defaults_for_the_flags_left_out() -> None:
    options, taken = parse_options(["--target-model-path", "t", "--device", "cpu", "--steps", "7"])
    assert options.steps == 7 and "steps" not in taken
    assert options.batch_size == CPU_DEFAULTS["batch_size"] == taken["batch_size"]
    assert options.max_new_tokens == CPU_DEFAULTS["max_new_tokens"] and options.cache_features is True
    assert options.lr == CPU_DEFAULTS["lr"] != TrainOptions("", "", "").lr
    gpu, taken = parse_options(["--target-model-path", "t", "--device", "cuda"])
    assert taken == {} and gpu.steps == TrainOptions("", "", "").steps and gpu.cache_features is False
    assert gpu.lr == TrainOptions("", "", "").lr
    assert parse_options(["--target-model-path", "t", "--device", "cpu", "--lr", "2e-4"])[0].lr == 2e-4


def test_held_out_prompts_never_take_every_prompt() -> None:
    assert held_out_count(16, 10) == 5 and held_out_count(4, 10) == 4 and held_out_count(3, 1) == 0


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("newcomer_target")
    save_tiny_model("llama", root / "target", residual_scale=0.3)
    return root / "target"


def test_timed_run_on_few_prompts_shows_every_phase(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 10)
    argv = ["train-draft", "--target-model-path", str(target), "--data", str(tmp_path / "prompts.jsonl"),
            "--out", str(tmp_path / "draft"), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
            "--block-size", "4", "--target-layer-ids", "0", "2", "--max-new-tokens", "16", "--ignore-eos",
            "--num-eval-prompts", "16", "--eval-max-new-tokens", "8", "--max-train-minutes", "0.001",
            "--save-dtype", "float32"]
    with caplog.at_level(logging.WARNING):
        assert blockspec_cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "--num-eval-prompts 16: --data holds only 10 prompts; holding out half of them (5)" in caplog.text
    assert "a CPU run: --steps 300 --lr 0.001 --batch-size 4" in err
    assert "--gen-batch-size 16 --cache-features (CPU" in err
    for phase in ("generating responses: 100%", "training draft:", "evaluating draft: 100%"):
        assert phase in err, phase
    info = json.loads((tmp_path / "draft" / "training_info.json").read_text())
    assert info["held_out_prompts"] == 5 and info["result"]["interrupted"] is False


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT as in a terminal's foreground job. NOTE: a suite started in the background of a
    non-interactive shell (`make test &`) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored, so the
    child would never see the simulated Ctrl-C and train on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_during_training_saves_a_loadable_checkpoint(target: Path, tmp_path: Path) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 12)
    out = tmp_path / "draft"
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockspec.train.cli", "--target-model-path", str(target), "--data",
         str(tmp_path / "prompts.jsonl"), "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
         "--block-size", "4", "--target-layer-ids", "0", "2", "--max-new-tokens", "16", "--ignore-eos",
         "--steps", "1000000", "--num-eval-prompts", "0", "--save-dtype", "float32", "--no-progress"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=_terminal_sigint)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # NOTE: the log line that opens the training loop
            if "training on" in line and "sequences" in line:
                break
        else:
            raise AssertionError(f"training never started: {proc.wait()}")
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert stdout.startswith(f"interrupted: saved {out} after "), stdout
    info = json.loads((out / "training_info.json").read_text())
    assert info["result"]["interrupted"] is True and info["result"]["steps"] >= 1
    draft, layer_ids, _ = load_trainable_draft(str(out), load_target_config(str(target)))
    assert layer_ids == [0, 2] and all(torch.isfinite(p).all() for p in draft.parameters())


def test_generate_iter_reports_tokens_every_step(target: Path) -> None:
    from blockspec import Engine

    engine = Engine(model_path=str(target), device="cpu", dtype="float32", skip_tokenizer_init=True,
                    max_total_tokens=1024)
    counts: list[int] = []
    try:
        outputs = [out for _, out in engine.generate_iter([[5, 6, 7], [8, 9]], {"max_new_tokens": 6,
                                                                                  "ignore_eos": True}, counts.append)]
    finally:
        engine.shutdown()
    assert counts == sorted(counts) and len(counts) >= 6  # NOTE: one count per engine step, as the tokens grow
    assert counts[-1] == sum(len(out["output_ids"]) for out in outputs) == 12


def test_token_postfix_shows_tokens_and_rate() -> None:
    from tqdm import tqdm

    from blockspec.train.token_progress import TokenPostfix

    with tqdm(total=4, disable=False) as bar:
        TokenPostfix(bar, redraw_interval_s=0.0)(120)
        assert bar.postfix is not None and bar.postfix.startswith("120 tokens, ") and "token/s" in bar.postfix
