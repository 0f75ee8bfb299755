"""The OpenAI-compatible HTTP server behind `lowvram serve`: `create_app(AsyncLLMEngine(engine).start(),
model_name="my-model")`. Importing the package stays cheap; the web stack loads with `create_app`."""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name != "create_app":
        raise AttributeError(f"module 'lowvram.server' has no attribute {name!r}")
    from lowvram.server.app import create_app

    return create_app
