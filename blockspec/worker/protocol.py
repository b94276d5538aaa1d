"""The Worker protocol: everything the scheduler, the step executor, start-up and the engine ask of a worker.

Two workers implement it: TargetWorker (target-only decoding, worker/target_worker.py) and DFlashWorker (draft
propose + target verify, speculative/dflash.py). Callers use this interface, never the concrete class; what only
speculative decoding has (a draft attention backend, verify lengths, acceptance statistics) has a target-only answer
(None, the one decode length, nothing to pin or forget).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Optional, Protocol, Sequence

import torch

from blockspec.attention.base import AttentionBackend
from blockspec.batch import ForwardBatch
from blockspec.models.llama import ModelOutput
from blockspec.request import Req
from blockspec.runner.graph_kind import GraphKind
from blockspec.runner.graphs import EagerForward
from blockspec.runner.model_runner import ModelRunner
from blockspec.worker.inflight import FirstTokens, InFlightStep


@dataclass(frozen=True)
class VerifyLengthChoice:
    """The verify length a speculative worker last chose for one batch size, and what it expected of it."""

    batch_size: int
    num_draft_tokens: int
    expected_tokens: Optional[float]
    cycle_ms: Optional[float]


@dataclass(frozen=True)
class TreeShape:
    """A DDTree worker's tree cycle: the verify length standing for it among `uniform_lengths` (block + budget: its
    input rows are that wide), the tokens per request of its tree verify (root + budget) and of its draft (block)."""

    cycle_length: int
    verify_rows: int
    draft_rows: int


def chain_lengths(uniform_lengths: Sequence[int], tree: Optional[TreeShape]) -> tuple[int, ...]:
    """The verify lengths of chain cycles among a worker's `uniform_lengths`: all but the tree cycle's."""
    return tuple(n for n in uniform_lengths if tree is None or n != tree.cycle_length)


@dataclass(frozen=True)
class SpeculativeState:
    """A speculative worker's live state, as the engine reports it (get_server_info, the engine process's stats)."""

    verify_length: dict[str, Any]  # the policy in use per batch size and why, the acceptance it assumed
    choices: list[VerifyLengthChoice]  # by batch size, ascending
    position_rates: list[float]  # P(d_j accepted | d_1..d_{j-1} accepted), j = 1..B-1


class Worker(Protocol):
    """Runs forwards for a step and samples or verifies their tokens."""

    @property
    def runner(self) -> ModelRunner: ...

    @property
    def decode_slots_per_req(self) -> int: ...

    @property
    def is_speculative(self) -> bool: ...

    @property
    def tree_shape(self) -> Optional["TreeShape"]:
        """Its DDTree cycle's shapes; None when it verifies no trees."""
        ...

    @property
    def draft_attention(self) -> Optional[AttentionBackend]:
        """The draft's attention backend (start-up warms its kernels); None without a draft."""
        ...

    @property
    def uniform_lengths(self) -> tuple[int, ...]:
        """Tokens per request of every uniform forward it may run: 1 (decode), or each verify length (DFlash)."""
        ...

    def init_cuda_graphs(self) -> None: ...

    def extend_forward(self, batch: ForwardBatch) -> ModelOutput: ...

    def uniform_forward_fn(self, kind: GraphKind, tokens_per_req: int) -> EagerForward: ...

    def extend(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> list[Optional[int]]: ...

    def extend_logits(self, reqs: Sequence[Req], chunk_lens: Sequence[int]) -> torch.Tensor: ...

    def first_tokens(self, reqs: Sequence[Req], logits: torch.Tensor) -> list[Optional[int]]: ...

    def decode(self, reqs: Sequence[Req]) -> list[list[int]]: ...

    def mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req]
    ) -> tuple[list[Optional[int]], list[list[int]]]: ...

    def can_run_ahead(self, reqs: Sequence[Req]) -> bool: ...

    def launch_mixed(
        self, reqs: Sequence[Req], chunk_lens: Sequence[int], decode_reqs: Sequence[Req], carry: Optional[InFlightStep]
    ) -> tuple[InFlightStep, Optional[FirstTokens]]:
        """Launches one forward of prefill chunks and a greedy decode step of `decode_reqs` without waiting for it,
        behind `carry` (the step in flight, uncommitted: its requests decode the token it produces); the decode part
        as a step in flight and the first tokens of the requests whose prompt it completes (on the device). Target-only
        workers only: the executor drains and runs `mixed` for a speculative one."""
        ...

    def launch(self, reqs: Sequence[Req], carry: Optional[InFlightStep] = None,
               first: Optional[FirstTokens] = None) -> InFlightStep: ...

    def finish(self, step: InFlightStep) -> list[Optional[list[int]]]: ...

    def pinned_verify_length(self, num_draft_tokens: int) -> ContextManager[None]:
        """Every cycle inside verifies `num_draft_tokens` tokens (start-up compiles each length's eager path)."""
        ...

    def forget_live_state(self) -> None:
        """Forgets what served traffic taught it (DFlash: acceptance, verify-length choices); e.g. after warm-up."""
        ...

    def speculative_state(self) -> Optional[SpeculativeState]:
        """Its live speculative state for the engine's reports; None without speculation."""
        ...
