"""Timing and telemetry the GPU benchmarks share: synced and steady-state wall times, copy and read-only bandwidth,
SM clock and board power while a loop runs."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch


def cuda_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of fn() in ms, synchronised around each call (what a request sees)."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def replay_ms(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    """ms per call of fn: on CUDA captured once in a graph (after a warm-up that compiles), replayed `repeat` times
    back to back; on the CPU timed eagerly."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeat
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def steady_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Mean wall time of `repeat` back-to-back fn() calls in ms, synchronised only before the first and after the
    last: the per-step time of a decode loop in steady state (an overlapped step's work runs behind the next)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeat


def read_bandwidth() -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 20)
    del src, dst
    return 2 * 2 * 2**30 / (ms / 1e3)  # bytes read + written per second


def read_only_bandwidth() -> float:
    """Bytes per second a reduction reads (no writes): the other bound beside the copy bandwidth."""
    src = torch.empty(2 * 2**30 // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    ms = cuda_ms(lambda: src.sum(), 20)
    del src
    return 2 * 2**30 / (ms / 1e3)


# NOTE: NVML clock-event reason bits (nvmlClocksEventReasons): why the SM clock is below its maximum right now.
CLOCK_EVENT_REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
                       "hw_power_brake": 0x80}


def _nvml_reader(name: str, fallback: str | None = None) -> Callable[[], int] | None:
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler()
        read = getattr(pynvml, name, None) or getattr(pynvml, fallback or name)
        read(handle)
        return lambda: int(read(handle))
    except Exception:  # noqa: BLE001 (no NVML: no reading, the timing stands)
        return None


class DeviceSampler:
    """Mean SM clock (MHz) and board power (W) while the `with` block runs, sampled every `period_s` by a thread
    (NVML via torch.cuda; empty where it is unavailable), and the share of samples in which each clock-event reason
    (power cap, thermal, ...) held. NVML averages clock and power over up to 1 s, so only loops that long read true;
    the reasons are instantaneous; `energy_j` is the board's energy counter over the block (J). Explains runs that
    are power-limited rather than slow."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.clocks: list[float] = []
        self.power: list[float] = []
        self.reasons: list[int] = []
        self._read_reasons = _nvml_reader("nvmlDeviceGetCurrentClocksEventReasons",
                                          "nvmlDeviceGetCurrentClocksThrottleReasons")
        self._read_energy_mj = _nvml_reader("nvmlDeviceGetTotalEnergyConsumption")
        self.energy_j: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.clocks.append(float(torch.cuda.clock_rate()))
                self.power.append(float(torch.cuda.power_draw()) / 1e3)  # mW → W
                if self._read_reasons is not None:
                    self.reasons.append(self._read_reasons())
            except Exception:  # noqa: BLE001 (no NVML: no telemetry, the timing stands)
                return

    def __enter__(self) -> "DeviceSampler":
        self._energy_start = self._read_energy_mj() if self._read_energy_mj is not None else None
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._energy_start is not None and self._read_energy_mj is not None:
            self.energy_j = (self._read_energy_mj() - self._energy_start) / 1e3

    def summary(self) -> dict[str, float]:
        if not self.clocks:
            return {}
        result = {"sm_clock_mhz": sum(self.clocks) / len(self.clocks), "min_sm_clock_mhz": min(self.clocks),
                  "power_w": sum(self.power) / len(self.power)}
        if self.energy_j is not None:
            result["energy_j"] = self.energy_j
        for name, bit in CLOCK_EVENT_REASONS.items():
            if self.reasons:
                result[f"share_{name}"] = sum(1 for r in self.reasons if r & bit) / len(self.reasons)
        return result
