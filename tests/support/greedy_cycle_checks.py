"""DFlash's greedy cycle checked against its two steps: one greedy cycle (greedy_cycle_tokens) gives propose then
verify's proposals, target argmax and greedy acceptance (written plainly here); the KV pools free after. GREEDY: the
DFlash lossless tests' greedy requests (the check prefills its prompts with them)."""
from __future__ import annotations

from blockspec import Engine
from tests.support.engine_testing import prefilled

GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}


def assert_pools_free(engine: Engine) -> None:
    """Every KV slot free, no request running or waiting."""
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    assert not engine.scheduler.running and not engine.scheduler.waiting


def leading_matches(proposals: list[int], target_argmax: list[int]) -> int:
    """Greedy acceptance written plainly: proposals d_1.. accepted while each equals the target's choice before it."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted


def assert_cycle_equals_propose_then_verify(engine: Engine, prompts: list[list[int]]) -> None:
    """One greedy cycle (greedy_cycle_tokens) for the prefilled `prompts` equals propose then verify: proposals,
    target argmax and accepted counts, some but not all proposals accepted; the pools are free after."""
    worker, runner = engine.worker, engine.runner
    reqs = prefilled(engine, prompts, GREEDY)
    b = worker.block_size
    for req in reqs:
        runner.allocator.grow(req, req.kv_len + b, runner.req_to_token)
    rows = worker.greedy_cycle_tokens(reqs)
    draft_batch, proposals, _ = worker.propose(reqs)
    target_argmax = worker.verify(reqs, proposals).argmax(-1)
    assert [row[1:b] for row in rows] == proposals.tolist()
    assert [row[b:] for row in rows] == target_argmax.tolist()
    expected = [leading_matches(p, t) for p, t in zip(proposals.tolist(), target_argmax.tolist())]
    assert [row[0] for row in rows] == expected
    assert 0 < sum(expected) < len(reqs) * (b - 1)  # a trained draft: some but not all proposals accepted
    for req in reqs:
        engine.scheduler.abort(req.rid)
    engine.step()
    assert_pools_free(engine)
