"""Reasoning models on the server: the text before </think> is `reasoning_content`, beside `content`, whole
and streamed, through the `openai` client. Replies are scripted token by token through the real tokenizer
(a random tiny model writes no tags), and once from the real model to see the parser applied to it."""

import httpx
import openai
import pytest

from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.engine import LLMEngine
from lowvram.engine.outputs import CompletionOutput, RequestOutput
from lowvram.engine.tokenizer import Detokenizer
from lowvram.server.app import create_app
from lowvram.server.cli import BackgroundServer, bind_socket

THOUGHT = "The user adds 17 and 25.\n17 + 25 = 42."
ANSWER = "The answer is **42**."
MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]


class ScriptedReplies(AsyncLLMEngine):
    """The real engine behind it, except that while `reply` is set every request gets that text, token by token."""

    reply: str | None = None

    async def generate(self, request_id, prompt=None, params=None, *, prompt_token_ids=None, messages=None):
        if self.reply is None:
            async for out in super().generate(request_id, prompt, params, prompt_token_ids=prompt_token_ids):
                yield out
            return
        ids = self.engine.tokenizer.hf.encode(self.reply, add_special_tokens=False)[: params.max_tokens]
        detokenizer, text = Detokenizer(self.engine.tokenizer), ""
        for n in range(1, len(ids) + 1):
            delta = detokenizer.add(ids[n - 1])
            text += delta
            finish_reason = None if n < len(ids) else "length" if n == params.max_tokens else "stop"
            completion = CompletionOutput(0, text, ids[:n], finish_reason)
            yield RequestOutput(request_id, None, prompt_token_ids, [completion], n == len(ids), delta)


@pytest.fixture(scope="module")
def engine(tiny_reasoning_dir):
    return LLMEngine(str(tiny_reasoning_dir), "cpu", max_model_len=256)


@pytest.fixture(scope="module")
def scripted(engine):
    running = ScriptedReplies(engine).start()
    yield running
    running.stop()


def serve(async_engine, **kwargs):
    app = create_app(async_engine, model_name="r1", default_max_tokens=64, **kwargs)
    return BackgroundServer(app, bind_socket("127.0.0.1", 0))


@pytest.fixture(scope="module")
def client(scripted):
    with (
        serve(scripted) as server,
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=30
        ) as client,
    ):
        yield client


@pytest.fixture
def reply(scripted):
    """Set the scripted reply for one test."""

    def script(text):
        scripted.reply = text

    yield script
    scripted.reply = None


def num_tokens(engine, text: str) -> int:
    return len(engine.tokenizer.hf.encode(text, add_special_tokens=False))


def test_the_template_opens_think_so_the_reply_holds_only_the_closing_tag(client, reply, engine):
    text = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    reply(text)
    result = client.chat.completions.create(model="r1", messages=MESSAGES)
    message = result.choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == ANSWER
    assert result.usage.completion_tokens == num_tokens(engine, text)  # the reasoning's tokens are counted too
    thought_tokens = num_tokens(engine, f"{THOUGHT}\n</think>")
    assert result.usage.completion_tokens_details.reasoning_tokens in (thought_tokens, thought_tokens + 1)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_streamed_reasoning_comes_first_in_its_own_deltas(client, reply):
    reply(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    chunks = list(client.chat.completions.create(model="r1", messages=MESSAGES, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" if d.content else None for d in deltas]
    kinds = [k for k in kinds if k]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index) and len(set(kinds)) == 2
    assert kinds.count("reasoning") > 1  # streamed, not one block at the end
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_reply_that_opens_think_itself_is_split_too(client, reply):
    reply(f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}")  # R1's first templates left the opening tag to the model
    message = client.chat.completions.create(model="r1", messages=MESSAGES).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)


def test_reasoning_cut_by_max_tokens_is_all_reasoning(client, reply, engine):
    reply(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    result = client.chat.completions.create(model="r1", messages=MESSAGES, max_tokens=4)
    message = result.choices[0].message
    assert message.content == "" and THOUGHT.startswith(message.reasoning_content) and message.reasoning_content
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == result.usage.completion_tokens_details.reasoning_tokens == 4


def test_completions_are_left_as_they_are(client, reply):
    text = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    reply(text)
    result = client.completions.create(model="r1", prompt="17 + 25")
    assert result.choices[0].text == text and result.usage.completion_tokens_details is None


def test_the_parser_applies_to_the_real_models_reply(client, engine):
    """A random tiny model never closes the reasoning the template opened: all it writes is reasoning."""
    greedy = dict(model="r1", temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    message = client.chat.completions.create(messages=MESSAGES, **greedy).choices[0].message
    ids = engine.tokenizer.apply_chat_template(MESSAGES)
    raw = client.completions.create(prompt=ids, **greedy).choices[0].text
    assert "</think>" not in raw and message.content == ""
    assert message.reasoning_content == raw.strip()


def test_reasoning_parser_none_leaves_the_tags_in_content(scripted, reply):
    text = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    reply(text)
    with serve(scripted, reasoning_parser="none") as server:
        body = {"model": "r1", "messages": MESSAGES}
        result = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body, timeout=30).json()
    message = result["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text} and "completion_tokens_details" not in result["usage"]


def test_auto_is_on_only_for_templates_with_think_tags(scripted, tiny_llama_dir):
    assert create_app(scripted, model_name="r1").state.lowvram.is_reasoning_parsed
    plain = LLMEngine(str(tiny_llama_dir), "cpu", max_model_len=64)
    plain.tokenizer.hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not create_app(AsyncLLMEngine(plain), model_name="x").state.lowvram.is_reasoning_parsed
    assert create_app(
        AsyncLLMEngine(plain), model_name="x", reasoning_parser="deepseek_r1"
    ).state.lowvram.is_reasoning_parsed
    with pytest.raises(ValueError, match="reasoning_parser = 'qwen3'; use one of auto, deepseek_r1, none"):
        create_app(scripted, model_name="r1", reasoning_parser="qwen3")


def test_serve_takes_the_reasoning_parser_flag():
    from lowvram.cli import build_parser

    assert build_parser().parse_args(["serve"]).reasoning_parser == "auto"
    assert build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
