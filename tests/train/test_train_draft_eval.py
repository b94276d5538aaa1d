"""`blockspec train-draft` on a tiny target: --mix-data / --mix-ratio, --responses-only, --eval-prompts (per-set accept
length recorded in training_info.json's eval_runs), --eval-only appending to it, held-out files refused as training
data, and the draft description the demo prints (CPU, fp32)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from blockspec import cli as blockspec_cli
from blockspec.demo.gsm8k_demo import draft_description
from blockspec.models.smollm2 import DEMO_DRAFT_DIR
from blockspec.train.data import mix_counts, mix_records, ratio_taking_all
from blockspec.train.info import describe_draft, git_commit, latest_measurements, read_info
from blockspec.train.options import TrainOptions
from blockspec.train.pipeline import run
from tests.support.tiny_models import save_tiny_model


def write_ids(path: Path, first: int, count: int, split: str | None = None) -> Path:
    extra = {"split": split} if split else {}
    path.write_text(
        "".join(
            json.dumps({"input_ids": [i % 90 + 3, i % 7 + 3, 5], **extra}) + "\n" for i in range(first, first + count)
        )
    )
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("train_eval") / "target"
    save_tiny_model("llama", path, residual_scale=0.3)
    return path


def base_argv(target: Path, root: Path) -> list[str]:
    return [
        "--target-model-path",
        str(target),
        "--out",
        str(root / "draft"),
        "--cache-dir",
        str(root / "cache"),
        "--device",
        "cpu",
        "--block-size",
        "4",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--no-progress",
        "--num-eval-prompts",
        "0",
    ]


def test_mix_records_takes_the_ratio() -> None:
    main = [{"question": f"m{i}"} for i in range(10)]
    extra = [{"question": f"e{i}"} for i in range(30)]
    assert mix_records(main, extra, 0.5) == main + extra[:10]
    assert mix_records(main, extra, 0.75) == main + extra[:30]
    assert mix_records(main, extra[:5], 0.5) == main[:5] + extra[:5]  # too few extra prompts: main is cut
    assert mix_records(main, extra, 0.2) == main + extra[:2]
    sizes = [(1, 1), (3, 100_000), (22_419, 9_000), (22_419, 27_000), (100_000, 3), (7, 7)]
    assert all(mix_counts(m, e, ratio_taking_all(m, e)) == (m, e) for m, e in sizes)  # every record of both


def test_mixed_training_with_prompt_sets_and_eval_only(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_ids(tmp_path / "main.jsonl", 0, 12)
    mix = write_ids(tmp_path / "generated.jsonl", 100, 20)
    sets = [
        write_ids(tmp_path / "set_a.jsonl", 200, 5, "heldout"),
        write_ids(tmp_path / "set_b.jsonl", 300, 9, "heldout"),
    ]
    argv = [
        "train-draft",
        *base_argv(target, tmp_path),
        "--data",
        str(data),
        "--mix-data",
        str(mix),
        "--mix-ratio",
        "0.6",
        "--num-eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "8",
        "--eval-prompts",
        *map(str, sets),
        "--eval-prompts-max",
        "6",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--save-dtype",
        "float32",
    ]
    assert blockspec_cli.main(["train-draft", *argv[1:], "--responses-only"]) == 0
    assert "25 responses cached" in capsys.readouterr().out  # 10 of main (2 held out) + 15 generated (0.6 of 25)
    assert not (tmp_path / "draft").exists()
    assert blockspec_cli.main(argv) == 0
    assert "set_a accept length" in capsys.readouterr().out
    info = read_info(tmp_path / "draft")
    assert info["responses_generated"] == 0 and info["train_sequences"] == 25  # the first run cached every response
    (after_training,) = info["eval_runs"]
    assert after_training["kind"] == "after_training" and list(after_training["sets"]) == ["set_a", "set_b"]
    assert [after_training["sets"][n]["prompts"] for n in ("set_a", "set_b")] == [5, 6]  # set_b: its first 6
    assert all(r["accept_length"] >= 1.0 and r["verify_steps"] > 0 for r in after_training["sets"].values())

    only = [
        "train-draft",
        "--target-model-path",
        str(target),
        "--out",
        str(tmp_path / "draft"),
        "--device",
        "cpu",
        "--ignore-eos",
        "--eval-only",
        "--eval-prompts",
        str(sets[1]),
        "--eval-max-new-tokens",
        "8",
        "--eval-prompts-max",
        "6",
    ]
    assert blockspec_cli.main(only) == 0
    runs = read_info(tmp_path / "draft")["eval_runs"]
    assert [r["kind"] for r in runs] == ["after_training", "eval_only"] and list(runs[1]["sets"]) == ["set_b"]
    # NOTE: the same saved draft, fp32, the same prompts: the standalone eval measures what training recorded
    assert runs[1]["sets"]["set_b"]["accept_length"] == after_training["sets"]["set_b"]["accept_length"]
    assert [m.prompt_set for m in latest_measurements(read_info(tmp_path / "draft"))] == ["set_b"]
    description = describe_draft(tmp_path / "draft")
    assert (
        "1 layers, block 4" in description
        and f"set_b {runs[1]['sets']['set_b']['accept_length']:.2f} (6 prompts, cpu)" in description
    )


def test_heldout_files_are_never_trained_on(target: Path, tmp_path: Path) -> None:
    heldout = write_ids(tmp_path / "heldout.jsonl", 0, 6, "heldout")
    plain = write_ids(tmp_path / "plain.jsonl", 50, 6)
    common = dict(target_model_path=str(target), out=str(tmp_path / "draft"), device="cpu", num_eval_prompts=0)
    with pytest.raises(ValueError, match="held-out split"):
        run(TrainOptions(data=str(heldout), **common))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="held-out split"):
        run(TrainOptions(data=str(plain), mix_data=str(heldout), **common))  # type: ignore[arg-type]
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--eval-only"], "--eval-only needs --eval-prompts"),
        (["--eval-only", "--eval-prompts", "{plain}"], "no draft checkpoint"),
        (["--data", "{plain}", "--eval-prompts", "{plain}", "{other}/plain.jsonl"], "several files are named plain"),
        (["--data", "{plain}", "--eval-prompts", "{missing}"], "--eval-prompts .*missing.jsonl: no such file"),
        (["--data", "{plain}", "--mix-data", "{plain}", "--mix-ratio", "1"], "--mix-ratio must be in"),
        (["--eval-prompts", "{plain}"], "--data is required"),
        (["--data", "{plain}", "--lr-schedule", "time"], "--lr-schedule time spans --max-train-minutes"),
    ],
)
def test_bad_eval_and_mix_flags_fail_clearly(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    plain = write_ids(tmp_path / "plain.jsonl", 0, 6)
    (tmp_path / "other").mkdir()
    write_ids(tmp_path / "other" / "plain.jsonl", 0, 6)
    names = {"plain": str(plain), "other": str(tmp_path / "other"), "missing": str(tmp_path / "missing.jsonl")}
    argv = ["train-draft", *base_argv(target, tmp_path), *[e.format(**names) for e in extra]]
    assert blockspec_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "blockspec train-draft: error:" in err
    assert re.search(message, err), err


def test_time_schedule_ends_training_at_the_budget(target: Path, tmp_path: Path) -> None:
    data = write_ids(tmp_path / "main.jsonl", 0, 8)
    options = TrainOptions(
        target_model_path=str(target), data=str(data), out=str(tmp_path / "draft"), cache_dir=str(tmp_path / "cache"),
        device="cpu", block_size=4, max_new_tokens=12, ignore_eos=True, num_eval_prompts=0, batch_size=2,
        steps=1_000_000, lr_schedule="time", max_train_minutes=0.01, progress=False,
    )
    result = run(options)
    assert 1 <= result.steps < 1_000_000  # the 0.6 s budget ended it, not --steps
    assert read_info(tmp_path / "draft")["options"]["lr_schedule"] == "time"


def test_demo_describes_its_draft(tmp_path: Path) -> None:
    description = draft_description(DEMO_DRAFT_DIR)
    info: dict[str, Any] = read_info(DEMO_DRAFT_DIR)
    expected = info["eval_runs"][-1] if info.get("eval_runs") else info["result"]["evals"][-1]
    assert str(DEMO_DRAFT_DIR) in description and "block 16" in description
    accepts = list(expected["sets"].values()) if "sets" in expected else [expected]
    assert all(f"{a['accept_length']:.2f}" in description for a in accepts)
    with pytest.raises(SystemExit, match="no draft checkpoint"):
        draft_description(tmp_path)


def test_git_commit_prefers_the_named_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device's copy of the tree may hold a stale .git: $BLOCKSPEC_COMMIT names the code that ran."""
    monkeypatch.setenv("BLOCKSPEC_COMMIT", "1ce39de")
    assert git_commit() == "1ce39de"
    monkeypatch.delenv("BLOCKSPEC_COMMIT")
    assert git_commit() != "1ce39de"
