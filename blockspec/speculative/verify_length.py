"""How many block tokens a DFlash cycle verifies, per batch size: the verify length n (1 ≤ n ≤ B), or a DDTree
tree (speculative_tree_budget T: the verify length B + T stands for the tree cycle, whose input rows are that wide).

A cycle of verify length n verifies [bonus, d_1..d_{n-1}] (n - 1 proposals, the first of the draft's full block) and
commits accepted + 1 tokens, accepted ≤ n - 1; n = 1 is a plain target decode step (the draft does not run, the
bonus token's draft KV is still written, so speculation resumes losslessly in the next cycle). Policies:
- `FixedVerifyLength`: a schedule by batch size (`--speculative-num-draft-tokens-per-bs`, or n = B everywhere when
  adaptive verify is off).
- `AdaptiveVerifyLength`: the cost model. Expected committed tokens of a cycle, 1 + E[min(accepted, n - 1)], from the
  live per-position acceptance rates (`AcceptanceStats`), over the cycle time of (batch size, n) (`CycleTimes`:
  measured when graphs are captured, then refined by live cycles); the n with the most tokens per second wins. A tree
  cycle is one more candidate: its expected tokens are the live mean of its committed tokens (the chain's full block
  until measured), its cycle time measured like the others, so a tree runs only at the batch sizes where it pays.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence

from blockspec.config.speculative_flags import Schedule

MIN_CYCLE_SHARE = 0.1  # a cycle's estimate never drops below this share of its start-up figure
MEASURE_ATTEMPTS = 4  # chosen cycles per timed live cycle adaptive verify's measurement tries before it gives up


def default_verify_lengths(block_size: int) -> tuple[int, ...]:
    """The small set of verify lengths adaptive verify captures graphs for: 1, 4, halfway to B, and B."""
    return tuple(sorted({1, min(4, block_size), min(block_size, (4 + block_size) // 2), block_size}))


class AcceptanceStats:
    """Per-position acceptance of the draft's proposals from every verify, whatever its length.

    Position j (proposal d_j) was *tried* by a verify that checked it (n - 1 ≥ j) and accepted d_1..d_{j-1}, and
    *passed* when it accepted d_j too; rate_j = passed_j / tried_j, so a short verify (which never tries the later
    positions) biases no rate. Counts decay with a half-life in request-cycles (acceptance follows the workload's
    phases). A small prior of weight `prior_weight` fills positions seldom tried: `prior_rate` for position 1, the
    previous position's estimate for each later one (so positions a short verify never reaches extrapolate from the
    deepest measured one instead of an optimistic constant)."""

    def __init__(self, max_proposals: int, half_life: float = 4096.0, prior_rate: float = 0.8,
                 prior_weight: float = 2.0, tree_length: Optional[int] = None) -> None:
        self.max_proposals = max_proposals
        # NOTE: the verify length that stands for a DDTree cycle (None: none); its cycles are counted apart
        self.tree_length = tree_length
        self.tree_cycles = 0.0
        self.tree_committed = 0.0
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        self.tried = [0.0] * max_proposals  # NOTE: index j - 1 holds position j (proposal d_j)
        self.passed = [0.0] * max_proposals
        # NOTE: kept until the next observe (each cycle's choice asks ≥ 4x)
        self._survival: Optional[list[float]] = None

    def observe(self, num_draft_tokens: int, accepted: Sequence[int]) -> None:
        """One cycle of verify length `num_draft_tokens`; `accepted[i]`: proposals row i accepted (tree cycles: the
        nodes its walk accepted)."""
        fade = self.decay ** len(accepted)
        if num_draft_tokens == self.tree_length:
            self.tree_cycles = self.tree_cycles * fade + len(accepted)
            self.tree_committed = self.tree_committed * fade + sum(accepted) + len(accepted)
            return
        at_least = [0] * (self.max_proposals + 2)
        for a in accepted:
            at_least[a] += 1
        for count in range(self.max_proposals, -1, -1):
            at_least[count] += at_least[count + 1]
        for j in range(self.max_proposals):
            tried = at_least[j] if j < num_draft_tokens - 1 else 0
            self.tried[j] = self.tried[j] * fade + tried
            self.passed[j] = self.passed[j] * fade + (at_least[j + 1] if tried else 0)
        self._survival = None

    def rates(self) -> list[float]:
        """P(d_j accepted | d_1..d_{j-1} accepted), j = 1..B-1."""
        w, prior, out = self.prior_weight, self.prior_rate, []
        for tried, passed in zip(self.tried, self.passed):
            prior = (passed + w * prior) / (tried + w)
            out.append(prior)
        return out

    def survival(self) -> list[float]:
        """P(accepted ≥ j), j = 1..B-1."""
        return list(self._cached_survival())

    def _cached_survival(self) -> list[float]:
        if self._survival is None:
            out, alive = [], 1.0
            for rate in self.rates():
                alive *= rate
                out.append(alive)
            self._survival = out
        return self._survival

    def expected_tokens(self, num_draft_tokens: int) -> float:
        """Tokens a cycle of this verify length commits on average: 1 + E[min(accepted, n - 1)]; for the tree's
        length the live mean over tree cycles, with the chain's full block as a prior of `prior_weight` cycles."""
        chain = 1.0 + sum(self._cached_survival()[: min(num_draft_tokens, self.max_proposals + 1) - 1])
        if num_draft_tokens != self.tree_length:
            return chain
        return (self.tree_committed + self.prior_weight * chain) / (self.tree_cycles + self.prior_weight)


