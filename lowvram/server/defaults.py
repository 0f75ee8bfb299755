"""Defaults shared by create_app and `lowvram serve`, apart from the app so that building
the CLI parser does not import the web stack."""

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20  # far above any prompt that fits a 4 GB card's context
DEFAULT_MAX_TOKENS = 4096  # when a request gives no max_tokens; never more than the context left
DEFAULT_SHUTDOWN_GRACE_S = 30.0
