"""A tqdm bar's token count while an engine generates (`Engine.generate_iter`'s `on_step`): requests that run together
finish together, so a bar of finished prompts alone would sit at 0 for the whole batch."""
from __future__ import annotations

import time

from tqdm import tqdm

REDRAW_INTERVAL_S = 1.0  # the token count is redrawn at most this often


class TokenPostfix:
    """`on_step(tokens)`: shows the tokens generated so far and their rate after the bar's count, redrawn at most every
    `redraw_interval_s`."""

    def __init__(self, bar: tqdm, redraw_interval_s: float = REDRAW_INTERVAL_S) -> None:
        self.bar = bar
        self.redraw_interval_s = redraw_interval_s
        self.started = time.perf_counter()
        self.drawn = self.started

    def __call__(self, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.drawn >= self.redraw_interval_s:
            self.drawn = now
            self.bar.set_postfix_str(f"{tokens} tokens, {tokens / (now - self.started):.0f} token/s")