class CycleTimes:
    """ms per cycle by (batch size, verify length) at the measured batch sizes (the captured graph sizes: a batch
    runs in the next one up): the start-up figure plus a live offset per batch size.

    NOTE: start-up cycles run on padding rows (a near-empty context). A served batch's context adds about the same
    time to a chain cycle of any verify length (each reads the whole target KV once with the same kernels), so one
    additive offset per batch size, an exponential average of (live − start-up) over whichever chain lengths ran,
    corrects every chain length. A DDTree cycle (`tree_length`) runs other kernels (the tree-masked attention, the
    tree build and compaction), so its live time can grow apart from the chain's: it adds its own excess over the
    chain's offset, learnt from its own live cycles (none until one is seen), and its cycles leave the chain's offset
    alone. A tree timed before any chain cycle keeps its live price when the chain's first cycle sets the offset."""

    def __init__(self, measured: dict[tuple[int, int], float], live_weight: float = 0.2,
                 tree_length: Optional[int] = None) -> None:
        if not measured:
            raise ValueError("adaptive verify needs at least one measured cycle time")
        self.startup_ms = dict(measured)
        self.batch_sizes = sorted({bs for bs, _ in measured})
        self.live_weight = live_weight
        self.tree_length = tree_length
        self.offset_ms = {bs: 0.0 for bs in self.batch_sizes}
        self.live_cycles = {bs: 0 for bs in self.batch_sizes}
        self.tree_excess_ms = {bs: 0.0 for bs in self.batch_sizes}
        self.tree_live_cycles = {bs: 0 for bs in self.batch_sizes}

    def reset_live(self) -> None:
        """Forgets every live cycle (start-up figures kept): e.g. after warm-up traffic."""
        self.offset_ms = {bs: 0.0 for bs in self.batch_sizes}
        self.live_cycles = {bs: 0 for bs in self.batch_sizes}
        self.tree_excess_ms = {bs: 0.0 for bs in self.batch_sizes}
        self.tree_live_cycles = {bs: 0 for bs in self.batch_sizes}

    def bucket(self, batch_size: int) -> int:
        """The measured batch size whose times stand for `batch_size` (the largest beyond it)."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[min(i, len(self.batch_sizes) - 1)]

    def cycle_ms(self, batch_size: int, num_draft_tokens: int) -> float:
        bucket = self.bucket(batch_size)
        startup = self.startup_ms[(bucket, num_draft_tokens)]
        offset = self.offset_ms[bucket]
        if num_draft_tokens == self.tree_length:
            offset += self.tree_excess_ms[bucket]
        # NOTE: start-up figures are wall clock, live ones device time: a large negative offset must not reach 0.
        return max(startup + offset, MIN_CYCLE_SHARE * startup)

    def observe(self, batch_size: int, num_draft_tokens: int, ms: float) -> None:
        """A live cycle's device time; batches above the largest measured size (eager, not graphed) are left out."""
        if batch_size > self.batch_sizes[-1]:
            return
        bucket = self.bucket(batch_size)
        if (bucket, num_draft_tokens) not in self.startup_ms:
            return
        offset = ms - self.startup_ms[(bucket, num_draft_tokens)]
        if num_draft_tokens == self.tree_length:
            excess = offset - self.offset_ms[bucket]
            self.tree_excess_ms[bucket] += self._weight(self.tree_live_cycles, bucket) * (
                excess - self.tree_excess_ms[bucket])
            return
        first, before = self.live_cycles[bucket] == 0, self.offset_ms[bucket]
        self.offset_ms[bucket] += self._weight(self.live_cycles, bucket) * (offset - before)
        if first and self.tree_live_cycles[bucket]:
            # NOTE: the tree, timed first, measured its excess over a chain offset nobody had measured: the chain's
            # first cycle corrects the chain's start-up figure, not the tree's live price
            self.tree_excess_ms[bucket] -= self.offset_ms[bucket] - before

    def _weight(self, seen: dict[int, int], bucket: int) -> float:
        """The exponential average's weight for one more live cycle of `bucket`, counted in `seen`. NOTE: the first
        one replaces the guess (the start-up figure; no tree excess)."""
        seen[bucket] += 1
        return max(self.live_weight, 1.0 / seen[bucket])


