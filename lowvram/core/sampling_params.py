"""Sampling parameters, named as in vLLM: what a request asks of the sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lowvram.errors import RequestError

MIN_TEMPERATURE = 0.01  # dividing logits by less overflows FP32 to inf and sampling breaks
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI's top_logprobs and vLLM's default max_logprobs


@dataclass
class SamplingParams:
    """How to pick tokens; defaults follow vLLM. temperature: 0 = greedy; top_k: keep the k likeliest
    (0 or -1 = all); top_p: the smallest set reaching top_p; min_p: drop tokens below min_p x the
    likeliest; repetition_penalty > 1 discourages seen tokens; presence/frequency_penalty: OpenAI's;
    stop: strings that end generation (cut from the text); stop_token_ids: ids that end it (as EOS
    does unless ignore_eos); seed: same seed and prompt -> same text, whatever is batched with it;
    logprobs: return each sampled token's log-probability and this many likeliest alternatives (None:
    none, computed only when asked); prompt_logprobs: the same for each prompt token (skips the prefix
    cache, whose pages have no logits). Log-probabilities are the model's: log-softmax of the raw
    logits, before penalties, temperature, top-k/p and min-p (vLLM's "raw_logprobs").

    json_schema: the output must be JSON valid against it (ends "stop" when the JSON is complete)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if isinstance(self.temperature, (int, float)) and 0.0 < self.temperature < MIN_TEMPERATURE:
            raise RequestError(
                f"temperature = {self.temperature!r} is too small; use 0 for greedy or at least {MIN_TEMPERATURE}"
            )
        checks = [
            ("temperature", self.temperature, 0.0, 100.0),
            ("top_p", self.top_p, 1e-9, 1.0),
            ("min_p", self.min_p, 0.0, 1.0),
            ("repetition_penalty", self.repetition_penalty, 1e-3, 100.0),
            ("presence_penalty", self.presence_penalty, -2.0, 2.0),
            ("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
        ]
        for name, value, low, high in checks:
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (is_number and math.isfinite(value) and low <= value <= high):
                raise RequestError(f"{name} = {value!r} is invalid; allowed: {low} to {high}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k = {self.top_k!r} is invalid; use -1 or 0 for all tokens, or a positive count")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens = {self.max_tokens!r} is invalid; it must be a positive integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise RequestError(f"{name} = {value!r} is invalid; allowed: None or 0 to {MAX_LOGPROBS}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise RequestError(
                f"json_schema must be a JSON schema object (a dict), not {type(self.json_schema).__name__}"
            )
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise RequestError(f"seed = {self.seed!r} must be an integer")
            if not 0 <= self.seed < 2**63:
                raise RequestError(f"seed = {self.seed!r} is out of range; use 0 to {2**63 - 1}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
