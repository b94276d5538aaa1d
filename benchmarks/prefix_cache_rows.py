"""Rows of benchmarks/prefix_cache.py: one workload's measurement from the server's counters before and after it,
repeats folded into one row (medians), the printed line, and the goals (on ÷ off per shape and workload)."""
from __future__ import annotations

import statistics
from typing import Any, Optional

from blockspec.evals.client import (
    accept_length_between, compiles_between, engine_state, histogram_mean_between, state_delta, steps_between,
)

TTFT_METRIC = "blockspec_time_to_first_token_seconds"  # the server's own submit -> first token
TTFT_PARTS = {  # NOTE: the three add up to TTFT_METRIC
    "engine_receive_mean_ms": "blockspec_request_receive_time_seconds",  # submit -> the scheduler has it
    "engine_queue_mean_ms": "blockspec_request_queue_time_seconds",  # waiting queue -> admitted
    "engine_prefill_mean_ms": "blockspec_request_prefill_time_seconds",  # admitted -> first token
}


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def radix_stats(info: dict[str, Any]) -> dict[str, Any]:
    return dict(engine_state(info).get("radix_cache") or {})


def step_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Optional[float]]:
    """The engine's steps during a workload: all, those that ran prefill chunks, those that held arrivals back."""
    keys = {"engine_steps": "num_steps", "engine_extend_steps": "num_extend_steps",
            "engine_held_steps": "num_steps_arrivals_held"}
    return {name: state_delta(before, after, key) for name, key in keys.items()}


def measured_row(result: dict[str, Any], before: dict[str, Any], after: dict[str, Any], metrics_before: str,
                 metrics_after: str) -> dict[str, Any]:
    """The client's `result` with what the server counted in between: accept length, hit rate, TTFT, steps."""
    looked_up = radix_stats(after).get("prompt_tokens_total", 0) - radix_stats(before).get("prompt_tokens_total", 0)
    hits = radix_stats(after).get("cached_tokens_total", 0) - radix_stats(before).get("cached_tokens_total", 0)
    return {**result, "accept_len": accept_length_between(before, after),
            "cache_hit_rate": hits / looked_up if looked_up else 0.0,
            "engine_ttft_mean_ms": _ms(histogram_mean_between(metrics_before, metrics_after, TTFT_METRIC)),
            **{name: _ms(histogram_mean_between(metrics_before, metrics_after, metric))
               for name, metric in TTFT_PARTS.items()},
            **compiles_between(before, after), **step_counts(before, after),
            **steps_between(before, after, result["duration_s"])}


def folded(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one workload as one row: the sample of median tok/s (its counters kept whole), with tok/s and
    TTFT p50 as medians over the samples, accept length and hit rate as means; every sample's tok/s and TTFT kept."""
    if not samples:
        raise ValueError("no samples to fold")
    ordered = sorted(samples, key=lambda r: r["tok_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    accepts = [r["accept_len"] for r in samples if r["accept_len"] is not None]
    row.update(repeats=len(samples), tok_s=statistics.median(r["tok_s"] for r in samples),
               ttft_p50_ms=statistics.median(r["ttft_p50_ms"] for r in samples),
               accept_len=statistics.fmean(accepts) if accepts else None,
               cache_hit_rate=statistics.fmean(r["cache_hit_rate"] for r in samples),
               failed=sum(r["failed"] for r in samples), requests=sum(r["requests"] for r in samples),
               tok_s_samples=[r["tok_s"] for r in samples], ttft_p50_ms_samples=[r["ttft_p50_ms"] for r in samples])
    return row


def describe(row: dict[str, Any]) -> str:
    accept = row["accept_len"]
    return (f"{row['workload']:>10} {row['shape']:>8} {row['cache']:>4} {row['tok_s']:>9.0f} tok/s  ttft p50 "
            f"{row['ttft_p50_ms']:>8.1f} p99 {row['ttft_p99_ms']:>8.1f} ms  "
            f"accept {'-' if accept is None else f'{accept:.3f}'}"
            f"  hit {row['cache_hit_rate']:.2f}  {row['requests'] - row['failed']}/{row['requests']} ok"
            f"  engine ttft {_fmt(row['engine_ttft_mean_ms'])} (receive {_fmt(row.get('engine_receive_mean_ms'))}"
            f" queue {_fmt(row.get('engine_queue_mean_ms'))} prefill {_fmt(row.get('engine_prefill_mean_ms'))}) ms  "
            f"compiles {row['kernel_compiles']}"
            f" {row['kernel_compiles_by_kernel'] or ''}  steps {row.get('engine_steps')} (extend"
            f" {row.get('engine_extend_steps')}, held {row.get('engine_held_steps')}) ms extend"
            f" {_fmt(row.get('engine_extend_step_mean_ms'))} other {_fmt(row.get('engine_other_step_mean_ms'))}")


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and workload: on ÷ off for throughput and TTFT p50, the accept-length difference."""
    out = []
    for shape in sorted({r["shape"] for r in rows}):
        for workload in sorted({r["workload"] for r in rows}):
            pair = {r["cache"]: r for r in rows if r["shape"] == shape and r["workload"] == workload}
            if set(pair) != {"on", "off"}:
                continue
            on, off = pair["on"], pair["off"]
            accept_on, accept_off = on["accept_len"], off["accept_len"]
            entry: dict[str, Any] = {
                "shape": shape, "workload": workload,
                "tok_s_on_over_off": on["tok_s"] / off["tok_s"] if off["tok_s"] else None,
                "ttft_p50_on_over_off": on["ttft_p50_ms"] / off["ttft_p50_ms"] if off["ttft_p50_ms"] else None,
                "accept_len_rel_diff": abs(accept_on - accept_off) / accept_off if accept_on and accept_off else None,
            }
            if workload == "sysprompt":
                ttft_ratio = entry["ttft_p50_on_over_off"]
                entry["goal_ttft_met"] = ttft_ratio is not None and ttft_ratio <= 0.1
            if workload == "gsm8k":
                entry["goal_tok_s_met"] = entry["tok_s_on_over_off"] is not None and entry["tok_s_on_over_off"] >= 1.5
            if entry["accept_len_rel_diff"] is not None:
                entry["goal_accept_met"] = entry["accept_len_rel_diff"] <= 0.01
            out.append(entry)
    return out


