"""What one engine step runs (StepPlan) and what it commits (Committed)."""
from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.request import Req


@dataclass
class ExtendChunk:
    """`length` more prompt tokens of `req` get KV (its slots up to kv_len + length are already allocated)."""

    req: Req
    length: int


@dataclass
class StepPlan:
    """One engine step: some requests extend (prefill chunks) while others decode a token or verify a block.

    A plan with both parts runs as one target forward (--enable-mixed-chunk; `Worker.mixed`)."""

    extend: list[ExtendChunk] = field(default_factory=list)
    decode: list[Req] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.extend or self.decode)


@dataclass
class Committed:
    """Tokens a step produced for `req`, its KV already advanced past them; the scheduler appends them up to the
    first finish condition. `verified`: a decode step's tokens (one verify, for the speculative statistics), not an
    extend's first token."""

    req: Req
    tokens: list[int]
    verified: bool
