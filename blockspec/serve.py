"""`python -m blockspec.serve --model-path ...`: the same as `blockspec serve`."""
from __future__ import annotations

import sys

from blockspec.server.launch import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m blockspec.serve"))
