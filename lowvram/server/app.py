"""The OpenAI-compatible HTTP app: routes, admission, streaming and errors.

Design. Every admitted request becomes a `_Generation`: a task pumps the
engine's token stream into a queue and the handler reads that queue. The server
can therefore end a request at any moment, whatever the handler is waiting on:
a disconnect watcher (the client went away) or the shutdown timer cancels the
pump task, which aborts the request in the engine and frees its KV pages. Each
generation holds one slot of a bounded queue (`max_queue`); a request that finds
no slot gets 429 with Retry-After instead of waiting unboundedly.

Requests are parsed, validated and tokenized here, before admission to the
engine, so that every mistake in a request is a 4xx with an OpenAI error object
sent before any streamed byte. The model is fixed when the app is built: the
`model` field only selects among the names listed by /v1/models, so no request
can make the server open a path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.async_engine import AsyncLLMEngine
from lowvram.engine.outputs import RequestOutput
from lowvram.errors import LowvramError, RequestError
from lowvram.server.defaults import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHUTDOWN_GRACE_S,
)
from lowvram.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lowvram.server.metrics import ServerMetrics
from lowvram.server.schemas import (
    ChatCompletionRequest,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    describe_validation_error,
    error_body,
    json_bytes,
    model_card,
    usage,
)

log = logging.getLogger("lowvram")

RETRY_AFTER_FULL_S = 1
RETRY_AFTER_SHUTDOWN_S = 5
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


def _printable(text: str | None, max_chars: int = 300) -> str | None:
    # Error text can quote request keys, which may hold unpaired surrogates that UTF-8 cannot carry.
    if text is None:
        return None
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(body), status_code=status, headers=headers, media_type="application/json")


class ApiError(Exception):
    """Answered as an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(_printable(str(self), 2000), type=self.type, param=_printable(self.param), code=self.code)

    def response(self) -> Response:
        return _json_response(self.body(), self.status, self.headers)


class _Ended(Exception):
    """The server ended a generation before the engine finished it: 'disconnect' or 'shutdown'."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Generation:
    """One admitted request on the engine. `next_output()` yields its outputs in order.

    `end(reason)` may be called from anywhere on the event loop: the pump task is
    cancelled (the engine stream's cleanup aborts the request and frees its
    pages) and the reader gets `_Ended(reason)` after the outputs already queued.
    `close()` must run once the handler is done; it gives the queue slot back.
    """

    def __init__(self, state: ServerState, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.state = state
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.admitted_at = time.perf_counter()
        self._last_token_at: float | None = None
        self._items: asyncio.Queue = asyncio.Queue()
        self._is_closed = False
        state.generations.add(self)
        state.metrics.prompt_tokens.inc(amount=self.num_prompt_tokens)
        self._task = asyncio.create_task(self._pump(prompt_token_ids, params))

    async def _pump(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            async for out in self.state.async_engine.generate(
                self.request_id, None, params, prompt_token_ids=prompt_token_ids
            ):
                self._items.put_nowait(out)
        except asyncio.CancelledError:
            pass  # end() was called; cancelling the engine stream has already aborted the request
        except Exception as exc:  # delivered to the reader, which turns it into an error response
            self._items.put_nowait(exc)

    def end(self, reason: str) -> None:
        if not self._task.done():
            self._task.cancel()
        self._items.put_nowait(_Ended(reason))

    async def next_output(self) -> RequestOutput:
        """The next output; raises _Ended if the server ended the request, or the engine's error."""
        item = await self._items.get()
        if isinstance(item, BaseException):
            self.finish_reason = self.finish_reason or (item.reason if isinstance(item, _Ended) else "error")
            raise item
        now = time.perf_counter()
        metrics = self.state.metrics
        if self._last_token_at is None:
            metrics.ttft.observe(now - self.admitted_at)
        else:
            metrics.token_latency.observe(now - self._last_token_at)
        self._last_token_at = now
        self.num_output_tokens = len(item.outputs[0].token_ids)
        metrics.generation_tokens.inc()
        metrics.observe_snapshot(self.state.async_engine.snapshot())
        if item.finished:
            self.finish_reason = item.outputs[0].finish_reason
        return item

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if not self._task.done():
            self._task.cancel()
        self.state.generations.discard(self)
        self.state.release()
        self.state.metrics.finished.inc(self.finish_reason or "abort")

    def usage(self) -> dict:
        return usage(self.num_prompt_tokens, self.num_output_tokens)


