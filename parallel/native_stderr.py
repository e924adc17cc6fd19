"""Keeps what native libraries write to stderr off the terminal unless something fails.

libtpu, loaded for an ahead-of-time compile on a machine without a TPU, prints a screen of
start-up warnings (no host bounds, no worker hostnames, "Logging before InitGoogle()")
that are expected there. It writes them from C++ straight to file descriptor 2, past
Python's sys.stderr, so only redirecting the descriptor itself hides them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator


@contextlib.contextmanager
def shown_only_on_failure() -> Iterator[None]:
    """Sends file descriptor 2 to a temporary file for the block; if the block raises,
    writes what was captured to the real stderr before the exception goes on."""
    sys.stderr.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                captured.seek(0)
                sys.stderr.write(captured.read().decode(errors="replace"))
                sys.stderr.flush()
