"""--cache-features within limits: features kept on the device, then in host memory, then not at all (recomputed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockspec.train.feature_cache import FeatureCache, available_host_bytes
from blockspec.train.options import TrainOptions
from blockspec.train.pipeline import run
from tests.support.tiny_models import save_tiny_model


def test_features_fill_the_device_then_the_host_then_are_not_kept() -> None:
    per_sequence = 10 * 4 * 4  # NOTE: [10, 4] float32: 160 bytes, so a 512-byte slab holds two (256-byte aligned)
    cache = FeatureCache(torch.device("cpu"), device_limit_bytes=600, host_limit_bytes=per_sequence, slab_bytes=512)
    features = [torch.randn(10, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for index, value in enumerate(features):
        cache.put(index, value)
    assert [index in cache for index in range(4)] == [True, True, True, False]
    for index in range(3):
        assert torch.equal(cache.get(index), features[index])
        assert cache.get(index).data_ptr() != features[index].data_ptr()  # NOTE: a copy, not the caller's tensor
    slab = cache.get(0).untyped_storage().data_ptr()
    assert cache.get(1).untyped_storage().data_ptr() == slab and cache.get(1).data_ptr() == slab + 256
    assert cache.stats.as_dict() == {"device_sequences": 2, "device_bytes": 2 * per_sequence, "host_sequences": 1,
                                     "host_bytes": per_sequence, "not_kept": 1}
    with pytest.raises(KeyError):
        cache.get(3)


def test_the_host_limit_defaults_to_a_share_of_the_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cache = FeatureCache(torch.device("cpu"), host_bytes_available=lambda: 1000)
    assert (cache.device_limit, cache.host_limit) == (0, 500)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # NOTE: torchrun's ranks on this host share it
    assert FeatureCache(torch.device("cpu"), host_bytes_available=lambda: 1000).host_limit == 125


def test_a_device_limit_under_one_slab_is_one_smaller_slab() -> None:
    cache = FeatureCache(torch.device("cpu"), device_limit_bytes=300, host_limit_bytes=0, slab_bytes=512)
    cache.put(0, torch.zeros(10, 4))  # NOTE: 160 bytes
    cache.put(1, torch.zeros(10, 4))  # NOTE: would end at 416: past the 300-byte slab, and no second slab fits
    assert cache.slab_bytes == 300 and cache.stats.device_sequences == 1 and cache.stats.not_kept == 1


def test_host_memory_is_the_smaller_of_meminfo_and_the_cgroup_room(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  2000 kB\nMemAvailable:  1000 kB\n")
    limit, usage, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    limit.write_text("700000\n")
    usage.write_text("300000\n")
    stat.write_text("anon 200000\ninactive_file 100000\n")
    files = ((str(limit), str(usage), str(stat)),)
    # NOTE: the cgroup's room, its reclaimable page cache not counted as used
    assert available_host_bytes(str(meminfo), files) == 700000 - (300000 - 100000)
    stat.unlink()
    assert available_host_bytes(str(meminfo), files) == 400000
    limit.write_text("max\n")  # NOTE: cgroup v2 without a limit
    assert available_host_bytes(str(meminfo), files) == 1000 * 1024
    assert available_host_bytes(str(meminfo), ((str(tmp_path / "none"), str(usage), str(stat)),)) == 1000 * 1024


def test_a_limit_needs_cache_features(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input_ids": [3, 4]}) + "\n")
    with pytest.raises(ValueError, match="--feature-cache-host-gib limits --cache-features"):
        TrainOptions(target_model_path=str(tmp_path), data=str(data), out="o", feature_cache_host_gib=1.0).validate()
    with pytest.raises(ValueError, match="--feature-cache-device-gib must be >= 0"):
        TrainOptions(target_model_path=str(tmp_path), data=str(data), out="o", cache_features=True,
                     feature_cache_device_gib=-1.0).validate()


def test_a_run_past_both_limits_trains_as_one_that_keeps_everything(tmp_path: Path) -> None:
    """The features recomputed for every draw are the ones a cache would hold: the same losses, step for step."""
    target = tmp_path / "target"
    save_tiny_model("llama", target, residual_scale=0.3)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n" for i in range(3, 11)))
    infos = []
    for name, limit in (("kept", None), ("recomputed", 0.0)):
        options = TrainOptions(
            target_model_path=str(target), data=str(data), out=str(tmp_path / name), cache_dir=str(tmp_path / "cache"),
            block_size=4, max_new_tokens=12, ignore_eos=True, steps=8, batch_size=2, blocks_per_seq=2,
            num_eval_prompts=0, device="cpu", progress=False, cache_features=True, feature_cache_host_gib=limit,
        )
        run(options)
        infos.append(json.loads((tmp_path / name / "training_info.json").read_text())["result"])
    kept, recomputed = infos
    assert kept["feature_cache"]["host_sequences"] == 8 and kept["feature_cache"]["not_kept"] == 0
    assert recomputed["feature_cache"]["host_sequences"] == 0 and recomputed["feature_cache"]["not_kept"] == 16
    assert recomputed["final_loss"] == kept["final_loss"] and recomputed["steps"] == kept["steps"] == 8
