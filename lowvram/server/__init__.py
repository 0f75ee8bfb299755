"""The OpenAI-compatible HTTP server behind `lowvram serve`.

    from lowvram.server import create_app
    app = create_app(AsyncLLMEngine(engine).start(), model_name="my-model")

Importing this package stays cheap (the CLI imports it for --help); the web
stack is imported only when `create_app` is first used.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from lowvram.server.app import create_app

        return create_app
    raise AttributeError(f"module 'lowvram.server' has no attribute {name!r}")
