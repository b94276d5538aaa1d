"""Pieces of `blockspec train-draft`: block batches, the training forward against the `dflash` reference, target
features against HF, the resumable response cache, input errors and the CLI entry points (CPU, fp32)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from blockspec import Engine, cli as blockspec_cli
from blockspec.models.config import load_target_config
from blockspec.train import cli as train_cli
from blockspec.train.blocks import IGNORE, block_loss, build_block_batch, loss_weights, sample_anchors
from blockspec.train.checkpoint import draft_config_dict, save_draft
from blockspec.train.data import ResponseCache, default_mask_token_id, generate_responses, read_prompt_records
from blockspec.train.features import TargetFeatures
from blockspec.train.model import DraftArch, TrainableDraft
from blockspec.train.options import TrainOptions, resolve_layer_ids
from blockspec.train.pipeline import run
from tests.support.tiny_models import save_tiny_model

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("train_parts") / "target"
    return path, save_tiny_model("llama", path, residual_scale=0.3)


def test_block_batch_layout() -> None:
    seq = list(range(10, 30))  # 20 tokens, prompt = first 5
    feats = [torch.arange(20, dtype=torch.float32)[:, None].expand(20, 3)]
    batch = build_block_batch([seq], feats, [[5, 17]], block_size=4, mask_token_id=99, device=torch.device("cpu"))
    assert batch.block_ids.tolist() == [[[15, 99, 99, 99], [27, 99, 99, 99]]]
    assert batch.labels.tolist() == [[[16, 17, 18], [28, 29, IGNORE]]]  # labels stop at the sequence end
    assert batch.positions.tolist() == [[5, 6, 7, 8, 17, 18, 19, 20]]
    mask = batch.mask[0]
    assert mask.shape == (8, 20 + 8)
    assert mask[:4, :20].sum(1).tolist() == [5] * 4 and mask[4:, :20].sum(1).tolist() == [17] * 4  # context < anchor
    assert mask[:4, 20:24].all() and not mask[:4, 24:].any()  # own block only, non-causal
    assert mask[4:, 24:].all() and not mask[4:, 20:24].any()
    anchors = sample_anchors(5, 20, 100, torch.Generator().manual_seed(0))
    assert anchors == list(range(5, 19))  # every response token with at least one label


def test_training_forward_matches_reference(target: tuple[Path, Any], tmp_path: Path) -> None:
    """Many blocks in one masked forward == the `dflash` reference run block by block on the saved checkpoint."""
    dflash_model = pytest.importorskip("dflash.model")
    path, _ = target
    config = load_target_config(path)
    layer_ids = [0, 2]
    torch.manual_seed(3)
    draft = TrainableDraft(DraftArch.from_target(config, 2, len(layer_ids), None))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # NOTE: norms at 1 would hide a swapped norm
    save_draft(draft, tmp_path, draft_config_dict(draft.arch, config, layer_ids, 4, 95, "float32"), "float32")
    reference = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    features_of = TargetFeatures(path, layer_ids, torch.device("cpu"), torch.float32, 64)
    seqs = [list(range(3, 33)), list(range(40, 62))]
    feats = features_of(seqs)
    anchors = [[4, 11, 25], [7, 19]]
    batch = build_block_batch(seqs, feats, anchors, 4, 95, torch.device("cpu"))
    embeds = torch.nn.functional.embedding(batch.block_ids, features_of.embed_weight).flatten(1, 2)
    with torch.no_grad():
        hidden = draft(embeds, batch.positions, batch.features, batch.mask).view(2, 3, 4, -1)
        for i, picks in enumerate(anchors):
            for j, a in enumerate(picks):
                ref = reference(
                    position_ids=torch.arange(a + 4)[None], noise_embedding=embeds[i, j * 4:(j + 1) * 4][None],
                    target_hidden=feats[i][None, :a],
                )
                torch.testing.assert_close(hidden[i, j], ref[0], atol=1e-5, rtol=1e-5)


def test_padded_context_changes_nothing(target: tuple[Path, Any]) -> None:
    """CUDA training pads the context to a multiple (fewer attention shapes): same loss and gradients, fp32."""
    path, _ = target
    config = load_target_config(path)
    torch.manual_seed(5)
    draft = TrainableDraft(DraftArch.from_target(config, 2, 2, None))
    features_of = TargetFeatures(path, [0, 2], torch.device("cpu"), torch.float32, 64)
    seqs = [list(range(3, 33)), list(range(40, 62))]
    feats, anchors = features_of(seqs), [[4, 11, 25], [7, 19]]
    results = []
    for multiple in (1, 16):
        batch = build_block_batch(seqs, feats, anchors, 4, 95, torch.device("cpu"), context_multiple=multiple)
        assert batch.features.shape[1] == (30 if multiple == 1 else 32)
        embeds = torch.nn.functional.embedding(batch.block_ids, features_of.embed_weight).flatten(1, 2)
        draft.zero_grad()
        loss = block_loss(draft(embeds, batch.positions, batch.features, batch.mask), batch, features_of.lm_head_weight,
                          loss_weights(4, 7.0)).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in draft.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for unpadded, padded in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(unpadded, padded, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_features_are_layer_outputs(target: tuple[Path, Any], backend: str) -> None:
    """Against HF's hidden states, with either attention backend (Triton is what CUDA training uses)."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach Triton only under the interpreter (set where CUDA is absent)")
    path, model = target
    features_of = TargetFeatures(path, [0, 2], torch.device("cpu"), torch.float32, 64, attention_backend=backend)
    seqs = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 71))]
    for seq, feats in zip(seqs, features_of(seqs)):
        with torch.no_grad():
            hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(feats, torch.cat([hidden[1][0], hidden[3][0]], dim=-1), atol=1e-5, rtol=1e-5)


