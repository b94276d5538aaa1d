"""Shared fixtures: tiny checkpoints written once per session (`tiny`), and `make_engine`, which checks at
teardown that every engine it built left its KV pool free and its queues empty. Helpers: engine_testing.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from transformers import PreTrainedModel

from blockspec import Engine
from tests.support.engine_testing import assert_engine_idle
from tests.support.interpreter_dot import exact_interpreter_dot
from tests.support.interpreter_sort import numpy_sort
from tests.support.tiny_models import build_tiny_model, save_tiny_model

# NOTE: tiny models gain nothing from intra-op threads, and on a small shared machine the thread pool's spinning
# makes every matmul ~100x slower; one thread keeps the CPU suite fast.
torch.set_num_threads(1)


@dataclass
class TinyCheckpoint:
    kind: str
    path: Path
    model: PreTrainedModel  # the HF model whose weights are on disk (the oracle)


class TinyCheckpoints:
    """Lazily writes one checkpoint per (kind, variant) under a session temp dir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[str, str], TinyCheckpoint] = {}

    def __call__(self, kind: str, variant: str = "plain") -> TinyCheckpoint:
        key = (kind, variant)
        if key not in self._cache:
            path = self.root / f"{kind}-{variant}"
            if variant == "plain":
                model = save_tiny_model(kind, path)
            elif variant == "sharp":  # lm_head ×12 in all: a peaked next-token distribution for sampling tests
                model = build_tiny_model(kind)
                with torch.no_grad():
                    model.lm_head.weight.mul_(3.0)
                model.save_pretrained(path)
            elif variant == "sharded":
                model = build_tiny_model(kind)
                model.save_pretrained(path, max_shard_size="40KB")  # several shards + model.safetensors.index.json
            else:
                raise ValueError(variant)
            self._cache[key] = TinyCheckpoint(kind, path, model)
        return self._cache[key]


@pytest.fixture(scope="session", autouse=True)
def interpreter_dot_rows_independent() -> Iterator[None]:
    """Under TRITON_INTERPRET a row of `tl.dot` must not round by its place in the tile (interpreter_dot.py)."""
    yield from exact_interpreter_dot()


@pytest.fixture(scope="session", autouse=True)
def interpreter_sorts_fast() -> Iterator[None]:
    """Under TRITON_INTERPRET `tl.sort` is numpy's sort, not a network of interpreted steps (interpreter_sort.py)."""
    yield from numpy_sort()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """`tiny("llama")` → TinyCheckpoint (written on first use, shared by the whole session)."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny_ckpts"))


ENGINE_DEFAULTS: dict[str, Any] = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=1024)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    setattr(item, f"rep_{report.when}", report)  # lets fixtures see whether the test body passed
    return report


@pytest.fixture
def make_engine(request: pytest.FixtureRequest) -> Iterator[Callable[..., Engine]]:
    """`make_engine(path, **flags)` builds a CPU fp32 engine (tokenizer skipped, 1024 KV slots unless overridden).

    At teardown every engine it built must be idle: all KV slots free, no request waiting or running. (Skipped when
    the test body already failed, so one bug is reported once.)"""
    engines: list[Engine] = []

    def build(model_path: str | Path, **flags: Any) -> Engine:
        engine = Engine(model_path=str(model_path), **{**ENGINE_DEFAULTS, **flags})
        engines.append(engine)
        return engine

    yield build
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.passed:
        for engine in engines:
            assert_engine_idle(engine)


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{"root": a directory with target/ and a trained draft/ (draft_training.save_trained_target), "target": the
    HF target model, the oracle}; written once per session."""
    from tests.support.draft_training import save_trained_target

    root = tmp_path_factory.mktemp("trained_pair")
    return {"root": root, "target": save_trained_target(root)}


@pytest.fixture(scope="session")
def qwen_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{"root": target/ (tiny Llama, the real Qwen3 tokenizer and chat template) and a trained draft/, "target": the HF
    target, "tokenizer"} (grammar_models.save_qwen_vocab_pair); written once per session."""
    from transformers import AutoTokenizer

    from tests.support.grammar_models import save_qwen_vocab_pair

    root = tmp_path_factory.mktemp("qwen_vocab_pair")
    target = save_qwen_vocab_pair(root)
    return {"root": root, "target": target, "tokenizer": AutoTokenizer.from_pretrained(root / "target")}
