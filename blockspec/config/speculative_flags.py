"""The speculative flags' own syntax, parsed where EngineConfig validates them: the fixed verify-length schedule
(`--speculative-num-draft-tokens-per-bs`) and the simulated accept profile (`--speculative-simulate-accept-profile`).
"""
from __future__ import annotations

import json
from pathlib import Path

Schedule = list[tuple[int, int, int]]  # (first batch size, last batch size, verify length)


def parse_verify_schedule(text: str) -> Schedule:
    """`1-16:10,17-64:4` → [(1, 16, 10), (17, 64, 4)]; `A:N` is the single batch size A. ValueError when malformed."""
    schedule: Schedule = []
    for part in text.split(","):
        sizes, sep, length = part.strip().partition(":")
        first, dash, last = sizes.partition("-")
        try:
            lo, hi, n = int(first), int(last) if dash else int(first), int(length)
        except ValueError:
            raise ValueError(
                f"speculative_num_draft_tokens_per_bs: {part.strip()!r} is not FIRST-LAST:N or BS:N "
                "(e.g. 1-16:10,17-64:4)"
            ) from None
        if not sep or lo < 1 or hi < lo or n < 1:
            raise ValueError(
                f"speculative_num_draft_tokens_per_bs: {part.strip()!r} needs 1 <= FIRST <= LAST and N >= 1"
            )
        if schedule and lo <= schedule[-1][1]:
            raise ValueError(
                f"speculative_num_draft_tokens_per_bs: ranges must be increasing and disjoint at {part.strip()!r}"
            )
        schedule.append((lo, hi, n))
    return schedule


def check_schedule_covers(schedule: Schedule, max_batch_size: int) -> None:
    covered = {bs for lo, hi, _ in schedule for bs in range(lo, min(hi, max_batch_size) + 1)}
    missing = [bs for bs in range(1, max_batch_size + 1) if bs not in covered]
    if missing:
        raise ValueError(
            f"speculative_num_draft_tokens_per_bs must cover every batch size 1..{max_batch_size} "
            f"(max_running_requests); missing {missing[0]}" + (f"..{missing[-1]}" if len(missing) > 1 else "")
        )


def accept_distribution(profile: str, block_size: int) -> list[float]:
    """P(accepted = a) for a = 0..B-1 (accepted proposals of a full block) from a profile spec; ValueError if bad."""
    if profile.startswith("geometric:"):
        try:
            mean = float(profile.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"speculative_simulate_accept_profile: {profile!r} is not geometric:MEAN") from None
        if mean < 1:
            raise ValueError(f"speculative_simulate_accept_profile: geometric mean must be >= 1, got {mean}")
        rate = (mean - 1) / mean
        probs = [rate ** a * (1 - rate) for a in range(block_size - 1)]
        return probs + [rate ** (block_size - 1)]
    path = Path(profile)
    if not path.is_file():
        raise ValueError(f"speculative_simulate_accept_profile: {profile!r} is neither geometric:MEAN nor a JSON file")
    data = json.loads(path.read_text())
    histogram = data.get("spec_accept_length_histogram") if isinstance(data, dict) else data
    if not isinstance(histogram, list) or not all(isinstance(c, (int, float)) and c >= 0 for c in histogram):
        raise ValueError(f"speculative_simulate_accept_profile: {profile} holds no list of counts per accept length")
    counts = [float(c) for c in histogram[1:]]  # NOTE: index c = verifies that committed c tokens; 0 never happens
    if sum(counts) <= 0:
        raise ValueError(f"speculative_simulate_accept_profile: {profile} has no verifies")
    folded = counts[: block_size - 1] + [sum(counts[block_size - 1:])]  # longer accepts stop at the block's end
    folded += [0.0] * (block_size - len(folded))
    return [c / sum(folded) for c in folded]
