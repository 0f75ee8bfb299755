"""The offline Python API, shaped like vLLM's:
llm = LLM(model="path/to/DeepSeek-R1-Distill-Qwen-1.5B", profile="4gb")
print(llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text)"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from lowvram.config import Profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import LLMEngine
from lowvram.engine.outputs import RequestOutput
from lowvram.errors import RequestError

PromptType = str | dict
ParamsType = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    """A model loaded for generation. Arguments as LLMEngine's."""

    def __init__(self, model: str | None = None, profile: str | Profile | None = None, **engine_args):
        self.engine = LLMEngine(model, profile, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def _add(self, params: SamplingParams, prompt: PromptType | None = None, messages: list[dict] | None = None) -> str:
        request_id = f"offline-{next(self._ids)}"
        ids = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            ids = list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else None
            prompt = None if ids is not None else prompt["prompt"]
        self.engine.add_request(request_id, prompt, params, prompt_token_ids=ids, messages=messages)
        return request_id

    def _run(self, items: list, sampling_params: ParamsType, is_chat: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        elif len(sampling_params) != len(items):
            raise RequestError(f"got {len(sampling_params)} sampling params for {len(items)} prompts")
        else:
            params = list(sampling_params)
        request_ids = [self._add(p, None, item) if is_chat else self._add(p, item) for item, p in zip(items, params)]
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:  # an interrupt must not leave requests holding pages
            for request_id in request_ids:
                if request_id not in final:
                    self.engine.abort_request(request_id)
        return [final[r] for r in request_ids]

    def generate(
        self, prompts: PromptType | Sequence[PromptType], sampling_params: ParamsType = None
    ) -> list[RequestOutput]:
        """Generate for one or many prompts (batched together); outputs in prompt order."""
        return self._run([prompts] if isinstance(prompts, (str, dict)) else prompts, sampling_params, False)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: ParamsType = None) -> list[RequestOutput]:
        """Generate replies for one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run(conversations, sampling_params, True)

    def save_conversation(self, messages: list[dict], path=None):
        """Save a conversation's KV pages to a file (default: ~/.local/share/lowvram/conversations)."""
        from lowvram.kv.conversation_store import save_conversation

        return save_conversation(self.engine, self.engine.tokenizer.apply_chat_template(messages, False), path)

    def restore_conversation(self, path):
        """Load a saved conversation's pages so its next turn skips recomputing. A file from another
        model, format or precision, or a damaged one, is reported in the result and ignored."""
        from lowvram.kv.conversation_store import restore_conversation

        return restore_conversation(self.engine, path)

    def stream(
        self,
        prompt: PromptType | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per new token, the last one finished; closing early aborts the request."""
        request_id = self._add(sampling_params or SamplingParams(), prompt, messages)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort_request(request_id)
