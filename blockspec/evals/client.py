"""Small HTTP helpers shared by the eval and the benchmarks."""
from __future__ import annotations

from typing import Any, Optional

import httpx


def auth_headers(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get_server_info(base_url: str, api_key: Optional[str] = None, timeout: float = 30.0) -> dict[str, Any]:
    """/server_info, falling back to SGLang's older /get_server_info; {} when neither answers."""
    for path in ("/server_info", "/get_server_info"):
        try:
            response = httpx.get(base_url.rstrip("/") + path, headers=auth_headers(api_key), timeout=timeout)
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            info: dict[str, Any] = response.json()
            return info
    return {}


def engine_state(info: dict[str, Any]) -> dict[str, Any]:
    """The engine's internal state in a server_info answer ({} where it has none)."""
    states = info.get("internal_states") or [{}]
    return dict(states[0]) if states else {}


def spec_totals(info: dict[str, Any]) -> tuple[float, int]:
    """(tokens committed by verifies, verify count) from a server_info answer; (0, 0) without speculation."""
    state = engine_state(info)
    avg = float(state.get("avg_spec_accept_length") or 0.0)
    count = int(state.get("spec_verify_ct") or 0)
    return avg * count, count


def avg_accept_length(info: dict[str, Any]) -> Optional[float]:
    value = engine_state(info).get("avg_spec_accept_length")
    return float(value) if value is not None else None


def accept_length_between(before: dict[str, Any], after: dict[str, Any]) -> Optional[float]:
    """Accept length of the verifies that ran between two server_info snapshots."""
    committed0, count0 = spec_totals(before)
    committed1, count1 = spec_totals(after)
    if count1 <= count0:
        return None
    return (committed1 - committed0) / (count1 - count0)


def first_model_id(base_url: str, api_key: Optional[str] = None, timeout: float = 30.0) -> str:
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key), timeout=timeout)
    response.raise_for_status()
    model: str = response.json()["data"][0]["id"]
    return model


def metrics_text(base_url: str) -> str:
    """The server's Prometheus exposition; "" when it does not answer."""
    try:
        return httpx.get(base_url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return ""


def histogram_mean_between(before: str, after: str, name: str) -> Optional[float]:
    """Mean of the observations a Prometheus histogram got between two scrapes (None without any)."""
    def totals(text: str) -> tuple[float, float]:
        values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith((name + "_sum", name + "_count"))}
        return values.get(name + "_sum", 0.0), values.get(name + "_count", 0.0)

    (sum0, count0), (sum1, count1) = totals(before), totals(after)
    return (sum1 - sum0) / (count1 - count0) if count1 > count0 else None


def compiles_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Triton variants the server compiled during a workload (stalls; issue 25), in all and per kernel."""
    state0, state1 = engine_state(before), engine_state(after)
    total0, total1 = state0.get("kernel_compiles_after_startup"), state1.get("kernel_compiles_after_startup")
    kernels0 = state0.get("kernel_compiles_after_startup_by_kernel") or {}
    kernels1 = state1.get("kernel_compiles_after_startup_by_kernel") or {}
    per_kernel = {name: n - kernels0.get(name, 0) for name, n in kernels1.items() if n > kernels0.get(name, 0)}
    counted = total0 is not None and total1 is not None
    return {"kernel_compiles": total1 - total0 if counted else None, "kernel_compiles_by_kernel": per_kernel}


def forwards_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The server's forwards during a workload by how they ran (graph replays, eager uniform forwards, piecewise
    extends, extends the piecewise graphs could not take): `server_forward_counts`, None where not reported."""
    counts0, counts1 = (engine_state(info).get("forward_counts") for info in (before, after))
    if counts0 is None or counts1 is None:
        return {"server_forward_counts": None}
    return {"server_forward_counts": {kind: n - counts0.get(kind, 0) for kind, n in counts1.items()}}


LOOP_PHASES = ("intake", "publish", "flush")


def state_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> Optional[float]:
    """How much the engine's counter `key` (its internal state in /server_info) grew; None where it is not reported."""
    values = [engine_state(info).get(key) for info in (before, after)]
    return None if None in values else values[1] - values[0]


def steps_between(before: dict[str, Any], after: dict[str, Any], duration: float) -> dict[str, Any]:
    """Engine steps per second during a workload, the share of them that ran prefill chunks, the mean wall time of
    an extend step and of any other step, and per step the serving loop's time outside it (`serving_loop`: taking
    messages, making deltas, sending them); None where the server does not report them."""
    steps, extends = state_delta(before, after, "num_steps"), state_delta(before, after, "num_extend_steps")
    out: dict[str, Any] = {"engine_steps_per_s": None, "extend_step_share": None, "engine_extend_step_mean_ms": None,
                           "engine_other_step_mean_ms": None, **{f"engine_{p}_per_step_ms": None for p in LOOP_PHASES}}
    if steps is None or extends is None or steps <= 0:
        return out
    loops = [engine_state(info).get("serving_loop") for info in (before, after)]
    if loops[0] is not None and loops[1] is not None:
        for phase in LOOP_PHASES:
            key = f"{phase}_seconds"
            out[f"engine_{phase}_per_step_ms"] = 1e3 * (loops[1][key] - loops[0][key]) / steps
    out.update(engine_steps_per_s=steps / max(duration, 1e-9), extend_step_share=extends / steps)
    seconds, extend_seconds = (state_delta(before, after, "step_seconds"),
                               state_delta(before, after, "extend_step_seconds"))
    if seconds is not None and extend_seconds is not None:
        if extends:
            out["engine_extend_step_mean_ms"] = 1e3 * extend_seconds / extends
        if steps > extends:
            out["engine_other_step_mean_ms"] = 1e3 * (seconds - extend_seconds) / (steps - extends)
    return out
