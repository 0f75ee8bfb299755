"""OpenAI request and response bodies. Requests are validated strictly (no coercion, no NaN, unknown parameters
refused), so a typo is a 400 naming the field; OpenAI parameters lowvram cannot honour are accepted only at their
"off" value. vLLM's top_k, min_p, repetition_penalty and ignore_eos are accepted, so one body runs on both."""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from lowvram.errors import RequestError


def _require_utf8(text: str) -> str:
    # JSON may carry "\ud800" escapes; such a string cannot be tokenized or sent back.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains an unpaired UTF-16 surrogate (a broken \\u escape)") from None
    return text


Text = Annotated[str, AfterValidator(_require_utf8)]

MAX_SEED = 2**63 - 1  # OpenAI's seed is a signed 64-bit integer
MIN_SAMPLING_TEMPERATURE = 1e-2  # vLLM's floor too: below it logits / temperature overflows (0 is greedy)


class UnsupportedParameter(RequestError):
    """A request asked for an OpenAI feature this server does not implement."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


# name -> (values that mean "off", what to say when another value is given)
_NOOP_VALUES: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "only one choice per request (n = 1); send several requests instead"),
    "best_of": ((None, 1), "only best_of = 1"),
    "logprobs": ((None, False, 0), "log-probabilities are not returned"),
    "top_logprobs": ((None, 0), "log-probabilities are not returned"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "echo": ((None, False), "echo is not supported"),
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none", "auto"), "tool calling is not supported"),
    "parallel_tool_calls": ((None, True, False), "it must be true or false, and means nothing without tools"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none", "auto"), "function calling is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the 'text' modality"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None, {}), "metadata is only used with stored completions, which are not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
}
_CHAT_ONLY = frozenset(
    {"functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options"}
)


class JsonSchemaFormat(_Strict):
    name: Text
    description: Text | None = None
    json_schema: dict | None = Field(None, alias="schema")  # none: any JSON value
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def output_schema(self) -> dict | None:
        """The JSON schema the output must satisfy; None for plain text."""
        if self.type == "json_schema" and self.json_schema is None:
            raise UnsupportedParameter(
                "'response_format.json_schema' is required when its type is 'json_schema'",
                "response_format.json_schema",
            )
        if self.type == "json_object":
            return {"type": "object"}
        return None if self.type == "text" else (self.json_schema.json_schema or {})


_SAMPLING_FIELDS = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k")
_SAMPLING_FIELDS += ("min_p", "repetition_penalty", "ignore_eos")


class _GenerationRequest(_Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=1e-3, le=100.0)
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI parameters accepted only when they ask for nothing (see _NOOP_VALUES)
    noop_params: ClassVar[frozenset[str]] = frozenset()

    @field_validator("temperature")
    @classmethod
    def _temperature_is_zero_or_usable(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_SAMPLING_TEMPERATURE:
            use = f"use 0 for greedy decoding or at least {MIN_SAMPLING_TEMPERATURE}"
            raise ValueError(f"= {value!r} is too small to sample with; {use}")
        return value

    @classmethod
    def without_noop_params(cls, data: dict) -> dict:
        """`data` less the parameters that ask for nothing; UnsupportedParameter for the first
        that asks for something this server does not do."""
        for name in (name for name in _NOOP_VALUES if name in cls.noop_params):
            value = data.get(name)
            allowed, reason = _NOOP_VALUES[name]
            # `True == 1` in Python; a JSON true for n must not pass as 1.
            if not any(value == ok and type(value) is type(ok) for ok in allowed):
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
                raise UnsupportedParameter(f"'{name}' = {shown} is not supported by this server: {reason}", name)
        return {key: value for key, value in data.items() if key not in cls.noop_params}

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_kwargs(self) -> dict:
        """SamplingParams arguments; what was left out keeps SamplingParams' defaults, which are OpenAI's."""
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        schema = self.response_format.output_schema() if self.response_format is not None else None
        return kwargs if schema is None else {**kwargs, "json_schema": schema}


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt`: a string, a list of one string, or token ids. `suffix`: the text
    after the gap, for fill-in-the-middle (the prompt is the text before it)."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    suffix: Text | None = None
    noop_params = frozenset(_NOOP_VALUES) - _CHAT_ONLY


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def for_template(self) -> dict:
        """The message as the chat template takes it: text content, and 'developer' (OpenAI's new name) as 'system'."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name for max_tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    noop_params = frozenset(_NOOP_VALUES) - {"echo"}

    def requested_max_tokens(self) -> int | None:
        given = {self.max_tokens, self.max_completion_tokens} - {None}
        if len(given) > 1:
            raise RequestError("give max_tokens or max_completion_tokens, not both with different values")
        return given.pop() if given else None


# Fields whose type is a union: pydantic reports one error per member, which reads badly.
_UNION_FIELDS = {
    "stop": "a string or a list of strings",
    "prompt": "a string, a list of one string, or a list of token ids (integers)",
    "content": "a string or a list of {'type': 'text', 'text': str} parts",
}


def describe_validation_error(error: ValidationError) -> tuple[str, str | None]:
    """One readable sentence for the first problem, and the parameter it concerns."""
    errors = error.errors(include_url=False)
    # our own validators' errors are the most specific ones, even inside a union
    first = next((e for e in errors if e["type"] == "value_error"), errors[0])
    loc = list(first["loc"])
    path, cut_at_union = "", None
    for item in loc:
        path += f"[{item}]" if isinstance(item, int) else f".{item}" if path else str(item)
        if item in _UNION_FIELDS:
            cut_at_union = item
            break
    kind = first["type"]
    if kind == "missing":
        return f"'{path}' is required", path
    if kind == "extra_forbidden":
        return f"unknown parameter '{path}'", path
    if kind == "value_error":
        return f"'{path}' {first['msg'].removeprefix('Value error, ')}", path
    if cut_at_union is not None and len(loc) > loc.index(cut_at_union) + 1:
        return f"'{path}' must be {_UNION_FIELDS[cut_at_union]}", path
    return (f"'{path}': {first['msg']}", path) if path else (first["msg"], None)


# -- responses: plain dicts in OpenAI's field order ---------------------------------


class CompletionShape:
    """The response objects of one /v1/completions request, streamed or whole. Streamed chunks
    carry `"usage": null` until the last, which the stream drops unless asked for."""

    request_type = CompletionRequest
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str):
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def _body(self, object: str, choices: list[dict], usage: dict | None = None) -> dict:
        return {
            "id": self.request_id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def _choice(self, key: str, value, finish_reason: str | None = None) -> dict:
        return {"index": 0, key: value, "logprobs": None, "finish_reason": finish_reason}

    def _chunk(self, value, finish_reason: str | None = None) -> dict:
        return self._body(self.chunk_object, [self._choice("text", value, finish_reason)])

    def first(self) -> dict | None:
        """What a stream starts with before any token, if anything."""
        return None

    def delta(self, text: str) -> dict:
        return self._chunk(text)

    def finish(self, finish_reason: str) -> dict:
        return self._chunk("", finish_reason)

    def usage_chunk(self, usage: dict) -> dict:
        return self._body(self.chunk_object, [], usage)

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        return self._body(self.object, [self._choice("text", text, finish_reason)], usage)


class ChatShape(CompletionShape):
    """The same for /v1/chat/completions: 'chat.completion' and its chunks, whose deltas carry only
    what changed (the last one is {})."""

    request_type = ChatCompletionRequest
    id_prefix = "chatcmpl-"
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return self._body(self.chunk_object, [self._choice("delta", delta, finish_reason)])

    def first(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, text: str) -> dict:
        return self._chunk({"content": text})

    def finish(self, finish_reason: str) -> dict:
        return self._chunk({}, finish_reason)

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        message = {"role": "assistant", "content": text}
        return self._body(self.object, [self._choice("message", message, finish_reason)], usage)