@dataclass(frozen=True)
class VerifyChoice:
    num_draft_tokens: int
    reason: str
    expected_tokens: Optional[float] = None
    cycle_ms: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


class VerifyLengthPolicy(Protocol):
    """Picks each cycle's verify length for its batch size; `lengths` are the ones graphs are captured for, `last`
    the latest choice per batch size (for /server_info and /metrics)."""

    lengths: tuple[int, ...]
    last: dict[int, VerifyChoice]

    def choose(self, batch_size: int, stats: AcceptanceStats) -> VerifyChoice: ...

    def observe_cycle(self, batch_size: int, num_draft_tokens: int, ms: float) -> None: ...

    def reset_live(self) -> None:
        """Forgets the choices and live timings so far (start-up measurements kept)."""

    def describe(self, stats: AcceptanceStats) -> dict[str, Any]: ...


class CycleCounts:
    """Cycles per (batch size, verify length) since start-up or the last reset: /server_info's
    cycles_by_verify_length (which lengths, and how often the tree, a policy really ran)."""

    def __init__(self) -> None:
        self.counts: dict[int, dict[int, int]] = {}

    def add(self, batch_size: int, num_draft_tokens: int) -> None:
        row = self.counts.setdefault(batch_size, {})
        row[num_draft_tokens] = row.get(num_draft_tokens, 0) + 1

    def clear(self) -> None:
        self.counts.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {str(bs): {str(n): c for n, c in sorted(row.items())} for bs, row in sorted(self.counts.items())}


class Option(NamedTuple):
    """One verify length's expected tokens per cycle and cycle time at a batch size."""

    n: int
    tokens: float
    ms: float

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens / self.ms

    def as_dict(self) -> dict[str, Any]:
        return {"num_draft_tokens": self.n, "expected_tokens": self.tokens, "cycle_ms": self.ms,
                "tokens_per_s_per_request": self.tokens_per_ms * 1e3}


