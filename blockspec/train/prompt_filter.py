"""Quality filters and deduplication for generated user prompts (magpie.py): length bounds, character and language
sanity, no chat-template tokens, exact duplicates after normalisation and near duplicates by MinHash over word
3-grams (locality-sensitive banding, candidates confirmed by their exact Jaccard similarity)."""
from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Optional

import numpy as np

# A prompt must contain at least one of these: a cheap check that it is English prose, not code or another language.
FUNCTION_WORDS = frozenset(
    "a an the to of and or in on at for with from by about into is are was were be been am do does did can could "
    "would should will shall may might must i me my we our you your it its this that these those what how why "
    "which who whom when where please if not".split()
)
_NON_WORD = re.compile(r"[^0-9a-z]+")
_MERSENNE_31 = (1 << 31) - 1


@dataclass(frozen=True)
class FilterSettings:
    min_words: int = 3
    max_chars: int = 1000
    min_ascii_share: float = 0.97
    min_distinct_word_share: float = 0.3
    near_duplicate_jaccard: float = 0.6

    def validate(self) -> None:
        if self.min_words < 1 or self.max_chars < 1:
            raise ValueError(f"--min-words and --max-chars must be >= 1, got {self.min_words} and {self.max_chars}")
        for name in ("min_ascii_share", "min_distinct_word_share", "near_duplicate_jaccard"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")


def rejection_reason(
    text: str, output_ids: list[int], special_ids: AbstractSet[int], markers: Iterable[str], settings: FilterSettings
) -> Optional[str]:
    """Why a generated user turn is unusable, or None when it passes. `output_ids` exclude the end-of-turn token;
    `markers` are the template's special-token strings (a model may also spell them out in plain text)."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if any(t in special_ids for t in output_ids) or any(m in stripped for m in markers):
        return "template_token"
    if "\ufffd" in stripped or any(not (c.isprintable() or c in "\n\t") for c in stripped):
        return "bad_characters"
    words = stripped.split()
    if len(words) < settings.min_words:
        return "too_short"
    if len(stripped) > settings.max_chars:
        return "too_long"
    if sum(c.isascii() for c in stripped) / len(stripped) < settings.min_ascii_share:
        return "not_english"
    lowered = [w.strip(string.punctuation).lower() for w in words]
    if not any(w in FUNCTION_WORDS for w in lowered):
        return "not_english"
    if len(words) >= 10 and len(set(lowered)) / len(words) < settings.min_distinct_word_share:
        return "repetitive"
    return None


def normalise(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space: the key of exact duplicates."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def shingles(normalised: str, n: int = 3) -> frozenset[str]:
    words = normalised.split()
    if len(words) < n:
        return frozenset([normalised])
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicateIndex:
    """MinHash signatures of `bands * rows` hash functions, bucketed per band: a prompt whose signature shares a
    band with an indexed one is a candidate, and a duplicate when their shingle sets' Jaccard reaches `threshold`.
    NOTE: with 16 bands of 3 rows a pair at Jaccard 0.6 shares a band with probability 0.98, at 0.1 with 0.016."""

    def __init__(self, threshold: float, bands: int = 16, rows: int = 3, seed: int = 0) -> None:
        self.threshold = threshold
        self.bands, self.rows = bands, rows
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _MERSENNE_31, size=bands * rows, dtype=np.int64)
        self.b = rng.integers(0, _MERSENNE_31, size=bands * rows, dtype=np.int64)
        self.buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]
        self.sets: list[frozenset[str]] = []

    def signature(self, items: frozenset[str]) -> np.ndarray:
        hashed = np.array(
            [
                int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little") % _MERSENNE_31
                for s in sorted(items)
            ],
            dtype=np.int64,
        )
        # NOTE: a, b, hash < 2^31, so a * hash + b < 2^62 never overflows int64.
        return ((self.a[:, None] * hashed[None, :] + self.b[:, None]) % _MERSENNE_31).min(axis=1)

    def _band_keys(self, signature: np.ndarray) -> list[bytes]:
        return [signature[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def find(self, items: frozenset[str]) -> Optional[int]:
        """The index of an indexed near duplicate of `items`, or None."""
        seen: set[int] = set()
        for band, key in enumerate(self._band_keys(self.signature(items))):
            for other in self.buckets[band].get(key, ()):
                if other not in seen:
                    seen.add(other)
                    if jaccard(items, self.sets[other]) >= self.threshold:
                        return other
        return None

    def add(self, items: frozenset[str]) -> int:
        index = len(self.sets)
        self.sets.append(items)
        for band, key in enumerate(self._band_keys(self.signature(items))):
            self.buckets[band].setdefault(key, []).append(index)
        return index


class Deduplicator:
    """Keeps the first of every group of duplicates, offered one at a time (generation order)."""

    def __init__(self, near_threshold: float) -> None:
        self.exact: set[str] = set()
        self.index = NearDuplicateIndex(near_threshold)
        self.exact_duplicates = 0
        self.near_duplicates = 0

    def remember(self, text: str) -> None:
        """Indexes a prompt kept elsewhere (an earlier set) without counting it: later offers of it are duplicates."""
        key = normalise(text)
        if key not in self.exact:
            self.exact.add(key)
            self.index.add(shingles(key))

    def offer(self, text: str) -> bool:
        """True when `text` is new (it is then indexed), False for a duplicate of an earlier one."""
        key = normalise(text)
        if key in self.exact:
            self.exact_duplicates += 1
            return False
        self.exact.add(key)
        items = shingles(key)
        if self.index.find(items) is not None:
            self.near_duplicates += 1
            return False
        self.index.add(items)
        return True


def deduplicate(texts: list[str], near_threshold: float) -> list[str]:
    unique = Deduplicator(near_threshold)
    return [t for t in texts if unique.offer(t)]
