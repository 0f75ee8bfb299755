"""The engine as the chat sees it: load it (its own log lines report the stages), stream replies, read gauges."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from lowvram.core.context import ContextFit, fit_messages
from lowvram.core.sampling_params import SamplingParams
from lowvram.demo import DEMO_MODEL_DIR
from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.engine import EngineSnapshot, LLMEngine
from lowvram.engine.outputs import RequestOutput
from lowvram.engine.reasoning import ReasoningParser
from lowvram.engine.tokenizer import Tokenizer
from lowvram.kv.conversation_store import restore_conversation, save_conversation

BUNDLED_MODEL_LABEL = "bundled demo model"


@dataclass(frozen=True)
class EngineSpec:
    """Which model to load and how. engine_kwargs: LLMEngine overrides (device, dtype, ...)."""

    model: str | None = None
    profile: str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    is_quantized_on_load: bool = False  # quantize an FP16/BF16 model to AWQ INT4 first (cached)
    num_calib_samples: int = 128

    @property
    def model_label(self) -> str:
        if self.model is None:
            return BUNDLED_MODEL_LABEL
        return Path(self.model).name or self.model

    def with_profile(self, profile: str) -> EngineSpec:
        return replace(self, profile=profile)


class LogForwarder(logging.Handler):
    """Hands each log line at `level` or above to `callback`; lines from `passes_on_at` up also go on to
    the root logger (what the terminal would have shown anyway)."""

    def __init__(self, level: int, callback: Callable[[str], None], passes_on_at: int | None = None):
        super().__init__(level)
        self.callback, self.passes_on_at = callback, passes_on_at

    def emit(self, record: logging.LogRecord) -> None:
        self.callback(record.getMessage())
        if self.passes_on_at is not None and record.levelno >= self.passes_on_at:
            logging.getLogger().handle(record)


def load_engine(spec: EngineSpec, on_stage: Callable[[str], None] = lambda text: None) -> LLMEngine:
    """Build the LLMEngine, reporting stages through `on_stage`. Raises LowvramError subclasses."""
    on_stage(f"resolving {spec.model_label}, loading its weights and planning the KV pool")
    logger = logging.getLogger("lowvram")
    level, is_propagating = logger.level, logger.propagate
    # INFO lines go to on_stage; the terminal still gets only what its own level shows
    handler = LogForwarder(logging.INFO, on_stage, logger.getEffectiveLevel() if is_propagating else None)
    logger.addHandler(handler)
    logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    logger.propagate = False
    try:
        model = quantized_model_dir(spec, on_stage) if spec.is_quantized_on_load else spec.model
        return LLMEngine(model, spec.profile, **spec.engine_kwargs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = is_propagating


def quantized_model_dir(spec: EngineSpec, on_stage: Callable[[str], None]) -> str:
    """The model's AWQ INT4 copy, made once (see lowvram.quant.cache)."""
    from lowvram.quant.cache import quantized_copy

    device = spec.engine_kwargs.get("device") or "auto"
    options = dict(device=device, num_samples=spec.num_calib_samples, label=spec.model_label, on_stage=on_stage)
    return str(quantized_copy(spec.model, spec.profile, **options))


