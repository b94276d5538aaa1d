"""Training data: prompts from JSON lines → the target's own greedy responses (blockspec Engine), cached on disk.

The cache is a folder of append-only JSON lines files (`responses.rank{R}.jsonl`, one per writer) of prompt ids and
their response, plus `meta.json` with the generation settings; a rerun reuses the response of every prompt it has
seen, whatever its index now (prompts added, dropped or reordered), and generates the rest."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from blockspec.tokenizer import chat_to_ids, load_tokenizer
from blockspec.train.token_progress import TokenPostfix

logger = logging.getLogger(__name__)

PROMPT_KEYS = ("messages", "text", "question", "input_ids")
HELDOUT_SPLIT = "heldout"  # records marked `"split": "heldout"` are evaluation prompts, never training data


@dataclass
class Sample:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def read_prompt_records(path: str | Path, limit: Optional[int] = None) -> list[dict[str, Any]]:
    """Records with one of `messages` (chat), `text`, `question` (a user message) or `input_ids` (pre-tokenised)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file {file} does not exist")
    records: list[dict[str, Any]] = []
    with open(file) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or not any(k in record for k in PROMPT_KEYS):
                raise ValueError(f"{file}:{number}: a record needs one of {', '.join(PROMPT_KEYS)}")
            records.append(record)
    if not records:
        raise ValueError(f"data file {file} holds no prompts")
    return records


def reject_heldout(records: list[dict[str, Any]], path: str | Path) -> None:
    held = sum(r.get("split") == HELDOUT_SPLIT for r in records)
    if held:
        raise ValueError(
            f"{path}: {held} record(s) belong to a held-out split (\"split\": \"{HELDOUT_SPLIT}\"); held-out prompts "
            "are for --eval-prompts and are never trained on"
        )


def mix_counts(main: int, extra: int, ratio: float) -> tuple[int, int]:
    """(records kept from main, from extra) so that `ratio` of the mix comes from extra: the side with more than
    its share is cut."""
    want_extra = max(1, round(main * ratio / (1.0 - ratio)))
    if want_extra <= extra:
        return main, want_extra
    return min(main, max(1, round(extra * (1.0 - ratio) / ratio))), extra


def ratio_taking_all(main: int, extra: int) -> float:
    """The --mix-ratio whose mix_counts keep every record of both files."""
    return (extra + 0.4) / (main + extra + 0.4)  # NOTE: round(main * r / (1 - r)) == extra; 0.4 absorbs float error


def mix_records(main: list[dict[str, Any]], extra: list[dict[str, Any]], ratio: float) -> list[dict[str, Any]]:
    """`main`'s first records followed by `extra`'s (mix_counts): both files keep their order, so the mix is the same
    on every run and a larger ratio only appends prompts."""
    keep_main, keep_extra = mix_counts(len(main), len(extra), ratio)
    return main[:keep_main] + extra[:keep_extra]


def needs_tokenizer(records: list[dict[str, Any]]) -> bool:
    return any("input_ids" not in r for r in records)


def maybe_load_tokenizer(model_path: str, records: list[dict[str, Any]]) -> Any:
    return load_tokenizer(model_path) if needs_tokenizer(records) else None


def encode_prompt(record: dict[str, Any], tokenizer: Any, system_prompt: Optional[str], user_suffix: str) -> list[int]:
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("input_ids must be a non-empty list of integers")
        return list(ids)
    if tokenizer is None:
        raise ValueError("text prompts need the target's tokenizer")
    if "messages" in record:
        return chat_to_ids(tokenizer, record["messages"])
    if "question" in record:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": str(record["question"]) + user_suffix})
        return chat_to_ids(tokenizer, messages)
    return list(tokenizer.encode(str(record["text"])))


def default_mask_token_id(tokenizer: Any, vocab_size: int, used: set[int]) -> int:
    """An id inside the target's vocabulary that the target does not emit.

    Preference: the first embedding row past the tokenizer (never produced by it: z-lab's choice for Qwen3), then
    the highest special token that is not bos/eos/pad/unk and never occurs in the data, then the highest id that
    never occurs in the data."""
    if tokenizer is not None:
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        reserved = set(tokenizer.all_special_ids) | {
            t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
            if t is not None
        }
        specials = sorted((i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special), reverse=True)
        for token_id in specials:
            if token_id < vocab_size and token_id not in reserved and token_id not in used:
                return int(token_id)
    for token_id in range(vocab_size - 1, -1, -1):
        if token_id not in used:
            return token_id
    raise ValueError("every vocabulary id occurs in the data; pass --mask-token-id")


