"""Structured output through xgrammar: a JSON schema, a regex or an EBNF grammar constrains the tokens a request may
commit. Target logits are masked before sampling (greedy argmax, temperature/top-p and rejection sampling all see the
constrained distribution), so a constrained request's output always matches its grammar.

Under DFlash a verify block's row j is the distribution of block token j+1: it is masked with the matcher advanced
along the proposals d_1..d_j, then the matcher rolls back, so committed output equals constrained target-only
decoding. The draft's proposals are constrained the same way (row by row, each after the ones before it): that only
changes what is proposed, never what is committed. Under DDTree every tree row is masked with the matcher advanced
along its path from the root (a depth-first visit with rollbacks); the tree itself is built from the unmasked draft.

NOTE: a request's matcher always stands at its committed output: the scheduler advances it on every committed token;
the workers only advance it tentatively and roll back before they return.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from blockspec.request import GrammarSpec

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase


class GrammarCompiler:
    """Compiles grammars for one tokenizer on a worker thread, caching compiled grammars by GrammarSpec (LRU)."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        import xgrammar as xgr

        # NOTE: here, on the caller's thread (once, ~0.4 s at 150k tokens): the tokenizer is not shared across threads
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="blockspec-grammar")
        self._cache: OrderedDict[GrammarSpec, Future["xgrammar.CompiledGrammar"]] = OrderedDict()
        self._cache_size = cache_size
        self.vocab_size = vocab_size

    def _compile(self, spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
        if spec.kind == "json_schema":
            # NOTE: no free whitespace between JSON tokens: a model can't fill the output with it (valid JSON either
            # way)
            return self._compiler.compile_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.source)
        return self._compiler.compile_grammar(spec.source)

    def start(self, spec: GrammarSpec) -> "RequestGrammar":
        """A request's grammar; compiling starts now (overlapping the prompt's prefill) unless it is cached."""
        future = self._cache.pop(spec, None)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return RequestGrammar(spec, future, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's matcher over its compiled grammar (created when first needed: compiling may still run)."""

    def __init__(self, spec: GrammarSpec, compiled: Future["xgrammar.CompiledGrammar"], vocab_size: int) -> None:
        self.spec = spec
        self._compiled = compiled
        self._matcher: Optional["xgrammar.GrammarMatcher"] = None
        self.vocab_size = vocab_size

    @property
    def matcher(self) -> "xgrammar.GrammarMatcher":
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advances past a committed token; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token)))

    def _bitmask(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def masked(self, logits: torch.Tensor, drafted: Sequence[int] = ()) -> torch.Tensor:
        """float32 copy of `logits` [k, V] with row j restricted to what the grammar allows after the committed output
        + drafted[:j]. Rows after a drafted token the grammar rejects stay unmasked: acceptance stops before them."""
        import xgrammar as xgr

        matcher, rows = self.matcher, logits.shape[0]
        bitmask = self._bitmask(rows)
        advanced = 0
        for j in range(rows):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, j)
            if j == rows - 1 or j >= len(drafted) or not matcher.accept_token(int(drafted[j])):
                break
            advanced += 1
        matcher.rollback(advanced)
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=min(self.vocab_size, out.shape[-1]))
        return out

    def masked_tree(self, logits: torch.Tensor, row_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """float32 copy of a draft tree's rows `logits` [R, V] (row 0 the root, the last committed token; a row's
        parent `parents[r]` comes before it) with row r restricted to what the grammar allows after the committed
        output + the tokens `row_tokens` of r's path below the root. Rows under a token the grammar rejects, or past
        its end, stay unmasked: a walk steps to a child only on the token drawn from its parent's masked row, so it
        never reaches them."""
        import xgrammar as xgr

        matcher, rows = self.matcher, logits.shape[0]
        bitmask = self._bitmask(rows)
        children: list[list[int]] = [[] for _ in range(rows)]
        for row in range(1, rows):
            children[parents[row]].append(row)
        roll_back = -1  # NOTE: on the stack below a visited child's subtree: undo the token that child accepted
        pending = [0]  # NOTE: depth first
        while pending:
            row = pending.pop()
            if row == roll_back:
                matcher.rollback(1)
                continue
            if row > 0 and not matcher.accept_token(int(row_tokens[row])):
                continue
            if row > 0:
                pending.append(roll_back)
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                pending.extend(children[row])
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=min(self.vocab_size, out.shape[-1]))
        return out

    def walk(self, rows: int, choose: Callable[[int, Optional[torch.Tensor]], int], vocab_width: int) -> list[int]:
        """Proposals d_1..d_rows: `choose(j, allowed)` picks d_j given the tokens the grammar allows after the
        committed output + d_1..d_{j-1} (bool [vocab_width], on the CPU; None past a terminated grammar or a token it
        rejected: those rows are unconstrained)."""
        matcher = self.matcher
        bitmask = self._bitmask(1)
        tokens: list[int] = []
        advanced, constrained = 0, True
        for j in range(rows):
            constrained = constrained and not matcher.is_terminated()
            allowed = None
            if constrained:
                matcher.fill_next_token_bitmask(bitmask, 0)
                allowed = self._allowed(bitmask, vocab_width)
            tokens.append(choose(j, allowed))
            if constrained:
                constrained = bool(matcher.accept_token(tokens[-1]))
                advanced += int(constrained)
        matcher.rollback(advanced)
        return tokens

    def _allowed(self, bitmask: torch.Tensor, vocab_width: int) -> torch.Tensor:
        """bool [vocab_width]: the tokens a filled one-row bitmask allows (tokens past the grammar's vocabulary, an
        lm_head's padding, stay allowed as `masked` leaves them)."""
        import xgrammar as xgr

        scores = torch.zeros((1, vocab_width))
        xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=min(self.vocab_size, vocab_width))
        return torch.isfinite(scores[0])


def constrain_rows(logits: torch.Tensor, grammars: Sequence[Optional[RequestGrammar]]) -> torch.Tensor:
    """`logits` [n, V] with row i masked by grammars[i] where one is set (a copy only then)."""
    if all(grammar is None for grammar in grammars):
        return logits
    out = logits.float().clone()
    for i, grammar in enumerate(grammars):
        if grammar is not None:
            out[i] = grammar.masked(logits[i:i + 1])[0]
    return out
