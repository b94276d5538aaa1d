"""DFlash greedy output == target-only greedy output, batched, with chunked prefill, page sizes 1 and 16;
stops inside an accepted block; pools free afterwards; bad draft configs fail clearly."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from blockspec import Engine
from tests.support.draft_training import train_tiny_draft
from tests.support.greedy_cycle_checks import GREEDY, assert_cycle_equals_propose_then_verify, assert_pools_free
from tests.support.tiny_models import save_tiny_draft, save_tiny_model

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("dflash.model")

PROMPTS = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 33, 5, 9, 26)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dflash_lossless")
    target = save_tiny_model("llama", root / "target", residual_scale=0.3)
    save_tiny_draft(root / "random_draft", target, [0, 2], 8, num_layers=2, seed=3)
    trained = save_tiny_draft(root / "trained_draft", target, [0, 2], 8, num_layers=2, seed=4)
    train_tiny_draft(trained, target, steps=200)
    trained.save_pretrained(root / "trained_draft")
    return {"root": root, "target": target}


def engine_for(root: Path, draft: str | None, page_size: int, **extra: Any) -> Engine:
    args: dict[str, Any] = dict(
        model_path=str(root / "target"), device="cpu", dtype="float32", page_size=page_size, max_total_tokens=4096,
        chunked_prefill_size=16, skip_tokenizer_init=True,
    )
    if draft:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / draft))
    args.update(extra)
    return Engine(**args)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("draft", ["random_draft", "trained_draft"])
def test_greedy_lossless(models: dict[str, Any], page_size: int, draft: str) -> None:
    root = models["root"]
    expected = [
        o["output_ids"] for o in engine_for(root, None, page_size).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    ]
    engine = engine_for(root, draft, page_size)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == expected
    stats = engine.get_server_info()["internal_states"][0]
    assert stats["avg_spec_accept_length"] >= 1.0
    if draft == "trained_draft":
        assert stats["avg_spec_accept_length"] > 1.5
    for o in outputs:
        assert o["meta_info"]["spec_verify_ct"] >= 1
    assert_pools_free(engine)


def test_small_pool_retracts_and_stays_lossless(models: dict[str, Any]) -> None:
    root = models["root"]
    expected = [o["output_ids"] for o in engine_for(root, None, 4).generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    engine = engine_for(root, "trained_draft", 4, max_total_tokens=160)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == expected
    assert engine.get_server_info()["internal_states"][0]["num_retractions"] > 0
    assert_pools_free(engine)


def mid_block_stop(output: list[int], cycle_lengths: list[int], unique: bool) -> int | None:
    """An output index of an accepted draft token that is not its cycle's last (the stop cuts an accepted block)."""
    start = 1  # output[0] comes from prefill
    for n in cycle_lengths:
        for k in range(start, start + n - 1):  # every committed token but the cycle's bonus
            if not unique or output[k] not in output[:k]:
                return k
        start += n
    return None


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids", "max_new_tokens"])
def test_stop_inside_accepted_block(models: dict[str, Any], stop_kind: str) -> None:
    root = models["root"]
    engine = engine_for(root, "trained_draft", 1)
    reqs, _ = engine.make_requests(input_ids=PROMPTS, sampling_params=GREEDY)
    for req in reqs:
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work:
        engine.step()
    hits = 0
    for prompt, req in zip(PROMPTS, reqs):
        k = mid_block_stop(req.output_ids, req.spec_accept_lengths, unique=stop_kind != "max_new_tokens")
        if k is None:
            continue
        stop_token = req.output_ids[k]
        params: dict[str, Any] = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
        baseline = engine_for(root, None, 1)
        if stop_kind == "eos":
            params["ignore_eos"] = False
            baseline.scheduler.eos_token_ids = engine.scheduler.eos_token_ids = {stop_token}
        elif stop_kind == "stop_token_ids":
            params["stop_token_ids"] = [stop_token]
        else:
            params["max_new_tokens"] = k + 1
        want = baseline.generate(input_ids=prompt, sampling_params=params)
        got = engine.generate(input_ids=prompt, sampling_params=params)
        assert got["output_ids"] == want["output_ids"] == req.output_ids[: k + 1]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        expected_type = "length" if stop_kind == "max_new_tokens" else "stop"
        assert got["meta_info"]["finish_reason"]["type"] == expected_type
        hits += 1
    assert hits >= 3
    assert_pools_free(engine)


