"""`python -m blockspec.serve --model-path ...`: the same as `blockspec serve`."""
from __future__ import annotations

from blockspec.engine.process_exit import exit_now
from blockspec.server.launch import main

if __name__ == "__main__":
    exit_now(main(prog="python -m blockspec.serve"))