def test_response_cache_resumes(target: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = target
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
    built: list[Engine] = []

    def make_engine() -> Engine:
        built.append(
            Engine(model_path=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=512)
        )
        return built[-1]

    meta = {"max_new_tokens": 12}

    def generate(cache_meta: dict[str, Any] = meta, todo: list[list[int]] = prompts) -> tuple[list[Any], int]:
        return generate_responses(
            todo, ResponseCache(tmp_path, cache_meta), make_engine, 12, True, batch_size=4, progress=False
        )

    first, generated = generate()
    assert generated == len(prompts) and len(built) == 1
    assert built[0].is_shut_down  # NOTE: generate_responses hands its engine's memory back
    with Engine(
        model_path=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=512
    ) as oracle:
        reference = oracle.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        )
        lengths = [{"temperature": 0, "max_new_tokens": 2 + 3 * i, "ignore_eos": True} for i in range(len(prompts))]
        streamed = list(oracle.generate_iter(prompts, lengths))  # NOTE: finish order: the shortest first
        assert [i for i, _ in streamed] == list(range(len(prompts)))
        assert [len(out["output_ids"]) for _, out in streamed] == [2 + 3 * i for i in range(len(prompts))]
    with Engine(model_path=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=512,
                max_running_requests=1) as narrow:  # NOTE: 4 queued at a time, topped up as each finishes
        assert [i for i, _ in narrow.generate_iter(prompts, lengths)] == list(range(len(prompts)))
        with pytest.raises(RuntimeError, match="left the scheduler unreported"):
            for _ in narrow.generate_iter(prompts, lengths):
                narrow.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 40, "ignore_eos": True})
    assert isinstance(reference, list)
    assert [s.output_ids for s in first] == [r["output_ids"] for r in reference]
    again, generated = generate()
    assert generated == 0 and len(built) == 1 and again == first  # all cached: no engine built
    cache_file = tmp_path / "responses.rank0.jsonl"
    lines = cache_file.read_text().splitlines(keepends=True)
    cache_file.write_text("".join(lines[:2]) + lines[2][:10])  # a run killed mid-write
    resumed, generated = generate()
    assert generated == len(prompts) - 2 and resumed == first
    with pytest.raises(ValueError, match="cache .* was made with"):
        generate({"max_new_tokens": 99})
    changed, generated = generate(todo=[prompts[3], [42], prompts[0], [42]])  # reordered, one new prompt twice
    assert generated == 1 and len(built) == 3  # NOTE: keyed by the prompt's ids: only [42] is new, generated once
    assert [s.index for s in changed] == [0, 1, 2, 3] and [s.prompt_ids for s in changed] == [
        prompts[3],
        [42],
        prompts[0],
        [42],
    ]
    assert changed[0].output_ids == first[3].output_ids and changed[2].output_ids == first[0].output_ids
    assert changed[1].output_ids == changed[3].output_ids and len(changed[1].output_ids) == 12
    again, generated = generate()
    assert generated == 0 and again == first  # the old prompts' responses are still there