def write_draft_config(root: Path, name: str, **changes: Any) -> Path:
    source = root / "trained_draft"
    target = root / name
    target.mkdir(exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_config."):
            raw["dflash_config"][key.split(".", 1)[1]] = value
        elif value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (target / "config.json").write_text(json.dumps(raw))
    for weights in source.glob("*.safetensors"):
        (target / weights.name).write_bytes(weights.read_bytes())
    return target


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"dflash_config.mask_token_id": 5000}, "mask_token_id"),
        ({"dflash_config.target_layer_ids": [0, 9]}, "target_layer_ids"),
        ({"hidden_size": 48}, "hidden_size"),
        ({"conv_kernel_size": 4}, "DFlash2 draft config lacks 'conv_group_size'"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2 draft config lacks 'conv_kernel_size'"),
    ],
)
def test_bad_draft_config_fails_clearly(models: dict[str, Any], changes: dict[str, Any], message: str) -> None:
    root = models["root"]
    name = "bad_" + "_".join(k.replace(".", "_") for k in changes)
    write_draft_config(root, name, **changes)
    with pytest.raises(ValueError, match=message):
        engine_for(root, name, 1)


def test_missing_layer_ids_use_default_spread(models: dict[str, Any]) -> None:
    from blockspec.models.draft_config import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(8, 1) == [4]
    root = models["root"]
    write_draft_config(root, "no_layer_ids", **{"dflash_config.target_layer_ids": None})
    raw = json.loads((root / "no_layer_ids" / "config.json").read_text())
    raw["dflash_config"].pop("target_layer_ids")
    (root / "no_layer_ids" / "config.json").write_text(json.dumps(raw))
    engine = engine_for(root, "no_layer_ids", 1)
    assert engine.worker.capture == (1, 1) or len(engine.worker.capture) == 2  # type: ignore[attr-defined]


def test_greedy_cycle_equals_propose_then_verify(models: dict[str, Any]) -> None:
    """The one-graph greedy cycle (run eagerly here) gives the two-step path's proposals and target argmax."""
    assert_cycle_equals_propose_then_verify(engine_for(models["root"], "trained_draft", 4), PROMPTS[:5])


def test_simulated_accept_len_commits_that_many(models: dict[str, Any]) -> None:
    engine = engine_for(models["root"], "random_draft", 1, speculative_simulate_accept_len=3.0)
    outputs = engine.generate(input_ids=PROMPTS[:3], sampling_params={**GREEDY, "max_new_tokens": 31})
    assert [len(o["output_ids"]) for o in outputs] == [31] * 3
    for o in outputs:
        assert o["meta_info"]["spec_verify_ct"] == 10  # 1 token from prefill, then 3 per cycle
    assert_pools_free(engine)


def test_fused_rope_kv_store_is_lossless(models: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's one-launch rope + K/V store (Triton interpreter on CPU) in target, draft and draft context:
    DFlash output equals target-only output, and the draft proposes as it does without the fused kernel."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "forces the Triton kernel onto CPU tensors: needs the interpreter (with CUDA the GPU tests cover it)"
        )
    root = models["root"]
    prompts, params = PROMPTS[:4], {**GREEDY, "max_new_tokens": 12}
    expected = [o["output_ids"] for o in engine_for(root, None, 4).generate(input_ids=prompts, sampling_params=params)]
    unfused = engine_for(root, "trained_draft", 4).generate(input_ids=prompts, sampling_params=params)
    import blockspec.layers.rotary as rotary

    monkeypatch.setattr(rotary, "use_triton", lambda x: True)
    engine = engine_for(root, "trained_draft", 4)
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outputs] == expected
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == [o["meta_info"]["spec_verify_ct"] for o in unfused]
    assert_pools_free(engine)
