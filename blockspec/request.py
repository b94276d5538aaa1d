"""Requests, sampling parameters, grammar specs and finish reasons; the generate APIs' per-prompt arguments."""
from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch

_request_counter = itertools.count()
# NOTE: SGLang's _SAMPLING_EPS: a temperature this small is greedy decoding (SGLang samples it with top_k = 1). Below it
# the float32 division of the logits by the temperature loses the distribution: at 1e-38 and under it overflows to
# inf (NaN probabilities), and no such temperature differs from greedy in any token a float32 softmax could draw.
GREEDY_TEMPERATURE = 1e-6

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """What a request is constrained by: `kind` one of GRAMMAR_FIELDS, `source` its text (the compile cache key)."""

    kind: str
    source: str


def check_grammar(spec: GrammarSpec) -> None:
    """Raises ValueError naming the field when `spec` does not parse (no tokenizer needed: cheap, any process)."""
    import xgrammar as xgr

    parse: dict[str, Callable[[str], object]] = {
        "json_schema": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf,
    }
    if not isinstance(spec.source, str) or not spec.source.strip():
        raise ValueError(f"{spec.kind} must be a non-empty string")
    try:
        parse[spec.kind](spec.source)
    except Exception as exc:  # NOTE: xgrammar raises RuntimeError (or its own types) with the parser's message
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{spec.kind} is not valid: {message}") from exc


class GrammarMatcher(Protocol):
    """A constrained request's grammar matcher as the scheduler and the workers use it (sample/grammar.py's
    RequestGrammar implements it), named here so the request needs nothing of the sampling layer. NOTE: it always
    stands at the request's committed output; `masked` and `walk` advance it tentatively and roll back."""

    spec: GrammarSpec

    @property
    def terminated(self) -> bool: ...

    def accept(self, token: int) -> bool: ...

    def masked(self, logits: torch.Tensor, drafted: Sequence[int] = ()) -> torch.Tensor: ...

    def walk(self, rows: int, choose: Callable[[int, Optional[torch.Tensor]], int], vocab_width: int
             ) -> list[int]: ...


@dataclass
class SamplingParams:
    """Per-request sampling settings, SGLang names. Validated by `validate()`."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (as a string, like OpenAI's) -> bias
    json_schema: Optional[str] = None  # structured output (sample/grammar.py): at most one of json_schema, regex, ebnf
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    @classmethod
    def from_dict(cls, raw: Optional[dict[str, Any]]) -> "SamplingParams":
        raw = dict(raw or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(raw.get("stop"), str):
            raw["stop"] = [raw["stop"]]
        for key in ("stop", "stop_token_ids"):
            if raw.get(key) is None:
                raw.pop(key, None)
        params = cls(**raw)
        params.validate()
        return params

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (lists and dicts copied): what `from_dict` reads back. dataclasses.asdict's generic
        deep copy cost more than the rest of a request's submission."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["stop"], out["stop_token_ids"], out["logit_bias"] = (
            list(self.stop),
            list(self.stop_token_ids),
            dict(self.logit_bias),
        )
        return out

    def validate(self) -> None:
        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or not isinstance(self.stop_token_ids, list):
            raise ValueError("stop must be a string or a list of strings; stop_token_ids a list of integers")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.min_new_tokens, int) or isinstance(self.min_new_tokens, bool) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        for token, bias in self.logit_bias.items():
            if not (isinstance(token, str) and token.isdigit()) and not (
                isinstance(token, int) and not isinstance(token, bool) and token >= 0
            ):
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not number(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token!r}")
        self.logit_bias = {str(int(token)): float(bias) for token, bias in self.logit_bias.items()}
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(
                f"{grammars[0]} and {grammars[1]} cannot be combined: give one of {', '.join(GRAMMAR_FIELDS)}"
            )
        spec = self.grammar_spec
        if spec is not None:
            check_grammar(spec)

    @property
    def grammar_spec(self) -> Optional[GrammarSpec]:
        for name in GRAMMAR_FIELDS:
            source = getattr(self, name)
            if source is not None:
                return GrammarSpec(name, source)
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Finish:
    """SGLang's shape: {"type": "stop", "matched": id or str} / {"type": "length", "length": n} / abort.

    `error_status`: set on an abort that is the request's own error (its sampling parameters made its row of the batch
    unusable, sampling_faults.py): the server answers it as an error with this HTTP status, not as a finish."""

    reason: FinishReason
    matched: Optional[int | str] = None
    message: Optional[str] = None
    length: Optional[int] = None
    error_status: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.reason.value}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.length is not None:
            out["length"] = self.length
        if self.message is not None:
            out["message"] = self.message
        return out


class Req:
    """One generation request. `all_ids` = prompt + output; `kv_len` tokens of it have target KV."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, rid: Optional[str] = None) -> None:
        self.rid = rid if rid is not None else f"req-{next(_request_counter)}"
        self.prompt_len = len(prompt_ids)
        self.all_ids: list[int] = list(prompt_ids)
        self.params = params
        self.kv_len = 0
        self.pool_row: Optional[int] = None  # row in the req→token table while admitted
        self.allocated_len = 0  # positions with a KV slot assigned
        # NOTE: admitted and its (re-)prefill has not produced a token yet: its pending tokens, the last one included,
        # are extended (so the first token always comes from the prefill, as in DFlash's reference), never decoded.
        self.in_prefill = False
        self.pages: list[int] = []
        # NOTE: radix prefix cache: pages[:shared_len // page_size] belong to the tree (read-only, never written),
        # locked (kv/prefix_cache.py holds the tree node) while the request holds them.
        self.shared_len = 0
        self.cached_tokens = 0  # tokens whose KV came from the cache, not this request's forwards (SGLang's meaning)
        self.computed_len = 0  # tokens that had KV before the last retraction: not counted as cached again
        self.finish: Optional[Finish] = None
        self.text = ""  # detokenised output, stop strings removed
        self.detokenized = False  # NOTE: True when the scheduler makes `text` (else it stays "")
        self.generator: Optional[torch.Generator] = None
        # NOTE: set by the scheduler for a constrained request (sample/grammar.py)
        self.grammar: Optional[GrammarMatcher] = None
        self.arrival_time = time.monotonic()
        # NOTE: the phases of its time to first token: arrival -> received by the scheduler (add_request) -> scheduled
        # (admitted to its first prefill step) -> first token.
        self.received_time: Optional[float] = None
        self.scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.spec_verify_ct = 0
        self.spec_accept_lengths: list[int] = []
        # NOTE: logprobs (None: not asked for). Workers append one entry per token they return; the scheduler cuts
        # the lists back to the output when a finish condition stops the commit mid-block.
        self.top_logprobs_num: Optional[int] = None
        # NOTE: samples_on_host as Scheduler.add_request fixed it (params, logprobs and grammar are set by then); the
        # workers ask every step for every request
        self.admitted_samples_on_host: Optional[bool] = None
        self.min_tokens_blocked_ids: set[int] = set()  # EOS + stop_token_ids, set by the scheduler (min_new_tokens)
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_ids) - self.prompt_len

    @property
    def pending_len(self) -> int:
        """Tokens whose KV is not computed yet (while decoding: the last committed token)."""
        return len(self.all_ids) - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs_num is not None

    @property
    def samples_on_host(self) -> bool:
        """Whether its tokens need more than the device's greedy argmax (no run-ahead, no fused greedy cycle)."""
        if self.admitted_samples_on_host is not None:
            return self.admitted_samples_on_host
        return not self.params.is_greedy or self.wants_logprobs or self.params.has_penalties or self.grammar is not None

    def meta_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": self.num_output_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish.to_dict() if self.finish else None,
        }
        if self.wants_logprobs:  # NOTE: SGLang's layout: (logprob, token id, text) with text left out
            info["output_token_logprobs"] = [
                (logprob, token, None) for logprob, token in zip(self.output_token_logprobs, self.output_ids)
            ]
            info["output_top_logprobs"] = [
                [(logprob, token, None) for token, logprob in top] for top in self.output_top_logprobs
            ]
        if self.spec_verify_ct:
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = self.num_output_tokens / self.spec_verify_ct  # as SGLang reports it
        return info


