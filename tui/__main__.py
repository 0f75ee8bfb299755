"""`python -m lowvram.tui [args]` runs the chat, as `lowvram chat [args]` does."""

import sys

from lowvram.tui.cli import main

sys.exit(main())
