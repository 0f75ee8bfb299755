"""Reasoning in `<think>...</think>`, as DeepSeek-R1 and its distilled models write it, told apart from the
answer. Plain Python over text (no torch), shared by the server (`reasoning_content`) and the chat.

R1's newer chat templates open `<think>\\n` at the start of the assistant turn, so the reply holds only the
closing tag; older ones leave the model to write `<think>` first. Both are handled: text before `</think>` is
reasoning when the prompt ended inside an open `<think>`, or when the reply itself begins with `<think>`.
Text arrives in detokenized deltas and a tag may be split across them, so a tail that may yet become a tag
(or whitespace that may sit before one) is held back until the next delta or `finish` settles it."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def uses_reasoning_tags(chat_template: str | None) -> bool:
    """Whether a chat template belongs to a model that reasons in `<think>` tags."""
    return bool(chat_template) and (THINK_OPEN in chat_template or THINK_CLOSE in chat_template)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>`, so the reply starts with reasoning."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)


class ReasoningParser:
    """Splits one reply, fed delta by delta, into (reasoning, answer) deltas with the tags removed.

    is_open: the prompt ended inside `<think>`. Whitespace next to the tags is dropped, as DeepSeek's API does;
    a reply that does not reason passes through unchanged. `num_reasoning_tokens` counts the reply's tokens up
    to the one that closed the reasoning, from the counts given to `feed`."""

    def __init__(self, is_open: bool = False):
        self.state = "start"  # undecided, then "reasoning" (then "answer"), or "answer" at once
        self.is_open = is_open
        self.has_reasoning = False
        self.num_reasoning_tokens = 0
        self._buffer = ""
        self._is_reasoning_started = self._is_answer_started = False

    @property
    def is_reasoning(self) -> bool:
        return self.state == "reasoning" or (self.state == "start" and self.is_open)

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """The reasoning and the answer that `text`, the reply's next delta, settles.
        num_tokens: how many tokens the reply has so far, this delta's included."""
        was_reasoning, had_reasoning = self.is_reasoning, self.has_reasoning
        self._buffer += text
        split = self._settle(is_final=False)
        if was_reasoning or self.is_reasoning or self.has_reasoning > had_reasoning:
            self.num_reasoning_tokens = num_tokens
        return split

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the reply's end; a reasoning cut off by max_tokens stays reasoning."""
        return self._settle(is_final=True)

    def _settle(self, is_final: bool) -> tuple[str, str]:
        if self.state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.state, self._buffer = "reasoning", stripped[len(THINK_OPEN) :]
            elif not is_final and THINK_OPEN.startswith(stripped):
                return "", ""  # nothing yet, or a <think> still arriving
            else:
                self.state = "reasoning" if self.is_open else "answer"
                self._is_answer_started = not self.is_open  # a reply that does not reason is left as it is
            self.has_reasoning = self.state == "reasoning"
        reasoning = ""
        if self.state == "reasoning":
            if not self._is_reasoning_started:
                self._buffer = self._buffer.lstrip()
            end = self._buffer.find(THINK_CLOSE)
            if end < 0 and not is_final:
                held = _held_tail(self._buffer, THINK_CLOSE)
                reasoning = self._buffer[: len(self._buffer) - held].rstrip()
                self._buffer = self._buffer[len(reasoning) :]
                self._is_reasoning_started |= bool(reasoning)
                return reasoning, ""
            reasoning = self._buffer[: end if end >= 0 else len(self._buffer)].rstrip()
            self._buffer = self._buffer[end + len(THINK_CLOSE) :] if end >= 0 else ""
            self.state = "answer"
        if not self._is_answer_started:
            self._buffer = self._buffer.lstrip()
            self._is_answer_started = bool(self._buffer)
        answer, self._buffer = self._buffer, ""
        return reasoning, answer


def split_reasoning(text: str, is_open: bool = False) -> tuple[str | None, str]:
    """A whole reply as (reasoning, answer); reasoning is None when the reply has none."""
    parser = ReasoningParser(is_open)
    reasoning, answer = parser.feed(text)
    last_reasoning, last_answer = parser.finish()
    return (reasoning + last_reasoning if parser.has_reasoning else None), answer + last_answer
