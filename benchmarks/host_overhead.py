"""Host time per engine step outside the model: the engine process's serving loop (EngineCore: intake, scheduler
step, deltas, the flush to the server) under a closed loop of clients, on a tiny dummy model (#18).

Each measured step's wall time is split into the model forwards (`CudaGraphs.run`, `ModelRunner.forward_extend`, the
draft-KV materialise of extends; on CUDA each is followed by a device sync, so the step runs serialised and a forward
holds its own device time), waits for the device (`torch.cuda.Event.synchronize`) and the rest: the host time this
measures, as wall time (`host`) and as this thread's CPU time (`host_cpu`: unmoved by other processes on the cores).
`--clients` requests run at once; each one that finishes is replaced by a fresh prompt before the next step (output
lengths vary, so arrivals spread over the steps as in serving), over `--frontends` server links. Runs unchanged on
CPU and CUDA; writes JSON to --out.

    python -m benchmarks.host_overhead --out /tmp/host.json [--modes dflash,target] [--profile /tmp/host.prof]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import zmq

from benchmarks.serving_vs_engine_support import TINY, TINY_DRAFT
from blockspec import Engine
from blockspec.bench.provenance import run_identity
from blockspec.engine import wire
from blockspec.engine.core import EngineCore

TARGET = dict(TINY, num_hidden_layers=2, max_position_embeddings=2048)
DRAFT = dict(TINY_DRAFT, max_position_embeddings=2048, num_target_layers=2,
             dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 1]})
MODES = ("dflash", "target")
SUMMARY = ("host", "host_cpu", "intake", "step", "publish", "flush", "forward")  # the printed line per step kind


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON result path")
    parser.add_argument("--modes", default=",".join(MODES), help="dflash,target")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--frontends", type=int, default=1, help="HTTP server processes the engine feeds "
                        "(--api-server-count; requests spread round-robin)")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients (requests running at once)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="mean; each request draws from [n/2, 3n/2]")
    parser.add_argument("--block-size", type=int, default=16, help="DFlash block (the shipped SmolLM2 draft: 16)")
    parser.add_argument("--accept-len", type=float, default=3.2, help="simulated DFlash accept length")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300, help="measured engine steps per mode")
    parser.add_argument("--radix-cache", action="store_true", help="keep the radix prefix cache on")
    parser.add_argument("--no-overlap", action="store_true", help="--disable-overlap-schedule")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="streaming clients")
    parser.add_argument("--profile", type=Path, help="cProfile of the measured steps (first mode) to this path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prefill-wait-steps", type=int, default=0, help="arrival batching (the serve flag)")
    parser.add_argument("--enable-mixed-chunk", action="store_true", help="arrivals' prefill in the decode forward "
                        "(the serve flag)")
    return parser.parse_args()


class Regions:
    """Seconds spent inside wrapped callables (outermost call only), by region name. `profiler`, while `profiling`,
    is paused inside them: its profile holds the host work alone."""

    def __init__(self, profiler: Optional[cProfile.Profile] = None) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.profiler = profiler
        self.profiling = False
        self.synchronize = False  # set by `instrument` for an engine on CUDA
        self._depth = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            paused = self.profiling and self.profiler is not None
            if paused:
                self.profiler.disable()  # type: ignore[union-attr]
            began, began_cpu = time.perf_counter(), time.thread_time()
            try:
                result = fn(*args, **kwargs)
                if self.synchronize and name != "device_wait":
                    torch.cuda.synchronize()  # NOTE: the forward's device time is the forward's, not a later sync's
                return result
            finally:
                self._depth -= 1
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
                self.seconds["cpu"] = self.seconds.get("cpu", 0.0) + time.thread_time() - began_cpu
                if paused:
                    self.profiler.enable()  # type: ignore[union-attr]
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        taken, (self.seconds, self.calls) = (self.seconds, self.calls), ({}, {})
        return taken


def write_models(root: Path, block_size: int) -> tuple[Path, Path]:
    target, draft = root / "target", root / "draft"
    for directory, config in ((target, TARGET), (draft, dict(DRAFT, block_size=block_size))):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
    return target, draft


def build_engine(mode: str, args: argparse.Namespace, target: Path, draft: Path) -> Engine:
    context = args.prompt_len + 2 * args.max_new_tokens
    flags: dict[str, Any] = dict(
        model_path=str(target), load_format="dummy", device=args.device, skip_tokenizer_init=True, host_threads=1,
        max_running_requests=args.clients, max_total_tokens=args.clients * (context + 4 * args.block_size),
        disable_radix_cache=not args.radix_cache, disable_overlap_schedule=args.no_overlap,
        max_prefill_wait_steps=args.max_prefill_wait_steps, enable_mixed_chunk=args.enable_mixed_chunk,
        cuda_graph_bs=[b for b in (1, 2, 4, 8, 16, 32, 48, 64) if b <= args.clients] or [args.clients],
    )
    if mode == "dflash":
        flags.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                     speculative_simulate_accept_len=args.accept_len, speculative_adaptive_verify="off")
    return Engine(**flags)


def instrument(engine: Engine, regions: Regions) -> Callable[[], None]:
    """Times the model forwards of this engine (instance attributes) and every device wait (a class attribute: the
    returned callable puts it back)."""
    runner = engine.runner
    regions.synchronize = runner.device.type == "cuda"
    runner.graphs.run = regions.wrap("uniform", runner.graphs.run)  # type: ignore[method-assign]
    runner.forward_extend = regions.wrap("extend", runner.forward_extend)  # type: ignore[method-assign]
    if engine.dflash_worker is not None:
        worker = engine.dflash_worker
        worker._materialise_draft_kv = regions.wrap(  # type: ignore[method-assign]
            "draft_kv", worker._materialise_draft_kv)
    if not torch.cuda.is_available():
        return lambda: None
    original = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = regions.wrap("device_wait", original)  # type: ignore[method-assign]
    return lambda: setattr(torch.cuda.Event, "synchronize", original)


class ClosedLoop:
    """Plays the HTTP server: adds requests through EngineCore's intake, reads its frames back, replaces the
    requests that finished. The PULL socket is read outside the timed part."""

    def __init__(self, engine: Engine, args: argparse.Namespace, workdir: Path) -> None:
        self.engine, self.args = engine, args
        self.rng, self.vocab = random.Random(args.seed), TARGET["vocab_size"]
        frontends = range(args.frontends)
        to_engine = [f"ipc://{workdir}/to{i}" for i in frontends]
        from_engine = [f"ipc://{workdir}/from{i}" for i in frontends]
        self.context = zmq.Context()
        self.pushes = [self.context.socket(zmq.PUSH) for _ in frontends]
        self.pulls = [self.context.socket(zmq.PULL) for _ in frontends]
        for push, pull, to, back in zip(self.pushes, self.pulls, to_engine, from_engine):
            push.bind(to)
            pull.bind(back)
        self.core = EngineCore(engine, to_engine, from_engine)
        self.core.links.connect()
        engine.scheduler.detokenize_all = False  # NOTE: as EngineCore.run sets it
        self.next_rid = 0
        self.live = 0
        self.tokens = 0

    def arrivals(self, count: int) -> list[wire.AddRequest]:
        out = []
        for _ in range(count):
            n = self.args.max_new_tokens
            params = {"temperature": 0.0, "ignore_eos": True,
                      "max_new_tokens": self.rng.randint(max(1, n // 2), n * 3 // 2)}
            prompt = [self.rng.randrange(4, self.vocab) for _ in range(self.args.prompt_len)]
            out.append(wire.AddRequest(f"r{self.next_rid}", prompt, params, self.args.stream, time.monotonic(),
                                       frontend=self.next_rid % self.args.frontends))
            self.next_rid += 1
        return out

    def read_back(self) -> int:
        """Frames the engine sent: returns how many requests finished (tokens counted)."""
        finished = 0
        for pull in self.pulls:
            while pull.poll(0):
                message = wire.decode_from_engine(pull.recv())
                if isinstance(message, wire.Outputs):
                    for delta in message.deltas:
                        finished += delta.output is not None or delta.error is not None
                        self.tokens += len(delta.ids)
        return finished

    def step(self, adds: list[wire.AddRequest]) -> tuple[float, dict[str, float]]:
        """One pass of EngineCore.run's loop with `adds` taken first; (wall s, phase s and the thread's CPU s).

        NOTE: `adds` go over the socket as one frame, in before the timed part, and the intake is EngineCore's own
        (`_drain`: the non-blocking receive, the frame's decoding, the requests' admission), as in the engine process;
        a step without arrivals times the receive that finds nothing."""
        core, scheduler = self.core, self.engine.scheduler
        if adds:
            self.pushes[0].send(wire.encode(list(adds)))  # NOTE: each request names its own frontend for the replies
            if not core.links.pull.poll(10_000):
                raise RuntimeError("the requests did not reach the engine's socket")
        t0, cpu = time.perf_counter(), time.thread_time()
        core._drain()
        t1 = time.perf_counter()
        finished = scheduler.step()
        t2 = time.perf_counter()
        core._publish(finished)
        t3 = time.perf_counter()
        core._flush(stats=True)
        t4 = time.perf_counter()
        return t4 - t0, {"intake": t1 - t0, "step": t2 - t1, "publish": t3 - t2, "flush": t4 - t3,
                         "cpu": time.thread_time() - cpu}

    def close(self) -> None:
        self.core.links.close()
        for socket in (*self.pushes, *self.pulls):
            socket.close(linger=0)
        self.context.term()


def measure(mode: str, args: argparse.Namespace, target: Path, draft: Path, workdir: Path,
            profile: Optional[Path]) -> dict[str, Any]:
    engine = build_engine(mode, args, target, draft)
    profiler = cProfile.Profile() if profile is not None else None
    regions = Regions(profiler)
    restore = instrument(engine, regions)
    loop = ClosedLoop(engine, args, workdir)
    scheduler = engine.scheduler
    rows: list[dict[str, Any]] = []
    pending = args.clients
    try:
        for index in range(args.warmup_steps + args.steps):
            measured = index >= args.warmup_steps
            adds = loop.arrivals(pending)
            running_before = len(scheduler.running)
            committed_before = loop.tokens
            regions.profiling = measured and profiler is not None
            if regions.profiling:
                profiler.enable()  # type: ignore[union-attr]
            wall, phases = loop.step(adds)
            if regions.profiling:
                profiler.disable()  # type: ignore[union-attr]
                regions.profiling = False
            seconds, calls = regions.take()
            pending = loop.read_back()
            if measured:
                forward = sum(seconds.get(k, 0.0) for k in ("uniform", "extend", "draft_kv"))
                wait = seconds.get("device_wait", 0.0)
                phases["host_cpu"] = phases.pop("cpu") - seconds.get("cpu", 0.0)
                rows.append(dict(wall=wall, host=wall - forward - wait, forward=forward, device_wait=wait,
                                 arrivals=len(adds), running=max(running_before, len(scheduler.running)),
                                 extend=calls.get("extend", 0) > 0, tokens=loop.tokens - committed_before, **phases))
        scheduler.drain()
    finally:
        loop.close()
        restore()
    if profiler is not None and profile is not None:
        profiler.dump_stats(str(profile))
    return summarize(mode, rows)


def summarize(mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(selected: list[dict[str, Any]]) -> dict[str, Any]:
        if not selected:
            return {"steps": 0}
        out: dict[str, Any] = {"steps": len(selected)}
        for key in ("wall", "host", "host_cpu", "forward", "device_wait", "intake", "step", "publish", "flush"):
            values = [r[key] * 1e6 for r in selected]
            out[f"{key}_us_mean"] = round(statistics.fmean(values), 1)
            out[f"{key}_us_median"] = round(statistics.median(values), 1)
        out["running_mean"] = round(running := statistics.fmean(r["running"] for r in selected), 2)
        out["host_us_per_request"] = round(out["host_us_mean"] / max(running, 1.0), 2)
        out["tokens_per_step"] = round(statistics.fmean(r["tokens"] for r in selected), 2)
        return out

    return {"mode": mode, "all": stats(rows), "extend_steps": stats([r for r in rows if r["extend"]]),
            "decode_steps": stats([r for r in rows if not r["extend"]]),
            "arrivals_per_step": round(statistics.fmean(r["arrivals"] for r in rows), 3) if rows else 0.0}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; one of {MODES}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_models(Path(tmp), args.block_size)
        for i, mode in enumerate(modes):
            (workdir := Path(tmp) / f"sockets-{mode}").mkdir()
            result = measure(mode, args, target, draft, workdir, args.profile if i == 0 else None)
            print(json.dumps(result), flush=True)
            for kind in ("decode_steps", "extend_steps"):
                row = result[kind]
                print(mode, kind, " ".join(f"{key}={row.get(key + '_us_mean')}" for key in SUMMARY), "(us per step)")
            results.append(result)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    out = {"benchmark": "host_overhead", **run_identity(), "device": torch.cuda.get_device_name() if cuda else "cpu",
           "args": {k: str(v) for k, v in vars(args).items()}, "torch_threads": torch.get_num_threads(),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
