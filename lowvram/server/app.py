"""The OpenAI-compatible HTTP app. Each admitted request is a `_Generation`: a task pumps the engine's stream
into a queue the handler reads, so a disconnect or the shutdown timer can end it at any moment (cancelling the
pump aborts the request, freeing its KV pages). Requests are validated and tokenized before admission, so every
mistake is a 4xx before any streamed byte; `model` only selects the one name the app was built with."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from functools import partial

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lowvram.core.context import truncate_prompt
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.outputs import RequestOutput
from lowvram.engine.reasoning import ReasoningParser
from lowvram.errors import LowvramError, RequestError
from lowvram.server import defaults
from lowvram.server.metrics import CONTENT_TYPE, ServerMetrics
from lowvram.server.schemas import ChatCompletionRequest, ChatShape, CompletionShape, describe_validation_error
from lowvram.server.status import engine_status

log = logging.getLogger("lowvram")

RETRY_AFTER_FULL_S = 1
RETRY_AFTER_SHUTDOWN_S = 5
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/status", "/health", "/metrics")
SSE_DONE = b"data: [DONE]\n\n"
REASONING_PARSERS = ("auto", "deepseek_r1", "none")


def _printable(text: str | None, max_chars: int = 300) -> str | None:
    # Error text can quote request keys, which may hold unpaired surrogates that UTF-8 cannot carry.
    if text is None:
        return None
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _json_bytes(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json_bytes(body), status_code=status, headers=headers, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + _json_bytes(body) + b"\n\n"


class ApiError(Exception):
    """Answered as an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type="invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers or {}

    def body(self) -> dict:
        message, param = _printable(str(self), 2000), _printable(self.param)
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}

    def response(self) -> Response:
        return _json_response(self.body(), self.status, self.headers)


def _shutting_down(message: str) -> ApiError:
    headers = {"Retry-After": str(RETRY_AFTER_SHUTDOWN_S)}
    return ApiError(503, message, type="server_error", code="server_shutting_down", headers=headers)


class _Ended(Exception):
    """The server ended a generation before the engine finished it; args[0] is 'disconnect' or 'shutdown'."""


def _is_disconnect(exc: BaseException) -> bool:
    return isinstance(exc, _Ended) and exc.args[0] == "disconnect"


