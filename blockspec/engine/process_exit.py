"""Ending a `blockspec serve` process (the server, its engine process, its extra HTTP server processes) once its work
is done, without the interpreter's teardown."""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flushes the logs and standard streams, then exits with `code` at once.

    NOTE: a process that imported torch (and Triton) spent 1–3 s in interpreter teardown (module and object
    finalisation) after its last useful act, more on a loaded machine; a parent waits for its children's, so a
    SIGTERMed server overran --shutdown-grace-s by that much per process. Nothing is left for the teardown to do:
    sockets are closed, requests answered, the engine shut down; the OS takes back the memory."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # NOTE: a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)