class FixedVerifyLength:
    """Verify length from a schedule by batch size (adaptive verify off: the full block B everywhere)."""

    def __init__(self, schedule: Schedule, block_size: int, reason: str, tree_length: Optional[int] = None) -> None:
        bad = [n for _, _, n in schedule if n > block_size and n != tree_length]
        if bad:
            raise ValueError(
                f"speculative_num_draft_tokens_per_bs: verify length {bad[0]} exceeds the block size {block_size}"
            )
        self.schedule = schedule
        self.block_size = block_size
        self.reason = reason
        self.lengths = tuple(sorted({n for _, _, n in schedule}))
        self.last: dict[int, VerifyChoice] = {}
        self.cycles_run = CycleCounts()

    def choose(self, batch_size: int, stats: AcceptanceStats) -> VerifyChoice:
        n = next((n for lo, hi, n in self.schedule if lo <= batch_size <= hi), self.schedule[-1][2])
        choice = VerifyChoice(n, self.reason, stats.expected_tokens(n))
        self.last[batch_size] = choice
        self.cycles_run.add(batch_size, n)
        return choice

    def observe_cycle(self, batch_size: int, num_draft_tokens: int, ms: float) -> None:
        """Fixed lengths ignore cycle times."""

    def reset_live(self) -> None:
        self.last.clear()
        self.cycles_run.clear()

    def describe(self, stats: AcceptanceStats) -> dict[str, Any]:
        return {"mode": "fixed", "reason": self.reason, "verify_lengths": list(self.lengths),
                "schedule": [{"batch_sizes": [lo, hi], "num_draft_tokens": n} for lo, hi, n in self.schedule],
                "in_use": {str(bs): c.as_dict() for bs, c in sorted(self.last.items())},
                "cycles_by_verify_length": self.cycles_run.as_dict()}


def full_block(block_size: int, reason: str) -> FixedVerifyLength:
    return FixedVerifyLength([(1, 1 << 30, block_size)], block_size, reason)