class ResponseCache:
    def __init__(self, root: Path, meta: dict[str, Any], rank: int | str = 0) -> None:
        """`rank` names this writer's file: a torchrun rank, or "R-W" for generation worker W of rank R."""
        self.root = root
        self.meta = meta
        self.file = root / f"responses.rank{rank}.jsonl"

    def drop_partial_tail(self) -> None:
        """Cuts this writer's file back to its last complete line, so appends start on a fresh line."""
        if self.file.is_file():
            data = self.file.read_bytes()
            if data and not data.endswith(b"\n"):
                self.file.write_bytes(data[:data.rfind(b"\n") + 1])

    def check_meta(self) -> None:
        path = self.root / "meta.json"
        if path.is_file():
            with open(path) as f:
                existing = json.load(f)
            if existing != self.meta:
                raise ValueError(
                    f"the response cache {self.root} was made with {existing}, this run asks for {self.meta}; "
                    "pass another --cache-dir or delete it"
                )
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.meta, f, indent=1)
        os.replace(tmp, path)

    def load(self) -> dict[tuple[int, ...], list[int]]:
        """Every cached response, keyed by its prompt's token ids (one greedy answer per prompt: the last line wins)."""
        responses: dict[tuple[int, ...], list[int]] = {}
        for file in sorted(self.root.glob("responses.rank*.jsonl")):
            with open(file) as f:
                lines = f.readlines()
            for number, line in enumerate(lines, 1):
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError:
                    if number == len(lines):  # NOTE: a run killed mid-write leaves at most one partial last line
                        logger.warning("ignoring a partial last line in %s", file)
                        continue
                    raise ValueError(f"{file}:{number}: corrupt cache line; delete the cache") from None
                responses[tuple(raw["prompt_ids"])] = raw["output_ids"]
        return responses

    def append(self, samples: list[Sample]) -> None:
        with open(self.file, "a") as f:
            for s in samples:
                f.write(json.dumps({"index": s.index, "prompt_ids": s.prompt_ids, "output_ids": s.output_ids}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def generate_missing(
    prompts: list[list[int]],
    cache: ResponseCache,
    make_engine: Callable[[], Any],
    max_new_tokens: int,
    ignore_eos: bool,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
) -> int:
    """Generates the prompts missing from the cache whose index ≡ rank (mod world) into this writer's file; returns
    how many. A prompt repeated in `prompts` is generated once (at its first index)."""
    cache.check_meta()
    cache.drop_partial_tail()
    cached = cache.load()
    first_of: dict[tuple[int, ...], int] = {}
    for index, prompt in enumerate(prompts):
        first_of.setdefault(tuple(prompt), index)
    todo = [i for key, i in first_of.items() if key not in cached and i % world == rank]
    del cached, first_of
    if not todo:
        return 0
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}
    engine = make_engine()
    started, tokens = time.perf_counter(), 0
    try:
        bar = tqdm(total=len(todo), desc="generating responses", unit="prompt", disable=not progress)
        done: list[Sample] = []
        # NOTE: generate_iter keeps the running batch full (per-chunk generate calls drained it at each chunk's
        # end); the cache gets every `batch_size` finished responses, and what finished before an error
        try:
            for position, out in engine.generate_iter([prompts[i] for i in todo], params,
                                                      TokenPostfix(bar) if progress else None):
                done.append(Sample(todo[position], prompts[todo[position]], out["output_ids"]))
                tokens += len(out["output_ids"])
                bar.update(1)  # NOTE: each response as it finishes; the cache takes them `batch_size` at a time
                if len(done) >= batch_size:
                    cache.append(done)
                    done = []
        finally:
            cache.append(done)
        bar.close()
        seconds = time.perf_counter() - started
        logger.info(
            "generated %d responses (%d tokens) in %.0f s: %.1f responses/s, %.0f tokens/s over %d engine steps",
            len(todo),
            tokens,
            seconds,
            len(todo) / seconds,
            tokens / seconds,
            engine.scheduler.num_steps,
        )
    finally:
        engine.shutdown()
    return len(todo)


def cached_samples(prompts: list[list[int]], cache: ResponseCache) -> list[Sample]:
    """Every prompt with its cached response, in index order; a prompt without one is an error."""
    everything = cache.load()
    missing = [i for i, prompt in enumerate(prompts) if tuple(prompt) not in everything]
    if missing:
        raise RuntimeError(f"{len(missing)} prompt(s) have no cached response after generation (e.g. {missing[:3]})")
    return [Sample(i, prompt, list(everything[tuple(prompt)])) for i, prompt in enumerate(prompts)]


def generate_responses(
    prompts: list[list[int]],
    cache: ResponseCache,
    make_engine: Callable[[], Any],
    max_new_tokens: int,
    ignore_eos: bool,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    progress: bool = True,
) -> tuple[list[Sample], int]:
    """(samples for every prompt in index order, how many this rank generated now).

    Rank r generates the missing prompts whose index ≡ r (mod world); everyone then reads the whole cache."""
    generated = generate_missing(prompts, cache, make_engine, max_new_tokens, ignore_eos, batch_size, rank, world,
                                 progress)
    barrier()
    return cached_samples(prompts, cache), generated
