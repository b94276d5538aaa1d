"""Detokenisation in the server process: the text of every request the engine does not detokenise itself (those
without stop strings), one `tokenizers` DecodeStream per request in flight, so the engine loop never decodes."""
from __future__ import annotations

from typing import Optional

from tokenizers import Tokenizer

from blockspec.tokenizer import TextStream


class OutputTexts:
    def __init__(self, backend: Optional[Tokenizer]) -> None:
        self.backend = backend  # None: no tokenizer (--skip-tokenizer-init), every text stays empty
        self._streams: dict[str, TextStream] = {}
        self._texts: dict[str, str] = {}

    def push(self, rid: str, ids: list[int], skip_special_tokens: bool, final: bool) -> str:
        """The text that `ids` (the request's next tokens) complete; on `final` also what was still pending."""
        if self.backend is None:
            return ""
        stream = self._streams.get(rid)
        if stream is None:
            stream = self._streams[rid] = TextStream(self.backend, skip_special_tokens)
        text = stream.push(ids)
        if final:
            text += stream.flush()
        self._texts[rid] = self._texts.get(rid, "") + text
        return text

    def finish(self, rid: str) -> str:
        """Forgets the request; returns its whole text."""
        self._streams.pop(rid, None)
        return self._texts.pop(rid, "")

    @property
    def in_flight(self) -> int:
        return len(self._streams)
