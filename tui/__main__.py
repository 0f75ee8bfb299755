"""`python -m lowvram.tui [args]` runs the chat, as `lowvram chat [args]` does."""

import sys

from lowvram.cli import main

sys.exit(main(["chat", *sys.argv[1:]]))