async def _watch_disconnect(receive, generation: _Generation) -> None:
    """End the generation when the client goes away (uvicorn reports it as http.disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            generation.end("disconnect")
            return


class ServerState:
    """Everything the routes share. Built by `create_app`, found at `app.state.lowvram`."""

    def __init__(
        self,
        async_engine: AsyncLLMEngine,
        *,
        model_name: str,
        api_key: str | None,
        max_queue: int,
        max_body_bytes: int,
        default_max_tokens: int,
        shutdown_grace_s: float,
    ):
        self.async_engine = async_engine
        engine = async_engine.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.model_name = model_name
        self._api_key = api_key.encode("utf-8") if api_key else None
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.shutdown_grace_s = shutdown_grace_s
        self.metrics = ServerMetrics(model_name)
        self.generations: set[_Generation] = set()
        self.num_in_flight = 0  # admitted requests, including those still being tokenized
        self.is_draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())

    # -- admission ---------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest takes time independent of where the strings differ
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), self._api_key):
            raise ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                "the server was started with",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404,
                f"the model '{name}' does not exist on this server; it serves '{self.model_name}' (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def admit(self) -> None:
        if self.is_draining:
            self.metrics.rejected.inc("shutdown")
            raise ApiError(
                503,
                "the server is shutting down and takes no new requests",
                type="server_error",
                code="server_shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_SHUTDOWN_S)},
            )
        if self.num_in_flight >= self.max_queue:
            self.metrics.rejected.inc("queue_full")
            raise ApiError(
                429,
                f"the server is busy: {self.num_in_flight} requests are in flight, the most it queues "
                f"(max_queue = {self.max_queue}); retry after a moment",
                type="rate_limit_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_FULL_S)},
            )
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1

    # -- shutdown ----------------------------------------------------------------
    def begin_shutdown(self, grace_s: float | None = None) -> None:
        """Refuse new requests; in-flight ones get `grace_s` to finish, then are ended cleanly.

        Safe to call from a signal handler or another thread.
        """
        self.is_draining = True
        grace_s = self.shutdown_grace_s if grace_s is None else grace_s
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                self.loop.call_soon_threadsafe(lambda: self.loop.call_later(grace_s, self.end_all, "shutdown"))

    def end_all(self, reason: str) -> None:
        for generation in list(self.generations):
            generation.end(reason)

    # -- turning a request into engine input -------------------------------------
    def encode(self, request: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """Prompt token ids; runs in a worker thread (tokenizing a long prompt takes a while)."""
        if isinstance(request, ChatCompletionRequest):
            messages = [m.for_template() for m in request.messages]
            try:
                ids = self.tokenizer.apply_chat_template(messages)
            except LowvramError:
                raise
            except Exception as exc:  # templates reject conversations with jinja's raise_exception
                raise RequestError(f"the model's chat template rejected the messages: {exc}") from None
            param = "messages"
        else:
            prompt = request.prompt_input()
            param = "prompt"
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                if any(not 0 <= t < self.vocab_size for t in prompt):
                    raise ApiError(400, f"prompt token ids must be in 0..{self.vocab_size - 1}", param="prompt")
                ids = prompt
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {len(ids)} tokens; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    def sampling_params(
        self, request: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int
    ) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        asked = request.requested_max_tokens()
        if asked is None:
            max_tokens = min(self.default_max_tokens, room)
        elif asked > room:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + asked} were requested ({num_prompt_tokens} in the prompt, {asked} "
                "for the completion); reduce the prompt or max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = asked
        return SamplingParams(max_tokens=max_tokens, **request.sampling_kwargs())


# -- streaming -------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def _sse(body: dict) -> bytes:
    return b"data: " + json_bytes(body) + b"\n\n"


def _failure(exc: BaseException) -> ApiError:
    """The error answer for a generation that failed or was ended by the server."""
    if isinstance(exc, _Ended):
        return ApiError(
            503,
            "the server is shutting down; the response was cut short",
            type="server_error",
            code="server_shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_SHUTDOWN_S)},
        )
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc))
    if isinstance(exc, LowvramError):
        return ApiError(503, str(exc), type="server_error")
    log.error("generation failed: %r", exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


class _EventStream(Response):
    """Server-sent events for one generation, in OpenAI's chunk format, ending with `data: [DONE]`.

    Watches for the client going away while it streams, so that a dropped
    connection aborts the request at once rather than at the next token.
    """

    media_type = "text/event-stream"

    def __init__(self, generation: _Generation, shape: CompletionShape, *, include_usage: bool):
        self.generation, self.shape, self.include_usage = generation, shape, include_usage
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[bytes]:
        first = self.shape.first()
        if first is not None:
            yield self._chunk(first)
        try:
            while True:
                out = await self.generation.next_output()
                if out.text_delta:
                    yield self._chunk(self.shape.delta(out.text_delta))
                if out.finished:
                    yield self._chunk(self.shape.finish(out.outputs[0].finish_reason))
                    break
        except Exception as exc:  # the headers are gone: report in-band, as OpenAI does
            if not (isinstance(exc, _Ended) and exc.reason == "disconnect"):  # else nobody is listening
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


# -- routes ------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.lowvram


def _answer_errors(handler):
    """Turn every failure of a route into an OpenAI error object; nothing reaches the ASGI server."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except RequestError as exc:
            return ApiError(400, str(exc), param=getattr(exc, "param", None)).response()
        except Exception:
            log.exception("error while answering %s %s", request.method, request.url.path)
            return ApiError(
                500, "internal server error; the server log has the details", type="server_error"
            ).response()

    route.__name__ = handler.__name__
    return route


