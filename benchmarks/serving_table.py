"""One line per serving_vs_engine row, as the benchmark prints it (and device_serving_ab.sh greps it)."""
from __future__ import annotations

from typing import Any, Optional


def describe(row: dict[str, Any]) -> str:
    accept = row.get("server_accept_length")
    conc = f"{row['concurrency']}" + (f"@{row['rate']:.1f}/s" if row["concurrency"] == "poisson" else "")
    ratio = row["server_over_engine"]
    return (f"{row['shape']:>8} {row['mode']:>6} {conc:>14} {row['engine_tok_s']:>10.0f} {row['server_tok_s']:>10.0f} "
            f"{ratio if ratio is not None else float('nan'):>6.2f} {row['ttft_p50_ms']:>8.1f} {row['ttft_p99_ms']:>8.1f} "
            f"{row['itl_p50_ms']:>7.2f} {row['itl_p99_ms']:>7.2f} {'-' if accept is None else f'{accept:.2f}':>6} "
            f"{row['completed']}/{row['completed'] + row['failed']} {row.get('kernel_compiles', '-')} "
            f"{row.get('clients_cpu_share', float('nan')):.2f}/{row.get('client_procs', '-')} "
            f"{_num(row.get('http_cpu_share'), '.2f')}/{_num(row.get('engine_cpu_share'), '.2f')} "
            f"{_num(row.get('engine_receive_mean_ms'), '.1f')}/{_num(row.get('engine_queue_mean_ms'), '.1f')}/"
            f"{_num(row.get('engine_prefill_mean_ms'), '.1f')} {_num(row.get('engine_steps_per_s'), '.0f')}/"
            f"{_num(row.get('extend_step_share'), '.2f')} {_num(row.get('engine_extend_step_mean_ms'), '.1f')}/"
            f"{_num(row.get('engine_other_step_mean_ms'), '.2f')} {_extends(row.get('server_forward_counts'))} "
            f"{'/'.join(_num(row.get(f'engine_{p}_per_step_ms'), '.3f') for p in ('intake', 'publish', 'flush'))} "
            f"{_num(row.get('engine_core_mhz'), '.0f')}/{_num(row.get('server_engine_core_mhz'), '.0f')}"
            f"{' ' + str(row['kernel_compiles_by_kernel']) if row.get('kernel_compiles_by_kernel') else ''}")


def _extends(counts: Optional[dict[str, int]]) -> str:
    """The level's extend forwards: on piecewise graphs / eager (no bucket fitted)."""
    if not counts:
        return "-"
    return f"{counts.get('piecewise', 0)}/{counts.get('piecewise_fallback', 0)}"


def _num(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'shape':>8} {'mode':>6} {'concurrency':>14} {'engine t/s':>10} {'server t/s':>10} {'s/e':>6} "
          f"{'ttft50':>8} {'ttft99':>8} {'itl50':>7} {'itl99':>7} {'accept':>6} ok compiles clients-cpu/procs "
          "http/engine-cpu receive/queue/prefill-ms steps-per-s/extend-share extend/other-step-ms extends-piecewise/eager "
          "loop-ms-per-step-intake/publish/flush engine-core-mhz-offline/server")
