"""The model's tokenizer and chat template, and incremental detokenization."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

from lowvram.engine import reasoning
from lowvram.errors import ModelLoadError, RequestError

log = logging.getLogger("lowvram")

# Fill-in-the-middle: the tokens around the prefix and the suffix, as each model family was trained
# (deepseek-coder; StarCoder; Qwen2.5-Coder). The model writes the middle after the third.
FIM_TOKENS = (
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


class Tokenizer:
    """Wraps the checkpoint's Hugging Face tokenizer."""

    def __init__(self, model_dir: Path):
        if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ModelLoadError(
                f"{model_dir} has no tokenizer (tokenizer.json); copy the tokenizer files next to config.json"
            )
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer may rebuild tokenizer.json's exact pipeline for the architecture, changing ids.
        cls = PreTrainedTokenizerFast if (model_dir / "tokenizer.json").is_file() else AutoTokenizer
        try:
            self.hf = cls.from_pretrained(str(model_dir))
        except Exception as exc:  # tokenizer loading raises many types
            raise ModelLoadError(f"could not load the tokenizer in {model_dir}: {exc}") from None
        self.eos_token_ids: set[int] = set() if self.hf.eos_token_id is None else {self.hf.eos_token_id}
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
                self.eos_token_ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            except json.JSONDecodeError:
                log.warning("%s is not valid JSON; using the tokenizer's EOS only", gen)
        # transformers' decode type-checks every id (slow per token); the library's gives the same text.
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._backend = None if getattr(self.hf, "clean_up_tokenization_spaces", True) else backend

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def uses_reasoning_tags(self) -> bool:
        """Whether the chat template is one of a model that reasons in <think> tags (DeepSeek-R1's)."""
        return reasoning.uses_reasoning_tags(str(getattr(self.hf, "chat_template", None) or ""))

    def prompt_opens_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt ends inside an open <think>: R1's newer templates open it for the reply."""
        tail = self.hf.decode(prompt_token_ids[-8:], skip_special_tokens=False)
        return reasoning.prompt_opens_reasoning(tail)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render a conversation (with the generation prompt appended by default) as token ids."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise RequestError("messages must be a list of {'role': str, 'content': str}")
        if not self.has_chat_template:
            raise RequestError("this model has no chat template; send plain prompts (completions) instead")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        # The template writes BOS itself; encoding without special tokens avoids a second one.
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_fill_in_middle(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt: BOS (if the model uses one) + begin + prefix + hole + suffix + end."""
        vocab = self.hf.get_vocab()
        marks = next((ids for ids in FIM_TOKENS if all(t in vocab for t in ids)), None)
        if marks is None:
            raise RequestError(
                "this model has no fill-in-the-middle tokens, so 'suffix' cannot be used; send the prompt alone, "
                "or serve a code model trained for it (deepseek-coder, StarCoder, Qwen2.5-Coder)"
            )
        begin, hole, end = (vocab[t] for t in marks)
        text = partial(self.hf.encode, add_special_tokens=False)
        return self.hf.encode("", add_special_tokens=True) + [begin, *text(prefix), hole, *text(suffix), end]

    def decode(self, ids: list[int]) -> str:
        return (self.hf if self._backend is None else self._backend).decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Text deltas of a growing id list; text ending in U+FFFD is held back until the character is whole."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""
