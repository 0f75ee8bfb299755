import sys

from lowvram.cli import main

sys.exit(main())