class AdaptiveVerifyLength:
    """The verify length with the most expected tokens per second at each batch size.

    NOTE: every `explore_every`-th cycle of a batch size whose best length is not the only one runs a neighbouring
    length instead (alternately shorter and longer), so the rates of positions the best length never tries, and the
    live times of the other lengths, stay measured. A tree's acceptance is only its prior (the chain's full block)
    until tree cycles are seen, and the prior never ranks a costlier tree first: until stats hold
    `measure_tree_until` request-cycles of trees, every `measure_tree_every`-th cycle runs the tree, so its own
    acceptance decides. NOTE: several request-cycles, not the prior's weight: at batch 1 two unlucky first trees (few
    accepted tokens) would otherwise price the tree below the chain for the next 128 cycles (until exploration).
    Cycle times are measured per graph batch size the same way, for the tree and the chain alike: until each was
    timed live `time_cycles` times at the batch size whose graphs serve this batch (or was tried `MEASURE_ATTEMPTS`
    times as often), every `measure_tree_every`-th cycle there runs the one that is not best (the tree, or the best
    chain length). NOTE: the tree's acceptance, once measured
    at one batch size, holds at all; start-up times need not: taken on padding rows and waited for by the host, they
    read above live device times by amounts that differ between the tree's graph and the chain's. Priced one from
    its live cycles and the other from its start-up figure, a tree never run at a batch size was never chosen there
    (nor explored: exploration steps to the best length's neighbours), and a tree timed live beat a chain priced at
    its start-up figure where it lost."""

    def __init__(self, lengths: Sequence[int], times: CycleTimes, explore_every: int = 64,
                 measure_tree_every: int = 4, measure_tree_until: float = 8.0, time_cycles: int = 2) -> None:
        self.lengths = tuple(sorted(set(lengths)))
        missing = [
            key for key in ((bs, n) for bs in times.batch_sizes for n in self.lengths) if key not in times.startup_ms
        ]
        if missing:
            raise ValueError(f"adaptive verify: no measured cycle time for (batch size, verify length) {missing[0]}")
        self.times = times
        self.explore_every = explore_every
        self.measure_tree_every = measure_tree_every
        self.measure_tree_until = measure_tree_until
        self.time_cycles = time_cycles
        self.cycles: dict[int, int] = {}
        # NOTE: cycles chosen per (graph batch size, whether a tree) at graphed batch sizes: the measurement asks for
        # `time_cycles` timed live cycles, and gives up after `MEASURE_ATTEMPTS` times as many chosen ones (cycles
        # that are not timed live, such as sampled batches' or mixed steps', must not keep it going forever)
        self.runs: dict[tuple[int, bool], int] = {}
        self.last: dict[int, VerifyChoice] = {}
        self.cycles_run = CycleCounts()

    def options(self, batch_size: int, stats: AcceptanceStats) -> list[Option]:
        return [Option(n, stats.expected_tokens(n), self.times.cycle_ms(batch_size, n)) for n in self.lengths]

    def choose(self, batch_size: int, stats: AcceptanceStats) -> VerifyChoice:
        choice = self._choose(batch_size, stats)
        self.cycles_run.add(batch_size, choice.num_draft_tokens)
        # NOTE: batches above the largest graph run eagerly and are not timed: they measure no graph batch size
        if stats.tree_length is not None and batch_size <= self.times.batch_sizes[-1]:
            key = (self.times.bucket(batch_size), choice.num_draft_tokens == stats.tree_length)
            self.runs[key] = self.runs.get(key, 0) + 1
        return choice

    def _untimed(self, batch_size: int, tree: bool) -> bool:
        """Whether the tree's (or the chain's) cycle time at this batch size's graphs is still to be measured live."""
        if batch_size > self.times.batch_sizes[-1]:
            return False
        bucket = self.times.bucket(batch_size)
        timed = (self.times.tree_live_cycles if tree else self.times.live_cycles)[bucket]
        return timed < self.time_cycles and self.runs.get((bucket, tree), 0) < MEASURE_ATTEMPTS * self.time_cycles

    def _choose(self, batch_size: int, stats: AcceptanceStats) -> VerifyChoice:
        options = self.options(batch_size, stats)
        ranked = sorted(range(len(options)), key=lambda i: options[i].tokens_per_ms)
        best_at, best = ranked[-1], options[ranked[-1]]
        second = options[ranked[-2]] if len(options) > 1 else best
        reason = (f"best of {list(self.lengths)} by expected tokens / cycle time: {best.tokens:.2f} tokens in "
                  f"{best.ms:.2f} ms (next: n={second.n}, {second.tokens:.2f} in {second.ms:.2f} ms)")
        self.last[batch_size] = VerifyChoice(best.n, reason, best.tokens, best.ms)
        cycle = self.cycles[batch_size] = self.cycles.get(batch_size, 0) + 1
        tree = next((option for option in options if option.n == stats.tree_length), None)
        if tree is not None and cycle % self.measure_tree_every == 0:
            if tree is not best and (stats.tree_cycles < self.measure_tree_until or self._untimed(batch_size, True)):
                return VerifyChoice(tree.n, "measuring the tree", tree.tokens, tree.ms)
            if tree is best and self._untimed(batch_size, False):
                chain = max((option for option in options if option is not tree), key=lambda o: o.tokens_per_ms)
                return VerifyChoice(chain.n, "timing the chain", chain.tokens, chain.ms)
        if len(options) > 1 and cycle % self.explore_every == 0:
            step = -1 if (cycle // self.explore_every) % 2 else 1
            at = best_at + step if 0 <= best_at + step < len(options) else best_at - step
            return VerifyChoice(options[at].n, "exploring", options[at].tokens, options[at].ms)
        return self.last[batch_size]

    def observe_cycle(self, batch_size: int, num_draft_tokens: int, ms: float) -> None:
        self.times.observe(batch_size, num_draft_tokens, ms)

    def reset_live(self) -> None:
        self.cycles.clear()
        self.runs.clear()
        self.last.clear()
        self.cycles_run.clear()
        self.times.reset_live()

    def describe(self, stats: AcceptanceStats) -> dict[str, Any]:
        table = {str(bs): [option.as_dict() for option in self.options(bs, stats)] for bs in self.times.batch_sizes}
        return {"mode": "adaptive", "verify_lengths": list(self.lengths),
                "in_use": {str(bs): c.as_dict() for bs, c in sorted(self.last.items())},
                "cycle_ms_startup": {f"{bs}x{n}": ms for (bs, n), ms in sorted(self.times.startup_ms.items())},
                "cycle_ms_live_offset": {str(bs): ms for bs, ms in self.times.offset_ms.items()},
                "tree_cycle_ms_live_excess": {str(bs): ms for bs, ms in self.times.tree_excess_ms.items()},
                "cycles_by_verify_length": self.cycles_run.as_dict(), "cost_model": table}
