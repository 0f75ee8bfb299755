"""`lowvram ps`: ask a running server what it holds and does (GET /v1/status, server/status.py)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from lowvram.errors import LowvramError
from lowvram.server.cli import API_KEY_ENV


def fetch_status(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict:
    """GET {url}/v1/status; one clear LowvramError when nothing answers or the key is refused."""
    base = url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(f"{base}/v1/status")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        hint = "; pass --api-key or set LOWVRAM_API_KEY" if exc.code == 401 else ""
        raise LowvramError(f"the server at {base} answered {exc.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LowvramError(
            f"no lowvram server answers at {base} ({reason}); start one with `lowvram serve`, or pass --url"
        ) from None


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"


def format_status(status: dict) -> str:
    """The few lines `lowvram ps` prints."""
    weights, kv, context = status["weights"], status["kv_cache"], status["context"]
    controller, requests = status["controller"], status["requests"]
    lines = [
        ("model", f"{status['model']} ({status['architecture']}, {status['weight_format']})"),
        ("device", f"{status['device']}, {status['profile']} profile"),
        ("weights", f"{_mib(weights['device_bytes'])} on the device, {_mib(weights['host_bytes'])} in host memory"),
        (
            "KV cache",
            f"{kv['precision']} ({kv['backend']}): {kv['num_blocks_used']} of {kv['num_blocks']} pages used, "
            f"{_mib(kv['device_bytes'])} on the device, {_mib(kv['host_bytes'])} in host memory",
        ),
        ("context", f"{context['num_tokens_in_use']} tokens in use (at most {context['max_model_len']} a request)"),
        (
            "controller",
            controller["mode"] + (f": {controller['last_decision']}" if controller["last_decision"] else ""),
        ),
        ("requests", f"{requests['running']} running, {requests['waiting']} waiting"),
    ]
    return "\n".join(f"{name:<11} {value}" for name, value in lines)


def add_ps_parser(subparsers) -> None:
    """Register `lowvram ps` on the `lowvram` command's subparsers."""
    ps = subparsers.add_parser(
        "ps",
        help="what a running `lowvram serve` holds and does (GET /v1/status)",
        description="Ask a running server for its model, weight format, where its weights and KV cache live, "
        "the context in use, the controller's mode and the requests running and waiting.",
    )
    ps.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    key_help = f"the server's API key (default: ${API_KEY_ENV})"
    ps.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=key_help)
    ps.add_argument("--json", action="store_true", help="print the server's JSON as it is")
    ps.set_defaults(func=cmd_ps)


def cmd_ps(args) -> int:
    status = fetch_status(args.url, args.api_key)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
