"""Defaults shared by create_app and `lowvram serve`, apart from the app so the CLI parser needs no web stack."""

MAX_QUEUE = 64
MAX_BODY_BYTES = 1 << 20  # far above any prompt that fits a 4 GB card's context
MAX_TOKENS = 4096  # when a request gives no max_tokens; never more than the context left
SHUTDOWN_GRACE_S = 30
