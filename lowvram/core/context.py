"""What of a prompt goes to the model when it would not fit its context (plain Python over token counts).

The chat's policy is llama.cpp's context shift with `n_keep`: the system prompt and the first turn(s) stay (they
anchor the conversation and act as attention sinks), the oldest whole turns after them go, and the newest turn
always stays. The kept head renders to the same tokens at the same positions as before, so its full KV pages come
from the prefix cache; what follows the dropped turns moves to earlier positions, and since RoPE is applied to K
before it is cached, those tokens are computed again in one prefill (llama.cpp rotates the cached K instead).
The server's `truncate_prompt_tokens` is vLLM's left truncation: the prompt keeps its last N tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.errors import RequestError


class ContextLengthError(RequestError):
    """A prompt that no dropping of old turns can fit into the model's context."""


@dataclass(frozen=True)
class ContextFit:
    """The messages to send: `kept` indexes the conversation's messages, in order."""

    kept: tuple[int, ...]
    num_dropped_turns: int
    num_prompt_tokens: int  # the kept messages' token counts summed


def split_turns(roles: list[str]) -> tuple[list[int], list[list[int]]]:
    """The leading system messages' indices, and the turns after them: each starts at a user message and holds
    what follows it up to the next one."""
    num_system = next((i for i, role in enumerate(roles) if role != "system"), len(roles))
    turns: list[list[int]] = []
    for i in range(num_system, len(roles)):
        if roles[i] == "user" or not turns:
            turns.append([])
        turns[-1].append(i)
    return list(range(num_system)), turns


def fit_messages(
    roles: list[str], num_tokens: list[int], *, max_model_len: int, max_tokens: int, num_keep_turns: int = 1
) -> ContextFit:
    """Keep what fits `max_model_len` with `max_tokens` left for the reply.

    roles, num_tokens: each message's role and token count (chat-template overhead counted in some message).
    The system prompt and the newest turn are always kept; the oldest turns after the first `num_keep_turns`
    are dropped first, then, if that is not enough, the first turns too (oldest first). Raises
    ContextLengthError when the system prompt and the newest turn alone leave no room for the reply."""
    if len(roles) != len(num_tokens):
        raise ValueError("roles and num_tokens must have one entry per message")
    system, turns = split_turns(roles)
    budget = max_model_len - max_tokens
    total = sum(num_tokens)
    # oldest droppable first: the turns after the kept head, then the head itself; never the newest turn
    middle = turns[num_keep_turns:-1] if len(turns) > num_keep_turns else []
    order = middle + turns[: min(num_keep_turns, len(turns) - 1)]
    dropped: list[list[int]] = []
    for turn in order:
        if total <= budget:
            break
        dropped.append(turn)
        total -= sum(num_tokens[i] for i in turn)
    if total > budget:
        newest = sum(num_tokens[i] for i in turns[-1]) if turns else 0
        system_part = f" with the system prompt's {total - newest}" if system else ""
        raise ContextLengthError(
            f"the message has {newest} tokens{system_part}, and the reply may take {max_tokens}: more than the "
            f"model's {max_model_len}-token context; shorten the message or the system prompt, or lower the "
            "max tokens per reply (/max)"
        )
    gone = {i for turn in dropped for i in turn}
    kept = tuple(i for i in range(len(roles)) if i not in gone)
    return ContextFit(kept, len(dropped), total)


def truncate_prompt(token_ids: list[int], num_keep_tokens: int, max_model_len: int) -> list[int]:
    """The prompt's last `num_keep_tokens` tokens (vLLM's truncate_prompt_tokens: left truncation)."""
    if num_keep_tokens > max_model_len:
        raise ContextLengthError(
            f"truncate_prompt_tokens = {num_keep_tokens} is larger than this model's context of {max_model_len} "
            f"tokens; use at most {max_model_len}"
        )
    return token_ids[-num_keep_tokens:]