async def _read_json(request: Request, max_body_bytes: int) -> dict:
    too_large = ApiError(
        413, f"the request body is larger than the server's limit of {max_body_bytes} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_body_bytes:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")

    def refuse_constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    def checked_object(pairs: list[tuple[str, object]]) -> dict:
        for key, _ in pairs:
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    400, "a key in the request body contains an unpaired UTF-16 surrogate (a broken \\u escape)"
                ) from None
        return dict(pairs)

    try:
        data = json.loads(body, parse_constant=refuse_constant, object_pairs_hook=checked_object)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"the request body is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not a JSON {type(data).__name__}")
    return data


def _parse(model: type[CompletionRequest] | type[ChatCompletionRequest], data: dict):
    try:
        request = model.model_validate(model.without_noop_params(data))
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise ApiError(400, message, param=param) from None
    if request.stream_options is not None and not request.is_stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return request


async def _generate(request: Request, request_model, shape_type: type[CompletionShape]) -> Response:
    state = _state(request)
    state.check_auth(request)
    body = _parse(request_model, await _read_json(request, state.max_body_bytes))
    state.check_model(body.model)
    state.admit()
    try:
        prompt_token_ids = await asyncio.to_thread(state.encode, body)
        params = state.sampling_params(body, len(prompt_token_ids))
    except BaseException:
        state.release()
        raise
    request_id = shape_type.id_prefix + uuid.uuid4().hex
    generation = _Generation(state, request_id, prompt_token_ids, params)
    shape = shape_type(request_id, state.model_name)
    if body.is_stream:
        return _EventStream(generation, shape, include_usage=body.include_usage)
    watcher = asyncio.create_task(_watch_disconnect(request.receive, generation))
    try:
        while not (out := await generation.next_output()).finished:
            pass
    except Exception as exc:
        if isinstance(exc, _Ended) and exc.reason == "disconnect":
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return _failure(exc).response()
    finally:
        watcher.cancel()
        generation.close()
    completion = out.outputs[0]
    return _json_response(shape.whole(completion.text, completion.finish_reason, generation.usage()))


@_answer_errors
async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, CompletionShape)


@_answer_errors
async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, ChatShape)


def _model_card(state: ServerState) -> dict:
    return model_card(state.model_name, state.created, state.max_model_len)


@_answer_errors
async def list_models(request: Request) -> Response:
    state = _state(request)
    state.check_auth(request)
    return _json_response({"object": "list", "data": [_model_card(state)]})


@_answer_errors
async def retrieve_model(request: Request) -> Response:
    state = _state(request)
    state.check_auth(request)
    state.check_model(request.path_params["model"])
    return _json_response(_model_card(state))


@_answer_errors
async def health(request: Request) -> Response:
    state = _state(request)
    status = "draining" if state.is_draining else "ok"
    body = {"status": status, "model": state.model_name, "requests_in_flight": state.num_in_flight}
    return _json_response(body, 503 if state.is_draining else 200)


@_answer_errors
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.check_auth(request)
    text = state.metrics.render(
        state.async_engine.snapshot(), num_in_flight=state.num_in_flight, max_queue=state.max_queue
    )
    return Response(text, media_type=METRICS_CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}; this server has " + ", ".join(ENDPOINTS)
        return ApiError(404, message, code="not_found").response()
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        return ApiError(405, message, code="method_not_allowed", headers=exc.headers).response()
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()


class _CountResponses:
    """ASGI middleware: counts answers by endpoint and status code for /metrics."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.inc(endpoint, str(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(
    async_engine: AsyncLLMEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
) -> Starlette:
    """The OpenAI-compatible ASGI app over a running (or startable) AsyncLLMEngine.

    model_name: the id clients send as `model` and /v1/models lists.
    api_key: when set, /v1/* and /metrics need `Authorization: Bearer <api_key>`; /health stays open.
    max_queue: most requests held at once (running + waiting); beyond that, 429 with Retry-After.
    max_body_bytes: larger request bodies get 413.
    default_max_tokens: completion length when a request gives none (also capped by the context left).
    shutdown_grace_s: after `app.state.lowvram.begin_shutdown()`, how long in-flight requests may run on.
    The caller owns the engine: the app starts it if needed but never stops it.
    """
    if max_queue < 1 or max_body_bytes < 1 or default_max_tokens < 1 or shutdown_grace_s < 0:
        raise ValueError("max_queue, max_body_bytes and default_max_tokens must be positive, shutdown_grace_s >= 0")
    state = ServerState(
        async_engine,
        model_name=model_name,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        default_max_tokens=default_max_tokens,
        shutdown_grace_s=shutdown_grace_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        async_engine.start()
        yield
        state.end_all("shutdown")  # only what outlived the ASGI server's own grace period

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
        middleware=[Middleware(_CountResponses, metrics=state.metrics)],
    )
    app.state.lowvram = state
    return app
