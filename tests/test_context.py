"""The context policy: which messages go to the model when the conversation outgrows its context. Exact, no torch."""

import pytest

from lowvram.core.context import ContextLengthError, fit_messages, split_turns, truncate_prompt

# system, then turns 1..4 (user + assistant), then the new message
ROLES = ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
TOKENS = [10, 5, 20, 5, 20, 5, 20, 5, 20, 5]  # 115 in all


def fit(max_model_len, max_tokens=10, roles=ROLES, tokens=TOKENS, **kwargs):
    return fit_messages(roles, tokens, max_model_len=max_model_len, max_tokens=max_tokens, **kwargs)


def test_turns_start_at_each_user_message_after_the_system_prompt():
    assert split_turns(ROLES) == ([0], [[1, 2], [3, 4], [5, 6], [7, 8], [9]])
    assert split_turns(["assistant", "user"]) == ([], [[0], [1]])  # a transcript that starts with a reply


def test_everything_is_kept_when_it_fits():
    result = fit(125)
    assert result.kept == tuple(range(10)) and result.num_dropped_turns == 0 and result.num_prompt_tokens == 115


def test_the_oldest_turns_after_the_first_go_first():
    # 126 needed (115 + 10 for the reply): one turn of 25 goes, the second one (the first turn stays)
    assert fit(124).kept == (0, 1, 2, 5, 6, 7, 8, 9)
    assert fit(124).num_dropped_turns == 1 and fit(124).num_prompt_tokens == 90
    assert fit(99).kept == (0, 1, 2, 7, 8, 9)  # two turns
    assert fit(50).kept == (0, 1, 2, 9)  # all the middle ones


def test_the_first_turns_go_last_and_the_system_prompt_never():
    assert fit(49).kept == (0, 9)
    assert fit(49).num_dropped_turns == 4
    assert fit(25).kept == (0, 9)  # exactly system + new message + reply
    assert fit(124, num_keep_turns=0).kept == (0, 3, 4, 5, 6, 7, 8, 9)
    assert fit(100, num_keep_turns=2).kept == (0, 1, 2, 3, 4, 7, 8, 9)
    assert fit(99, num_keep_turns=2).kept == (0, 1, 2, 3, 4, 9)


def test_without_a_system_prompt():
    roles, tokens = ROLES[1:], TOKENS[1:]
    assert fit(100, roles=roles, tokens=tokens).kept == (0, 1, 4, 5, 6, 7, 8)


def test_a_message_longer_than_the_context_is_a_clear_error():
    with pytest.raises(ContextLengthError) as error:
        fit(24)  # system 10 + message 5 + reply 10 = 25
    message = str(error.value)
    assert "5 tokens" in message and "system prompt's 10" in message and "24-token context" in message
    assert "/max" in message
    with pytest.raises(ContextLengthError, match="the message has 600 tokens, and the reply may take 10"):
        fit(512, roles=["user"], tokens=[600])


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(100))
    assert truncate_prompt(ids, 30, 512) == list(range(70, 100))
    assert truncate_prompt(ids, 200, 512) == ids  # shorter than N: unchanged
    with pytest.raises(ContextLengthError, match="truncate_prompt_tokens = 513 is larger than .* context of 512"):
        truncate_prompt(ids, 513, 512)