class _Generation:
    """One admitted request on the engine, as one engine request per choice; `next_output()` yields
    (choice index, output) in order. `end(reason)` cancels the pump (aborting the requests) and the reader
    gets `_Ended(reason)` after what is already queued. `close()` gives the queue slot back."""

    def __init__(self, state: ServerState, request_id: str, ids: list[int], params: list[SamplingParams]):
        self.state = state
        self.num_prompt_tokens, self.num_output_tokens = len(ids), [0] * len(params)
        self.num_unfinished = len(params)
        self.counts_output = True  # False when the generated token is not shown (echo with max_tokens = 0)
        self.finish_reason: str | None = None
        self.admitted_at = time.perf_counter()
        self._last_token_at: float | None = None
        self._items: asyncio.Queue = asyncio.Queue()
        state.generations.add(self)
        state.metrics.prompt_tokens.inc(amount=self.num_prompt_tokens)
        self._task = asyncio.create_task(self._pump(request_id, ids, params))

    async def _pump(self, request_id: str, ids: list[int], params: list[SamplingParams]) -> None:
        started = asyncio.Event()
        tasks = [asyncio.create_task(self._pump_choice(0, request_id, ids, params[0], started))]
        try:
            if len(params) > 1:
                # The other choices start once the first one's prefill has cached the prompt's pages,
                # so they share them instead of computing the prompt again.
                waiter = asyncio.create_task(started.wait())
                try:
                    await asyncio.wait([tasks[0], waiter], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                for i, choice_params in enumerate(params[1:], 1):
                    tasks.append(asyncio.create_task(self._pump_choice(i, f"{request_id}-{i}", ids, choice_params)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            pass  # end() was called; cancelling the engine streams has already aborted the requests
        except Exception as exc:  # delivered to the reader, which turns it into an error response
            self._items.put_nowait(exc)
        finally:
            for task in tasks:
                task.cancel()

    async def _pump_choice(self, index, request_id, ids, params, started: asyncio.Event | None = None) -> None:
        async for out in self.state.async_engine.generate(request_id, None, params, prompt_token_ids=ids):
            self._items.put_nowait((index, out))
            if started is not None:
                started.set()

    def end(self, reason: str) -> None:
        self._task.cancel()
        self._items.put_nowait(_Ended(reason))

    async def next_output(self) -> tuple[int, RequestOutput]:
        """The next (choice, output); raises _Ended if the server ended the request, or the engine's error."""
        item = await self._items.get()
        if isinstance(item, BaseException):
            self.finish_reason = self.finish_reason or (item.args[0] if isinstance(item, _Ended) else "error")
            raise item
        index, item = item
        now = time.perf_counter()
        metrics = self.state.metrics
        if self._last_token_at is None:
            metrics.ttft.observe(now - self.admitted_at)
        else:
            metrics.token_latency.observe(now - self._last_token_at)
        self._last_token_at = now
        self.num_output_tokens[index] = len(item.outputs[0].token_ids)
        metrics.generation_tokens.inc()
        metrics.observe_snapshot(self.state.async_engine.snapshot())
        if item.finished:
            self.num_unfinished -= 1
            self.finish_reason = item.outputs[0].finish_reason
        item.outputs[0].index = index
        return index, item

    def close(self) -> None:
        if self not in self.state.generations:
            return
        self._task.cancel()
        self.state.generations.discard(self)
        self.state.num_in_flight -= 1
        self.state.metrics.finished.inc(self.finish_reason or "abort")

    def usage(self) -> dict:
        prompt, completion = self.num_prompt_tokens, sum(self.num_output_tokens) if self.counts_output else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _watch_disconnect(receive, generation: _Generation) -> None:
    """End the generation when the client goes away (uvicorn reports it as http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    generation.end("disconnect")


class ServerState:
    """Everything the routes share. Built by `create_app`, found at `app.state.lowvram`."""

    def __init__(self, async_engine, model_name, api_key, max_queue, max_body_bytes, default_max_tokens, grace_s):
        self.async_engine, self.engine, self.model_name = async_engine, async_engine.engine, model_name
        self.max_model_len = self.engine.max_model_len
        self._api_key = api_key.encode("utf-8") if api_key else None
        self.max_queue, self.max_body_bytes = max_queue, max_body_bytes
        self.default_max_tokens, self.shutdown_grace_s = default_max_tokens, grace_s
        self.metrics = ServerMetrics(model_name)
        self.generations: set[_Generation] = set()
        self.num_in_flight = 0  # admitted requests, including those still being tokenized
        self.is_draining = False
        self.is_reasoning_parsed = False  # chat replies' <think> part goes to `reasoning_content`
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    def check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest takes time independent of where the strings differ
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), self._api_key):
            message = "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the "
            message += "server was started with"
            headers = {"WWW-Authenticate": "Bearer"}
            raise ApiError(401, message, type="authentication_error", code="invalid_api_key", headers=headers)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            message = (
                f"the model '{name}' does not exist on this server; it serves '{self.model_name}' (see GET /v1/models)"
            )
            raise ApiError(404, message, param="model", code="model_not_found")

    def model_card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lowvram"}
        return {**card, "max_model_len": self.max_model_len}

    def admit(self) -> None:
        if self.is_draining:
            self.metrics.rejected.inc("shutdown")
            raise _shutting_down("the server is shutting down and takes no new requests")
        if self.num_in_flight >= self.max_queue:
            self.metrics.rejected.inc("queue_full")
            busy = f"{self.num_in_flight} requests are in flight, the most it queues (max_queue = {self.max_queue})"
            headers = {"Retry-After": str(RETRY_AFTER_FULL_S)}
            message = f"the server is busy: {busy}; retry after a moment"
            raise ApiError(429, message, type="rate_limit_error", code="server_overloaded", headers=headers)
        self.num_in_flight += 1

    def begin_shutdown(self, grace_s: float | None = None) -> None:
        """Refuse new requests; in-flight ones get `grace_s` to finish, then are ended cleanly.
        Safe to call from a signal handler or another thread."""
        self.is_draining = True
        grace_s = self.shutdown_grace_s if grace_s is None else grace_s
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                self.loop.call_soon_threadsafe(lambda: self.loop.call_later(grace_s, self.end_all, "shutdown"))

    def end_all(self, reason: str) -> None:
        for generation in list(self.generations):
            generation.end(reason)

    def token_text(self, token_id: int) -> str:
        """A token's text as log-probabilities show it (special tokens included)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.tokenizer.hf.decode([token_id])
        return text

    def encode(self, request) -> list[int]:
        """Prompt token ids; runs in a worker thread (tokenizing a long prompt takes a while)."""
        if isinstance(request, ChatCompletionRequest):
            param = "messages"
            try:
                ids = self.engine.tokenizer.apply_chat_template([m.for_template() for m in request.messages])
            except LowvramError:
                raise
            except Exception as exc:  # templates reject conversations with jinja's raise_exception
                raise RequestError(f"the model's chat template rejected the messages: {exc}") from None
        else:
            param, ids, vocab_size = "prompt", request.prompt, self.engine.config.vocab_size
            if ids == []:
                raise RequestError("'prompt' is an empty list; send a string or a list of token ids")
            if isinstance(ids, list) and isinstance(ids[0], list | str):  # a batch, or a list of one string
                if len(ids) > 1:
                    raise RequestError(f"'prompt' holds {len(ids)} prompts; this server takes one prompt per request")
                ids = ids[0]
            if request.suffix and not isinstance(ids, str):
                raise ApiError(400, "'suffix' needs the prompt as text, not token ids", param="suffix")
            if request.suffix:
                try:
                    ids = self.engine.tokenizer.encode_fill_in_middle(ids, request.suffix)
                except RequestError as exc:
                    raise ApiError(400, str(exc), param="suffix") from None
            elif isinstance(ids, str):
                ids = self.engine.tokenizer.encode(ids)
            elif any(not 0 <= t < vocab_size for t in ids):
                raise ApiError(400, f"prompt token ids must be in 0..{vocab_size - 1}", param="prompt")
        if request.response_format is not None and (schema := request.response_format.output_schema()) is not None:
            try:
                self.engine.grammars.check(schema)
            except RequestError as exc:
                raise ApiError(400, str(exc), param="response_format") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        if request.truncate_prompt_tokens is not None:
            try:
                ids = truncate_prompt(ids, request.truncate_prompt_tokens, self.max_model_len)
            except RequestError as exc:
                raise ApiError(400, str(exc), param="truncate_prompt_tokens", code="context_length_exceeded") from None
        if len(ids) >= self.max_model_len:
            raise self._too_long(param, f"the prompt has {len(ids)} tokens; shorten it")
        return ids

    def _too_long(self, param: str, detail: str) -> ApiError:
        message = f"this model's maximum context length is {self.max_model_len} tokens, but {detail}"
        return ApiError(400, message, param=param, code="context_length_exceeded")

    def sampling_params(self, request, num_prompt: int) -> list[SamplingParams]:
        """One SamplingParams per choice (n)."""
        room = self.max_model_len - num_prompt
        max_tokens = request.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            asked = f"({num_prompt} in the prompt, {max_tokens} for the completion); reduce the prompt or max_tokens"
            raise self._too_long("max_tokens", f"{num_prompt + max_tokens} were requested {asked}")
        kwargs = {**request.sampling_kwargs(), "max_tokens": max_tokens or 1}  # 0: score the prompt only
        # Each choice its own seed, so seeded choices differ yet repeat; the prompt is scored once.
        seed, n = kwargs.pop("seed", None), request.n or 1
        seeds = [None] * n if seed is None else [(seed + i) % 2**63 for i in range(n)]
        prompt_logprobs = [kwargs.pop("prompt_logprobs", None)] + [None] * (n - 1)
        return [SamplingParams(**kwargs, seed=s, prompt_logprobs=p) for s, p in zip(seeds, prompt_logprobs)]


def _failure(exc: BaseException) -> ApiError:
    """The error answer for a generation that failed or was ended by the server."""
    if isinstance(exc, _Ended):
        return _shutting_down("the server is shutting down; the response was cut short")
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc))
    if isinstance(exc, LowvramError):
        return ApiError(503, str(exc), type="server_error")
    log.error("generation failed: %r", exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


class _EventStream(Response):
    """Server-sent events for one generation in OpenAI's chunk format, ending with `data: [DONE]`.
    Watches for the client going away, so a dropped connection aborts the request at once."""

    media_type = "text/event-stream"

    def __init__(self, generation: _Generation, shape: CompletionShape, *, include_usage: bool):
        self.generation, self.shape, self.include_usage = generation, shape, include_usage
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self):
        for index in range(len(self.generation.num_output_tokens)):
            if (first := self.shape.first(index)) is not None:
                yield self._chunk(first)
        try:
            while self.generation.num_unfinished:
                index, out = await self.generation.next_output()
                for chunk in self.shape.deltas(index, out):
                    yield self._chunk(chunk)
                if out.finished:
                    yield self._chunk(self.shape.finish(out.outputs[0].finish_reason, index))
        except Exception as exc:  # the headers are gone: report in-band, as OpenAI does
            if not _is_disconnect(exc):  # else nobody is listening
                yield _sse(_failure(exc).body())
                yield SSE_DONE
            return
        if self.include_usage:
            yield self._chunk(self.shape.usage_chunk(self.generation.usage()))
        yield SSE_DONE

    def _chunk(self, chunk: dict) -> bytes:
        # OpenAI sends `"usage": null` on every chunk only when usage was asked for.
        if not self.include_usage:
            del chunk["usage"]
        return _sse(chunk)

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.generation))
        events = self._events()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the connection broke mid-write; close() below aborts the request
        finally:
            watcher.cancel()
            await events.aclose()
            self.generation.close()


