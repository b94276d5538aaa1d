"""The structured-output cases the grammar tests sweep (regexes, JSON schemas and an EBNF grammar), a plain check of
whether a text matches one, and the prompts they run on (as text and as token ids)."""
from __future__ import annotations

import json
import re

from transformers import PreTrainedTokenizerBase

ENUM_SCHEMA = json.dumps({
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"], "additionalProperties": False,
})
CASES: dict[str, tuple[str, str]] = {
    "yes/no regex": ("regex", "(yes|no)"),
    "pattern regex": ("regex", "[a-z]{2,5} [0-9]{1,3}!"),
    "enum schema": ("json_schema", ENUM_SCHEMA),
    "ebnf": ("ebnf", 'root ::= "The answer is " ("yes" | "no" | "maybe") "."'),
    "any object": ("json_schema", '{"type": "object"}'),
}
PROMPTS = ["Answer yes or no: is the sky blue?", "Janet has 3 apples.", "Give me JSON"]


def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """PROMPTS as token ids of `tokenizer`."""
    return [list(tokenizer.encode(text)) for text in PROMPTS]


def matches(kind: str, source: str, text: str) -> bool:
    """Whether `text` matches the case (`kind`, `source`) of CASES: plain regex and JSON checks, not xgrammar."""
    if kind == "regex":
        return re.fullmatch(source, text) is not None
    if kind == "ebnf":
        return re.fullmatch(r"The answer is (yes|no|maybe)\.", text) is not None
    value = json.loads(text)
    if source == ENUM_SCHEMA:
        return set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    return isinstance(value, dict)
