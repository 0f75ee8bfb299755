"""The <think> parser shared by the server and the chat: exact splits, whatever the deltas' boundaries."""

import pytest

from lowvram.engine.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning, uses_reasoning_tags

R1_REPLY = "<think>\nThe user adds 17 and 25.\n17 + 25 = 42.\n</think>\n\nThe answer is **42**."


def streamed(text: str, is_open: bool, size: int) -> tuple[str, str, int]:
    """(reasoning, answer, reasoning tokens) of `text` fed `size` characters at a time, one token per delta."""
    parser, reasoning, answer = ReasoningParser(is_open), "", ""
    for num_tokens, start in enumerate(range(0, len(text), size), 1):
        more_reasoning, more_answer = parser.feed(text[start : start + size], num_tokens)
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    last_reasoning, last_answer = parser.finish()
    return reasoning + last_reasoning, answer + last_answer, parser.num_reasoning_tokens


@pytest.mark.parametrize(
    "text, is_open, reasoning, answer",
    [
        (R1_REPLY, False, "The user adds 17 and 25.\n17 + 25 = 42.", "The answer is **42**."),  # R1 opens itself
        (R1_REPLY.removeprefix("<think>\n"), True, "The user adds 17 and 25.\n17 + 25 = 42.", "The answer is **42**."),
        ("<think>\n\n</think>\n\nHi!", False, "", "Hi!"),  # an empty thought
        ("  Hello <think> there </think>", False, None, "  Hello <think> there </think>"),  # not reasoning: as is
        ("<thi", False, None, "<thi"),
        ("<think>\nStill thinking when max_tokens cut it ", False, "Still thinking when max_tokens cut it", ""),
        ("a < b and c </ d", True, "a < b and c </ d", ""),
        ("x</think>y</think>z", True, "x", "y</think>z"),  # only the first closing tag ends the reasoning
    ],
)
def test_every_chunking_gives_the_same_split(text, is_open, reasoning, answer):
    assert split_reasoning(text, is_open) == (reasoning, answer)
    for size in (1, 2, 3, 5, 8, len(text)):  # tags split across deltas at every offset
        assert streamed(text, is_open, size)[:2] == (reasoning or "", answer)


def test_reasoning_tokens_count_up_to_the_one_that_closes_it():
    pieces = ["Let", " me", " add", ".\n</", "think", ">\n\n", "42"]
    parser = ReasoningParser(is_open=True)
    splits = [parser.feed(piece, n) for n, piece in enumerate(pieces, 1)]
    assert parser.num_reasoning_tokens == 6 and parser.finish() == ("", "")
    assert "".join(r for r, _ in splits) == "Let me add." and "".join(a for _, a in splits) == "42"
    assert splits[3] == (".", "") and splits[4] == ("", "")  # "\n</" and "\n</think" wait: maybe a tag
    assert streamed(R1_REPLY, False, len(R1_REPLY))[2] == 1  # all of it in one delta


def test_a_reply_that_does_not_reason_counts_no_reasoning_tokens():
    parser = ReasoningParser()
    assert parser.feed("  ", 1) == ("", "") and parser.feed("42", 2) == ("", "  42")
    assert parser.num_reasoning_tokens == 0 and not parser.has_reasoning


def test_templates_and_prompts_that_open_reasoning():
    assert uses_reasoning_tags("{{ '<｜Assistant｜><think>\\n' }}")
    assert uses_reasoning_tags("{{ content.split('</think>')[-1] }}")  # R1's first templates
    assert not uses_reasoning_tags("{{ '<|im_start|>assistant\\n' }}") and not uses_reasoning_tags(None)
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜>")
    assert not prompt_opens_reasoning("<｜Assistant｜><think>\n\n</think>\n\n")  # thinking switched off
