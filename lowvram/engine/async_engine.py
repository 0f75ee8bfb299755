"""One engine loop in a background thread, per-request async token streams (server, chat UI).
The loop thread owns the LLMEngine: adds, aborts and calls run there between steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.engine import EngineSnapshot, LLMEngine
from lowvram.engine.outputs import RequestOutput
from lowvram.errors import LowvramError

log = logging.getLogger("lowvram")


class AsyncLLMEngine:
    """Wraps an LLMEngine; `start()` launches the loop thread, `stop()` ends it. While started,
    the loop thread is the engine's only driver: do not call the engine from other threads."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()  # functions for the loop thread; None stops it
        self._streams: dict = {}  # request id -> (asyncio queue, its event loop)
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._ids = itertools.count()
        self._snapshot: EngineSnapshot | None = None

    def start(self) -> AsyncLLMEngine:
        if self._thread is None:
            self._snapshot = self.engine.snapshot()
            self._thread = threading.Thread(target=self._loop, name="lowvram-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is still running and end the loop thread."""
        self._is_stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._is_stopping

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of the last step (taken in the loop thread)."""
        return self._snapshot or self.engine.snapshot()

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def _check_running(self) -> None:
        if self._thread is None:
            raise LowvramError("the engine loop is not running; call start() first")

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per new token, the last one finished; bad input raises RequestError."""
        self._check_running()
        stream: asyncio.Queue = asyncio.Queue()
        entry = (stream, asyncio.get_running_loop())
        params = params or SamplingParams()
        self._commands.put(lambda: self._add(request_id, entry, prompt, params, prompt_token_ids, messages))
        is_finished = False
        try:
            while not is_finished:
                item = await stream.get()
                is_finished = isinstance(item, BaseException) or item.finished
                if isinstance(item, BaseException):  # the request could not run
                    raise item
                yield item
        finally:
            if not is_finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._abort(request_id))

    async def call(self, fn):
        """`fn(engine)` run in the loop thread between steps; returns its result or raises."""
        self._check_running()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # handed to the caller, the loop keeps serving
                future.set_exception(exc)

        self._commands.put(run)
        return await asyncio.wrap_future(future)

    def _add(self, request_id, entry, prompt, params, prompt_token_ids, messages) -> None:
        self._streams[request_id] = entry
        try:
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids, messages=messages)
        except Exception as exc:  # a bad request fails alone; the loop keeps serving
            if not isinstance(exc, LowvramError):
                log.exception("request %s could not be added", request_id)
            self._fail(request_id, exc)

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)

    def _fail(self, request_id: str, error: BaseException) -> None:
        self._deliver(request_id, error)
        self._abort(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if request_id in self._streams:
            stream, loop = self._streams[request_id]
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                self._abort(request_id)

    def _loop(self) -> None:
        while not self._is_stopping:
            is_busy = self.engine.has_unfinished_requests()
            try:  # block only when idle; while requests run, take commands without waiting
                command = self._commands.get_nowait() if is_busy else self._commands.get(timeout=0.1)
            except queue.Empty:
                if not is_busy:
                    continue
                command = self._step
            if command is None:
                break
            command()
            self._snapshot = self.engine.snapshot()
        for request_id in list(self._streams):
            self._fail(request_id, LowvramError("the engine is shutting down"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # keep serving: fail the running requests, not the process
            log.exception("engine step failed")
            for request_id in list(self._streams):
                self._fail(request_id, exc)
            return
        for out in outputs:
            self._deliver(out.request_id, out)
            if out.finished:
                self._streams.pop(out.request_id, None)
