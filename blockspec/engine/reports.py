"""What the engine reports over the ZeroMQ boundary besides outputs: its limits once (`engine_info`, in Ready),
each finished request's timings (`finish_stat`, in StepStats) and where the serving loop's time goes (`LoopTimes`,
in /server_info)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

from blockspec.engine import wire
from blockspec.engine.engine import Engine
from blockspec.request import Req


def engine_info(engine: Engine) -> wire.EngineInfo:
    config = engine.config
    limits = engine.scheduler.limits
    return wire.EngineInfo(
        model_path=engine.model_id,
        tokenizer_path=config.tokenizer_path or config.model_path,
        trust_remote_code=config.trust_remote_code,
        has_tokenizer=engine.tokenizer is not None,
        context_length=engine.scheduler.context_length,
        vocab_size=engine.scheduler.vocab_size,
        total_slots=limits.total_slots,
        slots_per_decode=limits.slots_per_decode,
        decode_slots_per_req=engine.worker.decode_slots_per_req,
        max_running_requests=config.max_running_requests,
        pid=os.getpid(),
        chat_template=config.chat_template,
        startup=engine.startup.as_dict(),
    )


def between(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else end - start


def finish_stat(req: Req, now: float) -> wire.FinishStat:
    first = req.first_token_time
    return wire.FinishStat(
        reason=req.finish.reason.value if req.finish is not None else "unknown",
        prompt_tokens=req.prompt_len,
        completion_tokens=len(req.output_ids),
        e2e=now - req.arrival_time,
        ttft=between(req.arrival_time, first),
        decode_s=between(first, now),
        accept_lengths=list(req.spec_accept_lengths),
        receive_s=between(req.arrival_time, req.received_time),
        queue_s=between(req.received_time, req.scheduled_time),
        prefill_s=between(req.scheduled_time, first),
    )


@dataclass
class LoopTimes:
    """Seconds the engine process's serving loop spent outside `Scheduler.step` since start, by phase: waiting for a
    message while idle (`idle`), taking the messages that are there (`intake`), turning a step's tokens into deltas
    (`publish`) and sending what the servers are owed (`flush`, also in loops without a step). With the scheduler's
    `step_seconds` this is the loop's wall time, but for a failed step's clean-up and the loop's own bookkeeping.
    /server_info reports it as `internal_states[0]["serving_loop"]`."""

    intake_seconds: float = 0.0
    idle_seconds: float = 0.0
    publish_seconds: float = 0.0
    flush_seconds: float = 0.0
    loops: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
