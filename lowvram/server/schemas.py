"""OpenAI request and response bodies. Requests are validated strictly (no coercion, no NaN, unknown parameters
refused), so a typo is a 400 naming the field; OpenAI parameters lowvram cannot honour are accepted only at their
"off" value. vLLM's top_k, min_p, repetition_penalty, ignore_eos and truncate_prompt_tokens are accepted, so one
body runs on both."""

from __future__ import annotations

import itertools
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
MAX_CHOICES = 16  # n: each choice is a sequence in the batch
MIN_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity), as vLLM does


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
    "logit_bias": ((None, {}), "logit_bias is not supported"),
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
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
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
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep only the prompt's last N tokens
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
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise UnsupportedParameter("'max_tokens' = 0 is only allowed with echo (to score the prompt)", "max_tokens")
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
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: Text | None = None
    noop_params = frozenset(_NOOP_VALUES) - _CHAT_ONLY

    def sampling_kwargs(self) -> dict:
        if self.best_of is not None and self.best_of != (self.n or 1):
            message = f"'best_of' = {self.best_of} is not supported by this server: only best_of equal to n"
            raise UnsupportedParameter(message, "best_of")
        prompt_logprobs = self.logprobs if self.echo else None
        return {**super().sampling_kwargs(), "logprobs": self.logprobs, "prompt_logprobs": prompt_logprobs}


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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    noop_params = frozenset(_NOOP_VALUES)

    def requested_max_tokens(self) -> int | None:
        given = {self.max_tokens, self.max_completion_tokens} - {None}
        if len(given) > 1:
            raise RequestError("give max_tokens or max_completion_tokens, not both with different values")
        if 0 in given:
            raise RequestError("'max_tokens' must be at least 1")
        return given.pop() if given else None

    def sampling_kwargs(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("'top_logprobs' needs 'logprobs' = true", "top_logprobs")
        return {**super().sampling_kwargs(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}


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


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}


class CompletionShape:
    """The response objects of one /v1/completions request, streamed or whole, for its n choices.
    Streamed chunks carry `"usage": null` until the last, which the stream drops unless asked for.
    token_text: a token id's text; echo_text: the prompt's text, put before each choice's (echo);
    hides_output: the one token generated is not shown (max_tokens = 0 with echo scores the prompt)."""

    request_type = CompletionRequest
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, *, token_text=str, echo_text=None, hides_output=False):
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.token_text, self.echo_text, self.hides_output = token_text, echo_text, hides_output
        self._num_sent: dict[int, int] = {}  # choice -> output tokens whose log-probabilities were sent
        self._text_offsets: dict[int, int] = {}  # choice -> characters of the tokens sent so far
        self._prompt_logprobs = None  # the first choice's: the others skip scoring the same prompt

    def _body(self, object: str, choices: list[dict], usage: dict | None = None) -> dict:
        return {
            "id": self.request_id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def _choice(self, key: str, value, finish_reason: str | None = None, index: int = 0, logprobs=None) -> dict:
        return {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, value, finish_reason: str | None = None, index: int = 0, logprobs=None) -> dict:
        return self._body(self.chunk_object, [self._choice("text", value, finish_reason, index, logprobs)])

    def first(self, index: int = 0) -> dict | None:
        """What a choice's stream starts with before any token, if anything."""
        return None

    def _new(self, index: int, out, text: str) -> tuple[str, dict | None]:
        """Choice `index`'s text and log-probabilities that `out` adds (with echo, the prompt's first)."""
        completion, is_first = out.outputs[0], index not in self._num_sent
        start, ids, entries = self._num_sent.get(index, 0), [], []
        if is_first:
            text = (self.echo_text or "") + ("" if self.hides_output else text)
            self._prompt_logprobs = self._prompt_logprobs or out.prompt_logprobs
            if self._prompt_logprobs is not None:
                ids, entries = list(out.prompt_token_ids), list(self._prompt_logprobs)
        elif self.hides_output:
            text = ""
        end = 0 if self.hides_output else len(completion.token_ids)
        self._num_sent[index] = end
        if completion.logprobs is None:
            return text, None
        ids, entries = ids + completion.token_ids[start:end], entries + completion.logprobs[start:end]
        return text, (self.logprobs(index, ids, entries) if ids or is_first else None)

    def logprobs(self, index: int, token_ids: list[int], entries: list) -> dict:
        """OpenAI's legacy shape; text_offset counts the characters of the choice's tokens before each."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self._text_offsets.get(index, 0)))
        self._text_offsets[index] = offsets.pop()
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else max(e[0], MIN_LOGPROB) for e in entries],
            "top_logprobs": [
                None if e is None else {self.token_text(i): max(v, MIN_LOGPROB) for i, v in e[1]} for e in entries
            ],
            "text_offset": offsets,
        }

    def deltas(self, index: int, out) -> list[dict]:
        """The chunks for what `out` adds to choice `index` (none when it adds nothing to show)."""
        text, logprobs = self._new(index, out, out.text_delta)
        return [self._chunk(text, None, index, logprobs)] if text or logprobs else []

    def finish(self, finish_reason: str, index: int = 0) -> dict:
        return self._chunk("", finish_reason, index)

    def usage_chunk(self, usage: dict) -> dict:
        return self._body(self.chunk_object, [], usage)

    def whole(self, outs: list, usage: dict) -> dict:
        """The response for the choices' finished outputs, in index order."""
        choices = []
        for index, out in enumerate(outs):
            text, logprobs = self._new(index, out, out.outputs[0].text)
            choices.append(self._message(text, out, index, logprobs))
        return self._body(self.object, choices, usage)

    def _message(self, text: str, out, index: int, logprobs) -> dict:
        return self._choice("text", text, out.outputs[0].finish_reason, index, logprobs)

    def track(self, index: int, out) -> None:
        """See each output of a response that is sent whole, as it arrives."""


class ChatShape(CompletionShape):
    """The same for /v1/chat/completions: 'chat.completion' and its chunks, whose deltas carry only
    what changed (the last one is {})."""

    request_type = ChatCompletionRequest
    id_prefix = "chatcmpl-"
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def _chunk(self, delta: dict, finish_reason: str | None = None, index: int = 0, logprobs=None) -> dict:
        return self._body(self.chunk_object, [self._choice("delta", delta, finish_reason, index, logprobs)])

    def first(self, index: int = 0) -> dict:
        return self._chunk({"role": "assistant", "content": ""}, None, index)

    def __init__(self, *args, new_parser=None, **kwargs):
        """new_parser: makes a choice's ReasoningParser when the model's <think> part is returned apart."""
        super().__init__(*args, **kwargs)
        self.new_parser, self._parsers = new_parser, {}
        self._parts: dict[int, tuple[str, str]] = {}  # choice -> (reasoning, answer) of a whole response

    def track(self, index: int, out) -> None:
        # Parsed as it arrives, so the reasoning's token count stops at the token that closed it
        if self.new_parser is not None:
            reasoning, answer = self._split(index, out.text_delta, out)
            old_reasoning, old_answer = self._parts.get(index, ("", ""))
            self._parts[index] = (old_reasoning + reasoning, old_answer + answer)

    def _split(self, index: int, text: str, out) -> tuple[str | None, str]:
        """(reasoning, answer) of a choice's new text; reasoning None when it is not parsed."""
        if self.new_parser is None:
            return None, text
        parser = self._parsers.setdefault(index, self.new_parser())
        reasoning, answer = parser.feed(text, len(out.outputs[0].token_ids))
        if out.finished:
            last_reasoning, last_answer = parser.finish()
            reasoning, answer = reasoning + last_reasoning, answer + last_answer
        return reasoning, answer

    def deltas(self, index: int, out) -> list[dict]:
        """The reasoning's chunks come before the answer's, as DeepSeek's API and vLLM send them."""
        text, logprobs = self._new(index, out, out.text_delta)
        reasoning, answer = self._split(index, text, out)
        chunks = [self._chunk({"reasoning_content": reasoning}, None, index, logprobs)] if reasoning else []
        if answer or (logprobs and not chunks):
            chunks.append(self._chunk({"content": answer}, None, index, None if chunks else logprobs))
        return chunks

    def finish(self, finish_reason: str, index: int = 0) -> dict:
        return self._chunk({}, finish_reason, index)

    def _body(self, object: str, choices: list[dict], usage: dict | None = None) -> dict:
        if usage is not None and self._parsers:  # OpenAI's place for it; these are among completion_tokens
            num_reasoning = sum(parser.num_reasoning_tokens for parser in self._parsers.values())
            usage = {**usage, "completion_tokens_details": {"reasoning_tokens": num_reasoning}}
        return super()._body(object, choices, usage)

    def logprobs(self, index: int, token_ids: list[int], entries: list) -> dict:
        content = []
        for token, (logprob, top) in zip(token_ids, entries):
            alternatives = [_token(self.token_text(i), value) for i, value in top]
            content.append({**_token(self.token_text(token), logprob), "top_logprobs": alternatives})
        return {"content": content}

    def _message(self, text: str, out, index: int, logprobs) -> dict:
        message = {"role": "assistant", "content": text}
        if self.new_parser is not None:
            reasoning, message["content"] = self._parts[index]
            message["reasoning_content"] = reasoning if self._parsers[index].has_reasoning else None
        return self._choice("message", message, out.outputs[0].finish_reason, index, logprobs)