def test_training_run_reuses_cached_responses(target: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = target
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n" for i in range(3, 13)))
    options = dict(
        target_model_path=str(path), data=str(data), out=str(tmp_path / "draft"), cache_dir=str(tmp_path / "cache"),
        block_size=4, max_new_tokens=16, ignore_eos=True, steps=6, batch_size=2, blocks_per_seq=2, num_eval_prompts=2,
        eval_max_new_tokens=8, device="cpu", progress=False, cache_features=True,
    )
    generated, steps = [], []
    for time_limit in (None, 1e-9):  # NOTE: the second run stops after its first step (--max-train-minutes)
        run(TrainOptions(**options, max_train_minutes=time_limit))  # type: ignore[arg-type]
        with open(tmp_path / "draft" / "training_info.json") as f:
            info = json.load(f)
        generated.append(info["responses_generated"])
        steps.append(info["result"]["steps"])
    assert generated == [8, 0]
    assert steps == [6, 1]
    with open(tmp_path / "draft" / "config.json") as f:
        config = json.load(f)
    assert config["dflash_config"]["target_layer_ids"] == [2]  # z-lab's default for one draft layer: L // 2


def test_torchrun_trains_with_ddp(target: tuple[Path, Any], tmp_path: Path) -> None:
    """Two CPU ranks (gloo): each generates its shard of the responses, DDP trains, rank 0 saves and evaluates."""
    path, _ = target
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i, i + 1]}) + "\n" for i in range(3, 13)))
    args = [
        "--target-model-path",
        str(path),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "draft"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--block-size",
        "4",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--num-eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "blockspec.train.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [len((tmp_path / "cache" / f"responses.rank{r}.jsonl").read_text().splitlines()) for r in (0, 1)] == [4, 4]
    with open(tmp_path / "draft" / "training_info.json") as f:
        info = json.load(f)
    assert info["world_size"] == 2 and info["result"]["evals"][-1]["accept_length"] >= 1.0


@pytest.mark.parametrize(
    "changes,error,message",
    [
        ({"data": "missing.jsonl"}, FileNotFoundError, "missing.jsonl"),
        ({"block_size": 1}, ValueError, "--block-size must be >= 2"),
        ({"target_layer_ids": [1, 4]}, ValueError, r"layer id\(s\) \[4\] out of range; the target has 4 layers"),
        ({"mask_token_id": 96}, ValueError, "outside the target vocabulary"),
        ({"steps": 0}, ValueError, "--steps must be >= 1"),
        ({"max_train_minutes": 0}, ValueError, "--max-train-minutes must be > 0"),
        ({"target_model_path": "nowhere"}, FileNotFoundError, "nowhere"),
    ],
)
def test_bad_inputs_fail_clearly(
    target: tuple[Path, Any], tmp_path: Path, changes: dict[str, Any], error: type, message: str
) -> None:
    path, _ = target
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5, 6, 7]}) + "\n" for _ in range(5)))
    options = {"target_model_path": str(path), "data": str(data), "out": str(tmp_path / "out"), "device": "cpu"}
    options.update({k: (str(tmp_path / v) if k == "data" else v) for k, v in changes.items()})
    with pytest.raises(error, match=message):
        run(TrainOptions(**options))  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_bad_data_lines_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_prompt_records(bad)
    bad.write_text('{"question": "ok"}\n{"answer": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a record needs one of messages, text, question, input_ids"):
        read_prompt_records(bad)


def test_cli_reports_errors_and_help(
    target: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = target
    argv = ["--target-model-path", str(path), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]
    assert blockspec_cli.main(["train-draft", *argv]) == 2
    assert "blockspec train-draft: error: --data" in capsys.readouterr().err
    assert train_cli.main([*argv[:4], "--out", str(tmp_path / "o"), "--block-size", "1"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        blockspec_cli.main(["train-draft", "--help"])
    assert exit_info.value.code == 0 and "--target-layer-ids" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        blockspec_cli.main(["--help"])
    assert "train-draft" in capsys.readouterr().out
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "blockspec.train.cli", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and "--mask-token-id" in done.stdout


class FakeTokenizer:
    def __init__(self, size: int, specials: dict[int, bool]) -> None:
        self.size = size
        self.added_tokens_decoder = {i: type("Tok", (), {"special": s})() for i, s in specials.items()}
        self.all_special_ids = [0, 1, 2]
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = 1, 2, 2, 0

    def __len__(self) -> int:
        return self.size


def test_default_mask_token_id() -> None:
    assert default_mask_token_id(FakeTokenizer(90, {}), 96, set()) == 90  # first embedding row past the tokenizer
    tokenizer = FakeTokenizer(96, {0: True, 1: True, 2: True, 3: True, 4: True, 5: False})
    assert default_mask_token_id(tokenizer, 96, set()) == 4  # highest unused special token
    assert default_mask_token_id(tokenizer, 96, {4}) == 3
    assert default_mask_token_id(None, 96, {95, 94}) == 93


def test_default_layer_ids_follow_zlab(target: tuple[Path, Any]) -> None:
    config = load_target_config(target[0])
    assert resolve_layer_ids(TrainOptions("", "", "", num_layers=1), config) == [2]
    assert resolve_layer_ids(TrainOptions("", "", "", target_layer_ids=[3, 0]), config) == [3, 0]
