"""Text → token ids for the HTTP server: every text queued while the encoder is busy goes into one `encode_batch`.

The Rust tokenizer encodes a batch's texts on its own threads without holding the GIL, where one call per text runs
them one after the other (a 4.2k-token chat prompt takes ≈ 4.5 ms: 32 arriving at once queued for ≈ 150 ms). The
encoder owns its `tokenizers.Tokenizer` (a copy of its own: HF fast tokenizers are not shared across threads) and
one thread; results reach the waiting coroutines through their event loop.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Optional, Union

from tokenizers import Tokenizer


@dataclass
class _Job:
    text: str
    add_special_tokens: bool
    loop: asyncio.AbstractEventLoop
    future: "asyncio.Future[list[int]]"


def _settle(future: "asyncio.Future[list[int]]", outcome: Union[list[int], BaseException]) -> None:
    if future.cancelled():  # NOTE: the client went away while its text was being encoded
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class BatchEncoder:
    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend  # the tokenizer it encodes with (only its thread calls it; tests may replace it)
        self.batches = 0  # encode_batch calls so far (each took every text queued at that moment)
        self._jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="blockspec-encode", daemon=True)
        self._thread.start()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, as `tokenizer.encode(text, add_special_tokens=...)` gives them; raises what the
        tokenizer raises for it."""
        loop = asyncio.get_running_loop()
        future: "asyncio.Future[list[int]]" = loop.create_future()
        self._jobs.put(_Job(text, add_special_tokens, loop, future))
        return await future

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs, stop = [job], False
            while not stop:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    jobs.append(more)
            for flag in (True, False):
                group = [j for j in jobs if j.add_special_tokens == flag]
                if group:
                    for j, outcome in zip(group, self._encode(group, flag)):
                        j.loop.call_soon_threadsafe(_settle, j.future, outcome)
            if stop:
                return

    def _encode(self, group: list[_Job], add_special_tokens: bool) -> list[Union[list[int], BaseException]]:
        self.batches += 1
        try:
            encodings = self.backend.encode_batch([j.text for j in group], add_special_tokens=add_special_tokens)
            return [list(e.ids) for e in encodings]
        except Exception:  # NOTE: one text the tokenizer refuses fails its batch: each alone then, for its own answer
            outcomes: list[Union[list[int], BaseException]] = []
            for j in group:
                try:
                    outcomes.append(list(self.backend.encode(j.text, add_special_tokens=add_special_tokens).ids))
                except Exception as exc:
                    outcomes.append(exc)
            return outcomes
