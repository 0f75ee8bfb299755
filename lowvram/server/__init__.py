"""The OpenAI-compatible HTTP server behind `lowvram serve`.

    from lowvram.server import create_app
    app = create_app(AsyncLLMEngine(engine).start(), model_name="my-model")

Importing this package stays cheap (the CLI imports it for --help); the web
stack is imported only when `create_app` is first used.
"""

__all__ = ["create_app"]

# Defaults shared by create_app and `lowvram serve`, kept here so that building
# the CLI parser does not import the web stack.
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20  # far above any prompt that fits a 4 GB card's context
DEFAULT_MAX_TOKENS = 4096  # when a request gives no max_tokens; never more than the context left
DEFAULT_SHUTDOWN_GRACE_S = 30.0


def __getattr__(name: str):
    if name == "create_app":
        from lowvram.server.app import create_app

        return create_app
    raise AttributeError(f"module 'lowvram.server' has no attribute {name!r}")