@dataclass(frozen=True)
class RequestLimits:
    """What decides whether a request can ever be served; constant for the life of an engine."""

    vocab_size: int
    context_length: int
    total_slots: int
    slots_per_decode: int
    has_tokenizer: bool

    def check(self, req: Req) -> None:
        """Raises ValueError for a request that can never be served."""
        if req.prompt_len == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in req.all_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if req.prompt_len >= self.context_length:
            raise ValueError(f"the prompt has {req.prompt_len} tokens; the context length is {self.context_length}")
        if req.prompt_len + self.slots_per_decode > self.total_slots:
            raise ValueError(f"the prompt has {req.prompt_len} tokens and can never fit the KV pool "
                             f"({self.total_slots} slots); raise max_total_tokens")
        too_large = [t for t in req.params.logit_bias if int(t) >= self.vocab_size]
        if too_large:
            raise ValueError(f"logit_bias token id {too_large[0]} is outside the vocabulary [0, {self.vocab_size})")
        spec = req.params.grammar_spec
        if spec is not None and not self.has_tokenizer:
            raise ValueError(f"{spec.kind} needs a tokenizer (the engine runs with skip_tokenizer_init)")
        if req.params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")


def build_requests(
    batch: list[list[int]],
    sampling_params: Union[None, dict[str, Any], list[dict[str, Any]]],
    rids: Optional[list[str]],
    limits: RequestLimits,
) -> list[Req]:
    """Validates everything first (raising ValueError), so a bad request leaves nothing queued."""
    params = [SamplingParams.from_dict(p) for p in per_prompt(sampling_params, len(batch), "sampling_params")]
    if rids is not None and len(rids) != len(batch):
        raise ValueError(f"got {len(rids)} rids for {len(batch)} prompts")
    if rids is not None and len(set(rids)) != len(rids):
        raise ValueError("rid values must be unique within one generate call")
    reqs = [Req(ids, p, rids[i] if rids else None) for i, (ids, p) in enumerate(zip(batch, params))]
    for req in reqs:
        limits.check(req)
    return reqs


# NOTE: OpenAI's chat bound (completions: 5) and vLLM's default max_logprobs. Unbounded, one /generate request asked
# for the whole vocabulary per token: a 51 MB answer for 32 tokens, built on the engine thread every other request
# waits on.
MAX_TOP_LOGPROBS_NUM = 20


def logprob_request(return_logprob: Any, top_logprobs_num: Any) -> Optional[int]:
    """Req.top_logprobs_num from the request fields (None: no logprobs)."""
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be true or false, got {return_logprob!r}")
    if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top_logprobs_num!r}")
    if top_logprobs_num > MAX_TOP_LOGPROBS_NUM:
        raise ValueError(f"top_logprobs_num must be at most {MAX_TOP_LOGPROBS_NUM}, got {top_logprobs_num}")
    if top_logprobs_num and not return_logprob:
        raise ValueError("top_logprobs_num needs return_logprob")
    return top_logprobs_num if return_logprob else None


def per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """One value for every prompt, or a list (or tuple) of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"got {len(value)} {name} for {count} prompts")
        return list(value)
    return [value] * count
