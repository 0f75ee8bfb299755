"""What generation returns (shaped like vLLM's outputs), and how a sampled token becomes one."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from lowvram.core.sequence import Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "abort"
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # with params.logprobs, per token


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step: `text_delta` is what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    text_delta: str = ""
    metrics: RequestMetrics | None = field(default=None, repr=False)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None  # params.prompt_logprobs


def append_token(seq: Sequence, token: int, eos_token_ids: Collection[int], max_model_len: int, now: float) -> None:
    """Add a sampled token and its text; finish "stop" on EOS (unless ignore_eos), a stop token or
    stop string (cut), or the end of its grammar, "length" at max_tokens or the context limit."""
    seq.first_token_time = seq.first_token_time or now
    params, stops = seq.params, seq.params.stop
    seq.output_token_ids.append(token)
    # The mask allowed only tokens the grammar takes; a refusal (its error state) ends the request too.
    is_grammar_done = seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_stopped())
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        seq.finish_reason = "stop"
    else:
        seq.text += seq.detokenizer.add(token)
        # The first stop string, looked for only where a new one can be.
        start = max(0, seq.num_emitted_chars - max(map(len, stops))) if stops else 0
        hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
            seq.finish_reason = "stop"
        elif is_grammar_done:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
            seq.finish_reason = "length"
    if seq.finish_reason is not None:
        seq.finish_time = now


def request_output(seq: Sequence) -> RequestOutput:
    """The request's state; `text_delta` is the new text, less a tail that may yet become a stop string."""
    stops = seq.params.stop
    hold = max(len(s) for s in stops) - 1 if stops and not seq.is_finished else 0
    visible = len(seq.text) - hold
    delta = seq.text[seq.num_emitted_chars : max(visible, seq.num_emitted_chars)]
    seq.num_emitted_chars += len(delta)
    token_ids = list(seq.output_token_ids)
    logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
    completion = CompletionOutput(0, seq.text, token_ids, seq.finish_reason, logprobs)
    num_prompt = len(seq.prompt_token_ids)
    metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, num_prompt, len(token_ids))
    prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
    return RequestOutput(
        seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished, delta, metrics, prompt_logprobs
    )
