"""--enable-deterministic-inference end to end on CPU (Triton kernels under TRITON_INTERPRET=1), fp16, a tiny Llama
target and a trained tiny DFlash draft: the target's logits of the same tokens are bit-identical as target-only
decode steps, as an extend chunk and as DFlash verify rows at batch sizes 3 and 1 (without the flag they are not);
greedy DFlash output equals target-only output and does not change with the batch size (3, 2, 1). Plus what the flag
requires: the Triton backend, tp_size 1, the interpreter on CPU; clear errors otherwise; /server_info shows it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("triton")
pytest.importorskip("dflash.model")

from blockspec import Engine  # noqa: E402
from blockspec.config.engine_config import EngineConfig  # noqa: E402
from blockspec.server.args import parse_serve_args  # noqa: E402
from tests.support.determinism_checks import logits_by_path, mismatched_rows  # noqa: E402

PROMPTS = [[5 + i for i in range(n)] for n in (3, 14, 37)]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
DETERMINISTIC = dict(dtype="float16", enable_deterministic_inference=True, triton_attention_split_tile_size=32,
                     chunked_prefill_size=16, page_size=4)
VOCAB = 96


def engines(make_engine: Callable[..., Engine], root: Path, **flags: Any) -> tuple[Engine, Engine]:
    """(target-only, DFlash) engines on the trained pair with `flags`."""
    target_only = make_engine(root / "target", **flags)
    dflash = make_engine(root / "target", speculative_algorithm="DFLASH",
                         speculative_draft_model_path=str(root / "draft"), **flags)
    return target_only, dflash


def test_logits_are_bit_identical_across_paths(make_engine: Callable[..., Engine], trained_pair: dict) -> None:
    target_only, dflash = engines(make_engine, trained_pair["root"], **DETERMINISTIC)
    paths = logits_by_path(target_only, dflash, PROMPTS, 8, VOCAB)
    assert paths["decode"].shape == (3, 8, VOCAB)
    assert mismatched_rows(paths) == {"extend": 0, "verify": 0, "verify_bs1": 0}


def test_without_the_flag_the_paths_differ(make_engine: Callable[..., Engine], trained_pair: dict) -> None:
    """The same check on the default CPU kernels (torch, fp16): some rows differ, so the check above has teeth."""
    flags = {key: value for key, value in DETERMINISTIC.items()
             if key not in ("enable_deterministic_inference", "triton_attention_split_tile_size")}
    target_only, dflash = engines(make_engine, trained_pair["root"], **flags)
    assert sum(mismatched_rows(logits_by_path(target_only, dflash, PROMPTS, 8, VOCAB)).values()) > 0


def test_greedy_dflash_equals_target_only_at_every_batch_size(make_engine: Callable[..., Engine],
                                                              trained_pair: dict) -> None:
    target_only, dflash = engines(make_engine, trained_pair["root"], **DETERMINISTIC)
    expected = [o["output_ids"] for o in target_only.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert [o["output_ids"] for o in dflash.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == expected
    assert dflash.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1.5
    pair = [o["output_ids"] for o in dflash.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)]
    alone = dflash.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)["output_ids"]
    assert pair + [alone] == expected


def test_warm_up_launches_every_batch_invariant_variant(make_engine: Callable[..., Engine], trained_pair: dict) -> None:
    """On CUDA start-up compiles them (startup/warmup.py); here each variant runs once in the interpreter: lanes split
    and not, for the target's extend and verify and the draft's block (one layer class each)."""
    from blockspec.engine.warmup import warm_batch_invariant_attention

    _, dflash = engines(make_engine, trained_pair["root"], **DETERMINISTIC)
    assert warm_batch_invariant_attention(dflash.runner, dflash.worker) == 6


def test_server_info_shows_the_mode(make_engine: Callable[..., Engine], tiny: Any) -> None:
    info = make_engine(tiny("llama").path, **DETERMINISTIC).get_server_info()
    assert info["enable_deterministic_inference"] is True
    assert info["internal_states"][0]["attention_backend"] == "triton"
    assert info["deterministic_inference"]["attention_split_tile_size"] == 32
    plain = make_engine(tiny("llama").path).get_server_info()
    assert plain["enable_deterministic_inference"] is False and plain["deterministic_inference"] == {"enabled": False}


@pytest.mark.parametrize("flags,message", [
    ({"attention_backend": "torch"}, "needs attention_backend triton"),
    ({"attention_backend": "flashinfer"}, "needs attention_backend triton"),
    ({"tp_size": 2}, "tp_size 1 only"),
    ({"triton_attention_split_tile_size": 48}, "multiple of 32"),
])
def test_unsupported_combinations_are_errors(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", enable_deterministic_inference=True, **flags)


def test_split_size_needs_the_flag_and_auto_becomes_triton() -> None:
    with pytest.raises(ValueError, match="needs enable_deterministic_inference"):
        EngineConfig(model_path="m", triton_attention_split_tile_size=64)
    assert EngineConfig(model_path="m", enable_deterministic_inference=True).attention_backend == "triton"


def test_cpu_without_the_interpreter_is_an_error(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        Engine(model_path=str(tiny("llama").path), device="cpu", skip_tokenizer_init=True,
               enable_deterministic_inference=True)


def test_serve_flags(tiny: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tiny("llama").path)
    args = parse_serve_args(["--model-path", path, "--enable-deterministic-inference",
                             "--triton-attention-split-tile-size", "64"])
    assert args.engine["enable_deterministic_inference"] is True
    assert args.engine["triton_attention_split_tile_size"] == 64
    with pytest.raises(SystemExit):
        parse_serve_args(
            ["--model-path", path, "--enable-deterministic-inference", "--attention-backend", "flashinfer"]
        )
    assert "--enable-deterministic-inference needs --attention-backend triton" in capsys.readouterr().err
