"""`lowvram serve`: the OpenAI-compatible server under uvicorn (cheap to import: the CLI parser needs it).
Beyond loopback it needs an API key unless --insecure-no-auth. SIGINT/SIGTERM stop admissions (503), give
in-flight requests --shutdown-grace-s seconds, then end the rest cleanly; a second Ctrl-C quits."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from lowvram.errors import ConfigError
from lowvram.server import defaults

API_KEY_ENV = "LOWVRAM_API_KEY"


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def check_exposure(host: str, api_key: str | None, is_insecure_no_auth: bool) -> None:
    """Refuse to serve without a key on an address other machines can reach."""
    if is_loopback(host) or api_key or is_insecure_no_auth:
        return
    raise ConfigError(
        f"--host {host} makes the server reachable from other machines; protect it with --api-key KEY "
        f"(or the {API_KEY_ENV} environment variable), or pass --insecure-no-auth to serve without one"
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so that a taken port fails in a second, not after the load."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port; pick one from 1 to 65535 (0: any free port)")
    try:
        family = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][0]
        # Naming the protocol matters: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
        # proto is IPPROTO_TCP, and with Nagle on every small response waits ~40 ms for a delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port or --host"
        ) from None
    # Listening now lets a client that connects before uvicorn takes over wait in the backlog, not be refused.
    sock.listen(2048)
    return sock


def _uvicorn_server(app, *, log_level: str = "info", access_log: bool = True):
    import uvicorn

    state = app.state.lowvram

    class Server(uvicorn.Server):
        """uvicorn's server, with the app told to drain as soon as a stop signal arrives."""

        drain_deadline = math.inf

        def handle_exit(self, sig, frame) -> None:
            if state.is_draining:  # a second signal: stop now
                self.should_exit = True
                return super().handle_exit(sig, frame)
            if threading.current_thread() is threading.main_thread():
                # os.write, unlike print, is safe inside a signal handler
                grace = f"get up to {state.shutdown_grace_s:g} s to finish; Ctrl-C again quits now"
                os.write(2, f"lowvram: stopping: {state.num_in_flight} requests in flight {grace}\n".encode())
            state.begin_shutdown()
            # Still listening while they finish, so that new connections get the documented 503
            self.drain_deadline = time.monotonic() + state.shutdown_grace_s + 1

        async def on_tick(self, counter: int) -> bool:
            if state.is_draining and (state.num_in_flight == 0 or time.monotonic() > self.drain_deadline):
                self.should_exit = True
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its shutdown, which would skip our cleanup
            # and exit with a signal status; we have already shut down gracefully.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    # uvicorn's own grace period is a backstop behind the app's: it cancels what is still running.
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on")
    config.timeout_graceful_shutdown = int(state.shutdown_grace_s) + 5
    return Server(config)