async def _read_json(request: Request, max_body_bytes: int) -> dict:
    too_large = ApiError(
        413, f"the request body is larger than the server's limit of {max_body_bytes} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise too_large
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")

    def refuse_constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    def checked_object(pairs: list[tuple[str, object]]) -> dict:
        try:
            "".join(key for key, _ in pairs).encode("utf-8")  # surrogates stay unpaired when joined
        except UnicodeEncodeError:
            surrogate = "an unpaired UTF-16 surrogate (a broken \\u escape)"
            raise ApiError(400, f"a key in the request body contains {surrogate}") from None
        return dict(pairs)

    try:
        data = json.loads(body, parse_constant=refuse_constant, object_pairs_hook=checked_object)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"the request body is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not a JSON {type(data).__name__}")
    return data


async def _generate(request: Request, state: ServerState, shape_type: type[CompletionShape]) -> Response:
    model = shape_type.request_type
    try:
        body = model.model_validate(model.without_noop_params(await _read_json(request, state.max_body_bytes)))
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise ApiError(400, message, param=param) from None
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    state.check_model(body.model)
    state.admit()
    try:
        prompt_token_ids = await asyncio.to_thread(state.encode, body)
        params = state.sampling_params(body, len(prompt_token_ids))
    except BaseException:
        state.num_in_flight -= 1
        raise
    request_id = shape_type.id_prefix + uuid.uuid4().hex
    generation = _Generation(state, request_id, prompt_token_ids, params)
    shape = shape_type(request_id, state.model_name, token_text=state.token_text)
    if state.is_reasoning_parsed and isinstance(body, ChatCompletionRequest):
        opens = state.engine.tokenizer.prompt_opens_reasoning(prompt_token_ids)
        shape.new_parser = lambda: ReasoningParser(opens)
    if getattr(body, "echo", False):
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        shape.echo_text = prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt_token_ids)
    shape.hides_output = body.requested_max_tokens() == 0
    generation.counts_output = not shape.hides_output
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(generation, shape, include_usage=include_usage)
    watcher = asyncio.create_task(_watch_disconnect(request.receive, generation))
    outs: list[RequestOutput | None] = [None] * len(params)
    try:
        while generation.num_unfinished:
            index, out = await generation.next_output()
            outs[index] = out
            shape.track(index, out)
    except Exception as exc:
        if _is_disconnect(exc):
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return _failure(exc).response()
    finally:
        watcher.cancel()
        generation.close()
    return _json_response(shape.whole(outs, generation.usage()))


