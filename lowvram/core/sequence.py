"""A request's state as it moves through the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lowvram.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # carried, never used: the core needs no torch
    import torch

    from lowvram.engine.tokenizer import Detokenizer


@dataclass(eq=False)
class Sequence:
    """One request (n = 1). KV is cached for the first `num_computed_tokens` tokens.
    Compared by identity: comparing fields in `seq in running` cost more than scheduling."""

    seq_id: int
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None = None
    device_generator: torch.Generator | None = None  # sampling.device_generator: draws on the GPU
    matcher: object | None = None  # an llguidance matcher when the output is constrained (engine/grammar.py)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # set when it finishes: "stop", "length" or "abort"
    text: str = ""
    num_emitted_chars: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # With params.logprobs: per output token (its log-probability, [(id, log-probability)] likeliest first).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # With params.prompt_logprobs: the same per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=lambda: [None])

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step reads one id)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
