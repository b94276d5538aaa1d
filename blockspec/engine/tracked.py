"""What the engine loop (engine/core.py) keeps per request it answers."""
from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.request import Req


@dataclass(slots=True)
class TrackedRequest:
    """A request the engine loop answers: where its deltas go and how far they got."""

    req: Req
    stream: bool
    frontend: int = 0
    sent_text: int = 0
    stops: list[str] = field(default_factory=list)
    client_aborted: bool = False
    # NOTE: req.all_ids (the same list: it only grows) and the index in it up to which ids were sent
    ids: list[int] = field(init=False)
    sent_end: int = field(init=False)

    def __post_init__(self) -> None:
        self.ids = self.req.all_ids
        self.sent_end = self.req.prompt_len

    @property
    def ids_only(self) -> bool:
        """A stream whose deltas are token ids alone (the server process makes its text; no logprobs)."""
        return self.stream and not self.req.detokenized and self.req.top_logprobs_num is None