async def _list_models(request: Request, state: ServerState) -> Response:
    return _json_response({"object": "list", "data": [state.model_card()]})


async def _retrieve_model(request: Request, state: ServerState) -> Response:
    state.check_model(request.path_params["model"])
    return _json_response(state.model_card())


async def _health(request: Request, state: ServerState) -> Response:
    body = {"status": "draining" if state.is_draining else "ok", "model": state.model_name}
    body["requests_in_flight"] = state.num_in_flight
    return _json_response(body, 503 if state.is_draining else 200)


async def _status(request: Request, state: ServerState) -> Response:
    body = {"model": state.model_name, "status": "draining" if state.is_draining else "ok"}
    body |= await state.async_engine.call(engine_status)
    body["requests"] |= {"in_flight": state.num_in_flight, "max_queue": state.max_queue}
    return _json_response(body)


async def _metrics(request: Request, state: ServerState) -> Response:
    snapshot = state.async_engine.snapshot()
    text = state.metrics.render(snapshot, num_in_flight=state.num_in_flight, max_queue=state.max_queue)
    return Response(text, media_type=CONTENT_TYPE)


def _route(path: str, handler, method: str = "GET", *, needs_auth: bool = True) -> Route:
    """A route whose every failure is an OpenAI error object; nothing reaches the ASGI server."""

    async def endpoint(request: Request) -> Response:
        state = request.app.state.lowvram
        try:
            if needs_auth:
                state.check_auth(request)
            return await handler(request, state)
        except ApiError as exc:
            return exc.response()
        except RequestError as exc:
            return ApiError(400, str(exc), param=getattr(exc, "param", None)).response()
        except Exception:
            log.exception("error while answering %s %s", request.method, request.url.path)
            return ApiError(
                500, "internal server error; the server log has the details", type="server_error"
            ).response()

    return Route(path, endpoint, methods=[method])


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}; this server has " + ", ".join(ENDPOINTS)
        return ApiError(404, message, code="not_found").response()
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        return ApiError(405, message, code="method_not_allowed", headers=exc.headers).response()
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()