def reasoning_parser(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> ReasoningParser | None:
    """A parser for a reply's <think> part, for models whose chat template has the tags; else None."""
    if not tokenizer.uses_reasoning_tags:
        return None
    return ReasoningParser(tokenizer.prompt_opens_reasoning(prompt_token_ids))


class ReplyText:
    """One streaming reply split into reasoning and answer, timing the reasoning.
    make_parser(prompt_token_ids): a ReasoningParser, or None for a model that does not reason in tags."""

    def __init__(self, make_parser: Callable[[list[int]], ReasoningParser | None]):
        self.make_parser, self.parser = make_parser, None
        self.started_at = time.monotonic()
        self.reasoning = self.answer = ""
        self.thought_s: float | None = None  # how long the reasoning took, once it has ended
        self._is_first = True

    def add(self, out: RequestOutput) -> tuple[str, str, str | None]:
        """The output's new reasoning and answer text, and `thought()` if the reasoning ended with it."""
        if self._is_first:
            self.parser, self._is_first = self.make_parser(out.prompt_token_ids), False
        if self.parser is None:
            self.answer += out.text_delta
            return "", out.text_delta, None
        reasoning, answer = self.parser.feed(out.text_delta, len(out.outputs[0].token_ids))
        if out.finished:
            last = self.parser.finish()
            reasoning, answer = reasoning + last[0], answer + last[1]
        self.reasoning, self.answer = self.reasoning + reasoning, self.answer + answer
        has_ended = self.parser.has_reasoning and (not self.parser.is_reasoning or out.finished)
        if self.thought_s is None and has_ended:
            self.thought_s = time.monotonic() - self.started_at
            return reasoning, answer, self.thought()
        return reasoning, answer, None

    def thought(self) -> str:
        """'thought for 3.2 s, 120 tokens', or how far it got while still thinking."""
        num_tokens = self.parser.num_reasoning_tokens if self.parser else 0
        tokens = f"{num_tokens} token{'' if num_tokens == 1 else 's'}"
        if self.thought_s is None:
            return f"thinking stopped after {time.monotonic() - self.started_at:.1f} s, {tokens}"
        return f"thought for {self.thought_s:.1f} s, {tokens}"


class ChatBackend:
    """A running engine loop plus the names the side panel shows."""

    def __init__(self, engine: LLMEngine, model_label: str):
        self.llm_engine, self.model_label, self.profile_name = engine, model_label, engine.profile.name
        self.has_chat_template = engine.tokenizer.has_chat_template
        self.is_demo_model = engine.model_dir.resolve() == DEMO_MODEL_DIR  # however it was named
        self.max_model_len = engine.max_model_len
        self.async_engine = AsyncLLMEngine(engine).start()

    def stream(self, messages: list[dict], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Token outputs of one reply; closing or cancelling the iterator aborts it and frees its pages."""
        request_id = self.async_engine.new_request_id("chat")
        return self.async_engine.generate(request_id, params=params, **chat_input(self.has_chat_template, messages))

    def reasoning_parser(self, prompt_token_ids: list[int]) -> ReasoningParser | None:
        return reasoning_parser(self.llm_engine.tokenizer, prompt_token_ids)

    async def save_kv(self, messages: list[dict], path) -> Path:
        """Save the conversation's KV pages next to its transcript (see lowvram.kv.conversation_store)."""
        return await self.async_engine.call(
            lambda engine: save_conversation(engine, engine.tokenizer.apply_chat_template(messages, False), path)
        )

    async def restore_kv(self, path):
        """Load saved KV pages into the prefix cache; a mismatch is reported, not fatal."""
        return await self.async_engine.call(lambda engine: restore_conversation(engine, path))

    async def fit(self, messages: list[dict], max_tokens: int) -> tuple[list[dict], ContextFit]:
        """The messages that fit the context with room for the reply (see `fit_to_context`)."""
        return await self.async_engine.call(lambda engine: fit_to_context(engine, messages, max_tokens))

    def snapshot(self) -> EngineSnapshot:
        # The loop's copy is taken after steps only, so after an abort it still counts the freed pages;
        # with nothing running the engine is not stepping and can be read directly.
        if self.async_engine.num_unfinished == 0:
            with contextlib.suppress(RuntimeError):  # a latency deque appended to mid-read: use the loop's copy
                return self.llm_engine.snapshot()
        return self.async_engine.snapshot()

    def stop(self) -> None:
        """End the engine loop and let go of the model, so its memory can go to the next one."""
        if self.async_engine is not None:
            self.async_engine.stop()
        self.async_engine = self.llm_engine = None


def chat_input(has_chat_template: bool, messages: list[dict]) -> dict:
    """The request's input: the messages for the chat template, or for base models that have none,
    a transcript-style prompt."""
    if has_chat_template:
        return {"messages": messages}
    return {"prompt": "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages) + "\n\nAssistant:"}


def prompt_token_ids(engine: LLMEngine, messages: list[dict]) -> list[int]:
    """The tokens the engine is given for `messages` (see `chat_input`)."""
    given = chat_input(engine.tokenizer.has_chat_template, messages)
    if "messages" in given:
        return engine.tokenizer.apply_chat_template(given["messages"])
    return engine.tokenizer.encode(given["prompt"])


def fit_to_context(engine: LLMEngine, messages: list[dict], max_tokens: int) -> tuple[list[dict], ContextFit]:
    """The messages to send so that the prompt and `max_tokens` fit the engine's context: old turns are dropped
    as lowvram.core.context's policy says. Each message's token count is what it adds to the rendered prompt; a
    template that is not additive (one that drops earlier reasoning, say) is checked on the rendered result."""
    max_model_len, roles = engine.max_model_len, [m["role"] for m in messages]
    num_total = len(prompt_token_ids(engine, messages))
    if num_total + max_tokens <= max_model_len:  # the usual case: one rendering
        return messages, ContextFit(tuple(range(len(messages))), 0, num_total)
    num_tokens = message_token_counts(engine, messages)
    margin = 0
    while True:
        fit = fit_messages(roles, num_tokens, max_model_len=max_model_len - margin, max_tokens=max_tokens)
        kept = [messages[i] for i in fit.kept]
        excess = len(prompt_token_ids(engine, kept)) + max_tokens - max_model_len
        if excess <= 0 or len(kept) == len(messages):
            return kept, fit
        margin += excess


def message_token_counts(engine: LLMEngine, messages: list[dict]) -> list[int]:
    """What each message adds to the rendered prompt, rendered after the message before it (template overhead
    counts in the first). Each rendering is short, so a long history costs one pass over its tokens; a template
    that refuses such a pair is rendered on growing prefixes instead."""
    try:
        lengths = [len(prompt_token_ids(engine, messages[i : i + 1])) for i in range(len(messages))]
        pairs = [len(prompt_token_ids(engine, messages[i - 1 : i + 1])) for i in range(1, len(messages))]
        return lengths[:1] + [pair - alone for pair, alone in zip(pairs, lengths)]
    except Exception:  # jinja's raise_exception (roles must alternate, ...)
        ends = [len(prompt_token_ids(engine, messages[: i + 1])) for i in range(len(messages))]
        return [end - start for start, end in zip([0, *ends], ends)]


def load_backend(spec: EngineSpec, on_stage: Callable[[str], None] = lambda text: None) -> ChatBackend:
    engine = load_engine(spec, on_stage)
    on_stage("starting the engine loop")
    return ChatBackend(engine, spec.model_label)