class BackgroundServer:
    """Serve an app from a background thread on a bound socket (embedding, tests):
    `with BackgroundServer(app, sock) as server:` ... http://127.0.0.1:{server.port}/v1 ..."""

    def __init__(self, app, sock: socket.socket, *, log_level: str = "warning"):
        self.app = app
        self.port = sock.getsockname()[1]
        self.server = _uvicorn_server(app, log_level=log_level, access_log=False)
        self._thread = threading.Thread(target=self.server.run, args=([sock],), name="lowvram-server", daemon=True)

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError("the server did not start")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down as SIGTERM would: drain, end what is left after the grace period, then wait."""
        self.app.state.lowvram.begin_shutdown()
        self.server.should_exit = True
        self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def served_name(model: str | None, model_dir: Path) -> str:
    """The id clients send as `model`: a GGUF file's own name, not its converted copy's cache key; a hub
    model's id, not its snapshot's commit hash."""
    if model is not None and model_dir.parent.name == "snapshots":
        return str(model)
    return Path(model).stem if model is not None and str(model).endswith(".gguf") else model_dir.name


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the `lowvram` command's subparsers."""
    from lowvram.engine.args import add_engine_args

    p = subparsers.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics).",
    )
    add_engine_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch (overrides the profile)")
    host = "address to listen on (default 127.0.0.1: this machine only); others need --api-key"
    p.add_argument("--host", default="127.0.0.1", help=host)
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    key = f"require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: ${API_KEY_ENV}); prefer the "
    key += "variable: arguments are visible to other users in the process list"
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=key)
    no_auth = "allow a non-loopback --host without an API key (anyone who can reach it can use it)"
    p.add_argument("--insecure-no-auth", action="store_true", help=no_auth)
    name = "the model id clients send (default: the model directory's name); vLLM's value moves clients unchanged"
    p.add_argument("--served-model-name", help=name)
    for flag, kind, default, help_text in (
        ("--max-queue", int, defaults.MAX_QUEUE, "most requests running or waiting; more get 429 with Retry-After"),
        ("--max-body-bytes", int, defaults.MAX_BODY_BYTES, "larger request bodies get 413"),
        ("--default-max-tokens", int, defaults.MAX_TOKENS, "reply length without max_tokens, at most the context left"),
        ("--shutdown-grace-s", float, defaults.SHUTDOWN_GRACE_S, "on SIGINT/SIGTERM, how long requests may finish"),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{help_text} (default {default})")
    reasoning = "chat replies' reasoning before </think> goes to reasoning_content, as vLLM's deepseek_r1 parser "
    reasoning += "does (none: left in content; default auto: on when the chat template has <think> tags)"
    choices = ("auto", "deepseek_r1", "none")  # lowvram.server.app.REASONING_PARSERS, without importing the app
    p.add_argument("--reasoning-parser", choices=choices, default="auto", help=reasoning)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from lowvram.engine.args import engine_kwargs
    from lowvram.engine.async_engine import AsyncLLMEngine
    from lowvram.engine.engine import LLMEngine
    from lowvram.server.app import create_app

    check_exposure(args.host, args.api_key, args.insecure_no_auth)
    limits = {k: vars(args)[k] for k in ("max_queue", "max_body_bytes", "default_max_tokens", "shutdown_grace_s")}
    for name, value in list(limits.items())[:3]:
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} = {value} must be a positive integer")
    if args.shutdown_grace_s < 0:
        raise ConfigError(f"--shutdown-grace-s = {args.shutdown_grace_s:g} must be zero or more")
    sock = bind_socket(args.host, args.port)
    if args.model is None:
        demo = "a few-million-parameter model trained for lowvram's tests, not a real DeepSeek model"
        print(f"lowvram: serving the bundled demo model ({demo}); pass --model for a real one", file=sys.stderr)
    try:
        engine = LLMEngine(args.model, args.profile, max_num_seqs=args.max_num_seqs, **engine_kwargs(args))
    except BaseException:
        sock.close()
        raise
    model_name = args.served_model_name or served_name(args.model, engine.model_dir)
    async_engine = AsyncLLMEngine(engine).start()
    try:
        reasoning = args.reasoning_parser
        app = create_app(
            async_engine, model_name=model_name, api_key=args.api_key, reasoning_parser=reasoning, **limits
        )
        host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
        port = sock.getsockname()[1]
        auth = "API key required" if args.api_key else "no API key"
        if not is_loopback(args.host) and not args.api_key:
            print(f"lowvram: WARNING: serving on {args.host} without an API key (--insecure-no-auth)", file=sys.stderr)
        where = f"({engine.profile.name} profile, {engine.device}) at http://{host}:{port}/v1 ({auth})"
        print(f"lowvram: serving '{model_name}' {where}; Ctrl-C to stop", file=sys.stderr)
        if app.state.lowvram.is_reasoning_parsed:
            note = "chat replies give the model's <think> reasoning as reasoning_content (--reasoning-parser none: in content)"
            print(f"lowvram: {note}", file=sys.stderr)
        is_verbose = getattr(args, "verbose", False)
        _uvicorn_server(app, log_level="info" if is_verbose else "warning", access_log=is_verbose).run([sock])
    finally:
        async_engine.stop()
        sock.close()
    print("lowvram: server stopped", file=sys.stderr)
    return 0