def _count_responses(app, metrics: ServerMetrics):
    """ASGI middleware: counts answers by endpoint and status code for /metrics."""

    async def counting_app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                metrics.requests.inc(endpoint, str(message["status"]))
            await send(message)

        await app(scope, receive, counting_send)

    return counting_app


def create_app(
    async_engine: AsyncLLMEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_queue: int = defaults.MAX_QUEUE,
    max_body_bytes: int = defaults.MAX_BODY_BYTES,
    default_max_tokens: int = defaults.MAX_TOKENS,
    shutdown_grace_s: float = defaults.SHUTDOWN_GRACE_S,
    reasoning_parser: str = "auto",
) -> Starlette:
    """The OpenAI-compatible ASGI app over a running (or startable) AsyncLLMEngine.

    model_name: the id clients send as `model` and /v1/models lists.
    api_key: when set, /v1/* and /metrics need `Authorization: Bearer <api_key>`; /health stays open.
    max_queue: most requests held at once (running + waiting); beyond that, 429 with Retry-After.
    max_body_bytes: larger request bodies get 413.
    default_max_tokens: completion length when a request gives none (also capped by the context left).
    shutdown_grace_s: after `app.state.lowvram.begin_shutdown()`, how long in-flight requests may run on.
    reasoning_parser: "deepseek_r1" answers chat with the text before </think> as `reasoning_content`, "none"
    leaves it in `content`, "auto" is deepseek_r1 when the model's chat template has <think> tags.
    The caller owns the engine: the app starts it if needed but never stops it.
    """
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser = {reasoning_parser!r}; use one of {', '.join(REASONING_PARSERS)}")
    if max_queue < 1 or max_body_bytes < 1 or default_max_tokens < 1 or shutdown_grace_s < 0:
        raise ValueError("max_queue, max_body_bytes and default_max_tokens must be positive, shutdown_grace_s >= 0")
    limits = (max_queue, max_body_bytes, default_max_tokens, shutdown_grace_s)
    state = ServerState(async_engine, model_name, api_key, *limits)
    is_auto_on = reasoning_parser == "auto" and state.engine.tokenizer.uses_reasoning_tags
    state.is_reasoning_parsed = reasoning_parser == "deepseek_r1" or is_auto_on

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        async_engine.start()
        yield
        state.end_all("shutdown")  # only what outlived the ASGI server's own grace period

    routes = [
        _route("/v1/models", _list_models),
        _route("/v1/models/{model:path}", _retrieve_model),
        _route("/v1/completions", partial(_generate, shape_type=CompletionShape), "POST"),
        _route("/v1/chat/completions", partial(_generate, shape_type=ChatShape), "POST"),
        _route("/v1/status", _status),
        _route("/health", _health, needs_auth=False),
        _route("/metrics", _metrics),
    ]
    middleware = [Middleware(_count_responses, metrics=state.metrics)]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error}, middleware=middleware
    )
    app.state.lowvram = state
    return app
