"""Structured output (OpenAI's response_format) through llguidance.

A constrained request carries an llguidance matcher. Each step the sampler asks it for the bitmask of
allowed tokens (computed on the CPU, tens of microseconds for JSON) and sets that request's logits row
to -inf elsewhere before temperature, top-k and top-p; the engine then advances the matcher with the
sampled token, and the request stops ("stop") when the grammar is complete. Rows without a matcher
are not touched. llguidance: fast CPU token masks, JSON schema support, HF tokenizers, and it is what
vLLM and llama.cpp use for the same job."""

from __future__ import annotations

import json
import threading

from lowvram.errors import RequestError

# Compact JSON with a space after ',' and ':': free whitespace lets a small model loop on blanks
# forever. A schema may override it with "x-guidance": {"whitespace_flexible": true}.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


class Grammars:
    """Builds matchers for one tokenizer. The llguidance tokenizer is made on first use (~1 s)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._hf, self._vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf, self._vocab_size, self._eos or None)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise RequestError(f"structured output needs a fast tokenizer (tokenizer.json): {exc}") from None
            return self._ll_tokenizer

    def _grammar(self, json_schema: dict) -> str:
        from llguidance import LLMatcher

        try:
            return LLMatcher.grammar_from_json_schema(json.dumps(json_schema), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise RequestError(f"the JSON schema is invalid: {exc}") from None

    def check(self, json_schema: dict) -> None:
        """RequestError naming the problem if llguidance cannot compile `json_schema`."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self._grammar(json_schema), self._tokenizer())
        if error:
            raise RequestError(f"the JSON schema is invalid or unsupported: {error}")

    def matcher(self, json_schema: dict):
        """A fresh matcher for one request; RequestError if the schema does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer(), self._grammar(json_schema), log_level=0)
        if matcher.is_error():
            raise RequestError(f"the JSON schema is invalid or unsupported: {matcher.get_error()}")
        return matcher
