"""Target-only greedy decode on the overlap schedule replays one graph a step (GraphKind.GREEDY_DECODE: the forward,
the argmax and the next step's rows), and commits what the synchronous eager steps commit, token for token, the HF
greedy oracle's tokens. On the CPU through the graph emulation of tests/support/replayed_cuda_graphs.py (host values
frozen at capture, every output overwritten by the next replay of any graph, so a step that kept the graph's output
instead of a copy would read garbage), with Triton attention in its CPU interpreter (the backend the graphs run on
CUDA); requests of different lengths finish mid-pipeline and arrive while steps are in flight."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import Engine
from blockspec.runner.graph_kind import GraphKind
from tests.support.engine_testing import assert_engine_idle
from tests.support.replayed_cuda_graphs import enable_emulated_graphs
from tests.support.tiny_models import save_tiny_model

pytest.importorskip("triton")

PROMPTS = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 9)]
MAX_NEW = [24, 5, 17, 30, 2, 12]  # finishes spread over many steps


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("greedy_decode_graph")
    return root, save_tiny_model("llama", root, residual_scale=0.3)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_decode_graph_replays_as_the_eager_steps_run(target: tuple[Path, torch.nn.Module],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root, model = target
    engine = Engine(model_path=str(root), device="cpu", dtype="float32", page_size=1, max_total_tokens=2048,
                    chunked_prefill_size=16, skip_tokenizer_init=True, attention_backend="triton",
                    cuda_graph_bs=[2, 4, 8])
    try:
        pool = enable_emulated_graphs(monkeypatch, engine)
        assert engine.runner.graphs.captured(GraphKind.GREEDY_DECODE, 1)
        runs: dict[bool, list[list[int]]] = {}
        for graphs_on in (False, True):
            monkeypatch.setattr(engine.runner.graphs, "enabled", graphs_on)
            assert engine.flush_cache()
            scheduler = engine.scheduler
            reqs, _ = engine.make_requests(
                input_ids=PROMPTS, sampling_params=[{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                                    for n in MAX_NEW])
            later = list(reqs[2:])
            for req in reqs[:2]:
                scheduler.add_request(req)
            overlapped = 0
            while scheduler.has_work or later:
                if later and scheduler.steps.in_flight is not None:
                    scheduler.add_request(later.pop(0))  # NOTE: arrives while a step is in flight
                engine.step()
                overlapped += scheduler.steps.in_flight is not None
            assert overlapped > 10
            runs[graphs_on] = [req.output_ids for req in reqs]
        assert pool.replays["greedy-decode"] > 10, pool.replays
        assert runs[True] == runs[False] == [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        assert_engine_idle(engine)
    finally:
        engine.shutdown()

