"""Broken checkpoints and bad engine arguments fail early with messages that name the problem."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec import Engine
from blockspec.config.engine_config import EngineConfig
from blockspec.models.loader import iter_safetensors, safetensors_files
from tests.support.engine_testing import hf_greedy

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

def _copy(tiny, tmp_path: Path, kind: str = "llama", variant: str = "plain") -> Path:
    return Path(shutil.copytree(tiny(kind, variant).path, tmp_path / "ckpt"))


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _load(path: Path, **flags: Any) -> Engine:
    kwargs = {"device": "cpu", "dtype": "float32", "skip_tokenizer_init": True, "max_total_tokens": 64, **flags}
    return Engine(model_path=str(path), **kwargs)


# ---- model directories -------------------------------------------------------------------------
def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"model directory .*no-such-model does not exist"):
        _load(missing)
    with pytest.raises(FileNotFoundError, match=r"no-such-model does not exist"):  # tokenizer loads first
        Engine(model_path=str(missing), device="cpu")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        safetensors_files(missing)


def test_missing_tokenizer_files(tiny) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files .* skip_tokenizer_init=True"):
        Engine(model_path=str(tiny("llama").path), device="cpu")


def test_missing_config(tiny, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found in .*ckpt"):
        _load(path)


def test_invalid_config_json(tiny, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        _load(path)


def test_missing_safetensors(tiny, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*ckpt"):
        _load(path)


def test_index_names_missing_shard(tiny, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path, variant="sharded")
    shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) >= 2
    (path / shards[1]).unlink()
    with pytest.raises(
        FileNotFoundError, match=rf"model\.safetensors\.index\.json names shard\(s\) missing .*{shards[1]}"
    ):
        _load(path)


def test_sharded_files_all_read(tiny) -> None:
    ckpt = tiny("llama", "sharded")
    names = {name for name, _ in iter_safetensors(ckpt.path)}
    assert names == set(ckpt.model.state_dict())


# ---- weights -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,shape,implied",
    [
        ("model.layers.1.self_attn.o_proj.weight", (32, 16), (32, 32)),  # a plain linear
        ("model.layers.0.self_attn.k_proj.weight", (32, 32), (16, 32)),  # part of the fused q|k|v
        ("model.layers.3.mlp.up_proj.weight", (32, 64), (64, 32)),  # part of the fused gate|up, transposed
        ("model.embed_tokens.weight", (95, 32), (96, 32)),
    ],
)
def test_wrong_shape(tiny, tmp_path: Path, name: str, shape: tuple[int, ...], implied: tuple[int, ...]) -> None:
    path = _copy(tiny, tmp_path)

    def edit(weights: dict[str, torch.Tensor]) -> None:
        assert tuple(weights[name].shape) != shape
        weights[name] = torch.zeros(shape)

    _edit_weights(path, edit)
    expected = f"weight '{name}' has shape {shape} in the checkpoint, the config implies {implied}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        _load(path)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor(tiny, tmp_path: Path, name: str) -> None:
    path = _copy(tiny, tmp_path)
    _edit_weights(path, lambda weights: weights.pop(name))
    with pytest.raises(ValueError, match=rf"checkpoint is missing 1 weight\(s\): {name}"):
        _load(path)


def test_extra_tensors_ignored(tiny, tmp_path: Path) -> None:
    """Old checkpoints carry rotary inv_freq buffers; tied ones may also ship an lm_head copy."""
    ckpt = tiny("llama")
    path = _copy(tiny, tmp_path)
    _edit_weights(path, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    engine = _load(path)
    out = engine.generate(
        input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    )
    assert out["output_ids"] == hf_greedy(ckpt.model, [5, 6, 7], 8)


def test_bfloat16_checkpoint_upcast(tmp_path: Path) -> None:
    """A checkpoint stored in bf16 serves in fp32 exactly like HF on the same (upcast) weights."""
    from tests.support.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    model = model.float()
    engine = _load(tmp_path / "bf16", max_total_tokens=256)
    prompts = [[5, 6, 7], list(range(10, 30))]
    outputs = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    )
    assert [o["output_ids"] for o in outputs] == [hf_greedy(model, p, 12) for p in prompts]


# ---- config.json -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"),
        ({"architectures": None, "model_type": "gpt2"}, r"unsupported model architecture 'gpt2'"),
        ({"hidden_size": None}, r"hidden_size"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
            r"unsupported rope type 'yarn'",
        ),
    ],
)
def test_bad_config(tiny, tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    path = _copy(tiny, tmp_path)
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        _load(path)


# ---- engine arguments --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,message",
    [
        ({"page_sise": 16}, r"unknown engine argument\(s\): page_sise"),
        ({"page_size": 0}, r"page_size must be a positive integer, got 0"),
        ({"page_size": -16}, r"page_size"),
        ({"dtype": "float64"}, r"dtype must be auto, float32, bfloat16 or float16, got 'float64'"),
        ({"dtype": "fp32"}, r"dtype"),
        ({"max_total_tokens": 0}, r"max_total_tokens"),
        ({"max_running_requests": 0}, r"max_running_requests"),
        ({"chunked_prefill_size": 0}, r"chunked_prefill_size"),
        ({"context_length": -1}, r"context_length"),
        ({"mem_fraction_static": 1.5}, r"mem_fraction_static"),
        ({"attention_backend": "flash"}, r"attention_backend"),
        ({"device": "tpu"}, r"device"),
        ({"speculative_algorithm": "EAGLE"}, r"speculative_algorithm"),
        ({"speculative_algorithm": "dflash"}, r"speculative_draft_model_path is required"),
        ({"load_format": "pt"}, r"load_format"),
        ({"host_threads": 0}, r"host_threads must be a positive integer, got 0"),
        ({"piecewise_attention_max_splits": 3}, r"piecewise_attention_max_splits must be a power of two up to 16"),
        ({"piecewise_attention_max_splits": 32}, r"piecewise_attention_max_splits must be a power of two"),
    ],
)
def test_bad_engine_args(tiny, flags: dict[str, Any], message: str) -> None:
    kwargs = {"model_path": str(tiny("llama").path), "device": "cpu", "skip_tokenizer_init": True, **flags}
    with pytest.raises(ValueError, match=message):
        Engine(**kwargs)


def test_host_threads(tiny) -> None:
    """GPU engines run their host-side tensor work on one torch thread unless told otherwise; CPU engines keep
    torch's threads (the model runs on them); an explicit count is set."""
    assert EngineConfig(model_path="m", device="cpu").resolved_host_threads is None
    assert EngineConfig(model_path="m", device="cpu", host_threads=3).resolved_host_threads == 3
    if torch.cuda.is_available():
        assert EngineConfig(model_path="m", device="cuda").resolved_host_threads == 1
    before = torch.get_num_threads()
    try:
        engine = Engine(model_path=str(tiny("llama").path), device="cpu", skip_tokenizer_init=True, host_threads=1)
        assert torch.get_num_threads() == 1 and engine.get_server_info()["host_threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_model_path_required() -> None:
    with pytest.raises(ValueError, match="model_path is required"):
        EngineConfig.from_kwargs(device="cpu")
    with pytest.raises(ValueError, match="model_path"):
        EngineConfig.from_kwargs(model_path="")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda(tiny) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        _load(tiny("llama").path, device="cuda")


def test_pool_smaller_than_a_page(tiny) -> None:
    with pytest.raises(ValueError, match="page"):
        _load(tiny("llama").path, max_total_tokens=8, page_size=16)


@pytest.mark.parametrize("flags,field", [
    ({"device": 0}, "device"), ({"mem_fraction_static": "0.5"}, "mem_fraction_static"),
    ({"cuda_graph_bs": 8}, "cuda_graph_bs"), ({"piecewise_cuda_graph_tokens": 4}, "piecewise_cuda_graph_tokens"),
    ({"speculative_simulate_accept_len": "2"}, "speculative_simulate_accept_len"), ({"page_size": True}, "page_size"),
    ({"log_level": "verbose"}, "log_level"), ({"disable_cuda_graph": "yes"}, "disable_cuda_graph"),
])
def test_engine_config_rejects_wrong_types(flags: dict, field: str) -> None:
    from blockspec.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(model_path="/nonexistent", **flags)


def test_kv_budget_counts_memory_in_use_and_says_what_to_do() -> None:
    from blockspec.runner.model_runner import kv_slots_in_budget

    gib = 2**30
    assert kv_slots_in_budget(free=100 * gib, total=100 * gib, mem_fraction_static=0.5, bytes_per_slot=gib) == 50
    assert kv_slots_in_budget(free=80 * gib, total=100 * gib, mem_fraction_static=0.5, bytes_per_slot=gib) == 30
    # NOTE: a second engine in one process sees the first one's pool as used memory
    with pytest.raises(ValueError, match=r"85\.0 of 100\.0 GiB are in use already.*--max-total-tokens"):
        kv_slots_in_budget(free=15 * gib, total=100 * gib, mem_fraction_static=0.85, bytes_per_slot=2**20)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_weights_are_allocated_once_in_the_serving_dtype(tiny, tmp_path: Path, kind: str) -> None:
    """A bf16 target and draft are materialised in bf16: no fp32 copy first (for Qwen3-30B-A3B that copy alone is
    122 GB and did not fit an 80 GB H100)."""
    from torch.overrides import TorchFunctionMode

    from blockspec.models.config import load_target_config
    from blockspec.models.draft_config import load_draft_config
    from blockspec.models.draft_loading import load_draft_model
    from blockspec.models.loader import load_target_model
    from tests.support.tiny_models import save_tiny_draft

    class MaterialisedDtypes(TorchFunctionMode):
        """The dtypes of the tensors materialised from meta ones (Module.to_empty's torch.empty_like)."""

        def __init__(self) -> None:
            super().__init__()
            self.dtypes: set[torch.dtype] = set()

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            result = func(*args, **(kwargs or {}))
            if func is torch.empty_like and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                self.dtypes.add(result.dtype)
            return result

    target = tiny(kind)
    save_tiny_draft(tmp_path / "draft", target.model, [0, 2], 8, num_layers=1, seed=0)
    draft_config = load_draft_config(tmp_path / "draft", load_target_config(target.path))
    with MaterialisedDtypes() as materialised:
        load_target_model(target.path, torch.bfloat16, torch.device("cpu"), 64, dummy=True)
    assert materialised.dtypes == {torch.bfloat16}
    with MaterialisedDtypes() as materialised:
        load_draft_model(tmp_path / "draft", draft_config, torch.bfloat16, torch.device("cpu"), 64, dummy=True)
    assert materialised.dtypes == {torch.bfloat16}
