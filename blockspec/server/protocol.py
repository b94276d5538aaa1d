"""Request schemas: OpenAI chat/completions and SGLang's /generate. Unknown fields are ignored, types are strict."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from blockspec.server.structured import response_format_schema


def _valid_unicode(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no tokenizer or UTF-8 response can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"invalid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
        ) from exc
    return text


def _strings_valid(value: Any) -> Any:
    if isinstance(value, str):
        _valid_unicode(value)
    elif isinstance(value, dict):
        for item in value.values():
            _strings_valid(item)
    elif isinstance(value, list):
        for item in value:
            _strings_valid(item)
    return value


Text = Annotated[str, Field(strict=True), AfterValidator(_valid_unicode)]

Temperature = Annotated[float, Field(strict=True, ge=0.0)]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0)]
MinP = Annotated[float, Field(strict=True, ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
Stop = Union[Text, list[Text], None]


MAX_CHOICES = 128  # OpenAI's limit on n


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class _SamplingFields(_Lenient):
    """OpenAI sampling fields shared by chat and completions (plus SGLang's extensions)."""

    model: Optional[Text] = None
    max_tokens: Optional[PositiveInt] = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: StrictInt = -1
    min_p: MinP = 0.0
    n: StrictInt = 1
    stop: Stop = None
    stop_token_ids: Optional[list[TokenId]] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    presence_penalty: Annotated[float, Field(strict=True)] = 0.0
    frequency_penalty: Annotated[float, Field(strict=True)] = 0.0
    repetition_penalty: Annotated[float, Field(strict=True)] = 1.0  # SGLang / vLLM extension
    min_tokens: Annotated[int, Field(strict=True)] = 0  # SGLang / vLLM extension (SGLang's min_new_tokens)
    logit_bias: Optional[dict[str, Any]] = None  # NOTE: values checked by SamplingParams (a clear 400)
    user: Optional[Text] = None
    response_format: Optional[dict[str, Any]] = None

    regex: Optional[Text] = None  # SGLang / vLLM extensions: a grammar instead of response_format
    ebnf: Optional[Text] = None

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        response_format_schema(value)
        return value

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
        return n

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, k: int) -> int:
        if k != -1 and k < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return k

    def sampling_params(self, max_new_tokens: int, choice: int = 0) -> dict[str, Any]:
        """Choice `choice` of n: a given seed becomes seed + choice, so the n samples differ but are reproducible."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": None if self.seed is None else self.seed + choice,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "logit_bias": dict(self.logit_bias or {}),
        }
        grammar = {"json_schema": response_format_schema(self.response_format), "regex": self.regex, "ebnf": self.ebnf}
        params.update({name: source for name, source in grammar.items() if source is not None})
        return params

    @property
    def top_logprobs_num(self) -> Optional[int]:
        """Req.top_logprobs_num (None: no logprobs); each route's request model says how its fields map."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Lenient):
    type: Literal["text"]
    text: Text


class FunctionCall(_Lenient):
    name: Text
    arguments: Text  # JSON text (OpenAI's shape)


class ToolCallIn(_Lenient):
    id: Optional[Text] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_input(self) -> dict[str, Any]:
        """Templates (Qwen3, Llama-3.x) render `function.arguments` with tojson: a dict, not its text."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function, **function}


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[Text, list[TextPart], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant's earlier calls
    tool_call_id: Optional[Text] = None  # a tool message: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Lenient):
    name: Annotated[str, Field(strict=True, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema
    strict: Optional[StrictBool] = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: Text


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=20)]] = None

    @property
    def top_logprobs_num(self) -> Optional[int]:
        """Req.top_logprobs_num (None: no logprobs); top_logprobs without logprobs is refused by the route."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = Union[
    Text,
    Annotated[list[Text], Field(min_length=1)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    echo: StrictBool = False
    logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=5)]] = None  # OpenAI's legacy: top-n, 0 = chosen only

    @property
    def top_logprobs_num(self) -> Optional[int]:
        return self.logprobs
    suffix: Optional[Text] = None
    best_of: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None

    @field_validator("tools", "tool_choice")
    @classmethod
    def _chat_only(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("tools and tool_choice are for /v1/chat/completions")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Optional[str]) -> Optional[str]:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: Optional[int]) -> Optional[int]:
        if best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return best_of


class GenerateRequest(_Lenient):
    """SGLang's native /generate: exactly one of `text` / `input_ids`; lists make a batch."""

    text: Union[Text, Annotated[list[Text], Field(min_length=1)], None] = None
    input_ids: Union[
        Annotated[list[StrictInt], Field(min_length=1)], Annotated[list[list[StrictInt]], Field(min_length=1)], None
    ] = None
    sampling_params: Annotated[Union[dict[str, Any], list[dict[str, Any]], None], AfterValidator(_strings_valid)] = None
    rid: Union[Text, list[Text], None] = None
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = 0


class AbortRequest(_Lenient):
    rid: Text
